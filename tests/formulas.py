"""The per-worker cost of every all-reduce, written once for the tests from the cost table of
docs/design.md (the paper's Table 1 made exact for our message formats), independently of
spardl_jax's own formulas: the traffic tests hold the compiled HLO to these numbers.

A pair is an int32 offset plus a value (``4 + value_bytes`` bytes). ``log`` is ceil(log2).
"""

import math


def log(x: int) -> int:
  return math.ceil(math.log2(x)) if x > 1 else 0


def kb(n: int, q: int, density: float) -> int:
  """Entries kept per block: m = ceil(n / Q), kb = min(m, max(1, ceil(density m)))."""
  m = math.ceil(n / q)
  return min(m, max(1, math.ceil(density * m)))


def k(n: int, density: float) -> int:
  """Entries a whole-vector top-k keeps."""
  return min(n, max(1, math.ceil(density * n)))


def spardl(p: int, n: int, density: float, *, teams: int = 1, sag: str = "recursive",
           h: int | None = None, value_bytes: int = 4, wire: str = "exact") -> dict:
  """SRS + (SAG) + Bruck: rounds, bytes and elements (4-byte words in the exact format) one
  worker sends.

  Compact blocks: 2 bytes of offset and 2 of value per slot, plus per block one count per
  65,536 offsets of the block length m (2 bytes each while kb < 65,536, else 4). Quantized
  blocks (int8/int4/int2): the same offsets and counts, the values' bits in 16-bit words, and
  one 16-bit exponent.
  """
  q = p // teams
  kb_ = kb(n, q, density)
  m = math.ceil(n / q)
  counts = math.ceil(m / 65536) * (2 if kb_ < 65536 else 4)
  bits = {"int8": 8, "int4": 4, "int2": 2}.get(wire)
  if wire == "compact":
    def block(slots):
      return 4 * slots + counts
  elif bits:  # 16-bit offsets, bits-bit values padded to 16-bit words, a 16-bit exponent
    def block(slots):
      return 2 * slots + 2 * math.ceil(slots * bits / 16) + 2 + counts
  else:
    def block(slots):
      return slots * (4 + value_bytes)
  blocks, rounds, words = 2 * (q - 1), 2 * log(q), 0
  pairs = 2 * kb_ * (q - 1)
  extra = 0
  if teams > 1 and sag == "recursive":
    rounds += int(math.log2(teams))
    blocks += int(math.log2(teams))
    pairs += kb_ * int(math.log2(teams))
  elif teams > 1:  # B-SAG: top-h across the teams, and the count word in the final gather
    rounds += log(teams)
    pairs += h * (teams - 1)
    extra = block(h) * (teams - 1)
    words = q - 1
  size = blocks * block(kb_) + extra + 4 * words
  return {"kb": kb_, "rounds": rounds, "bytes": size, "elements": size // 4}


def topka(p: int, n: int, density: float, value_bytes: int = 4) -> dict:
  """All-gather of every worker's top-k: log P rounds, k pairs to each of P - 1 workers."""
  return {"rounds": log(p), "bytes": k(n, density) * (p - 1) * (4 + value_bytes)}


def topkdsa(p: int, n: int, density: float, capacity: float = 2.0,
            value_bytes: int = 4) -> dict:
  """Split (P - 1 direct rounds of c pairs) then a Bruck gather of each region, sparse
  (P c pairs) or dense (the region's values) whichever is smaller."""
  k_ = k(n, density)
  region = math.ceil(n / p)
  c = max(1, min(region, k_, math.ceil(capacity * k_ / p)))
  pair = 4 + value_bytes
  dense = 2 * p * c >= region
  gather = region * value_bytes if dense else p * c * pair
  return {"rounds": (p - 1) + log(p), "bytes": (p - 1) * (c * pair + gather)}


def gtopk(p: int, n: int, density: float, value_bytes: int = 4) -> list[int]:
  """Bytes per rank: k pairs up and k pairs back down every tree edge the rank is on (round
  j pairs sender w, w mod 2^(j+1) = 2^j, with receiver w - 2^j)."""
  edges = [0] * p
  for j in range(log(p)):
    for w in range(p):
      if w % 2 ** (j + 1) == 2 ** j:
        edges[w] += 1
        edges[w - 2 ** j] += 1
  return [e * k(n, density) * (4 + value_bytes) for e in edges]


def oktopk(p: int, n: int, density: float, capacity: float = 2.0,
           value_bytes: int = 4) -> dict:
  """P - 1 direct rounds of c pairs, then a Bruck gather of c pairs per worker."""
  c = max(1, min(n, math.ceil(capacity * k(n, density) / p)))
  return {"rounds": (p - 1) + log(p), "bytes": (p - 1) * 2 * c * (4 + value_bytes)}


def dense_bf16(p: int, n: int) -> int:
  """Bytes per device of a ring all-reduce in bfloat16: 2 (P - 1) chunks of ceil(n / P)."""
  return 2 * (p - 1) * math.ceil(n / p) * 2


def dense(p: int, n: int, itemsize: int = 4) -> dict:
  """A ring all-reduce (XLA's): 2 (P - 1) rounds, each device sends 2 (P - 1) / P of n."""
  return {"rounds": 2 * (p - 1), "bytes": 2 * (p - 1) * n * itemsize // p}
