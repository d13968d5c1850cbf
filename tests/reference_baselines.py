"""Plain NumPy models of the baseline all-reduces, written from their module docstrings
(independent of the JAX code): loops over workers, stable-argsort top-k."""

import math

import numpy as np

from tests.reference import topk_offsets


def _k(density, n):
  return min(n, max(1, math.ceil(density * n)))


def topka(xs, rs, density):
  p, n = xs.shape
  g = xs + rs
  y = np.zeros(n, xs.dtype)
  new_rs = g.copy()
  for w in range(p):
    off = topk_offsets(g[w], _k(density, n))
    y[off] += g[w, off]
    new_rs[w, off] = 0
  return y / np.asarray(p, xs.dtype), new_rs


def topkdsa(xs, rs, density, capacity=2.0):
  p, n = xs.shape
  k = _k(density, n)
  region = -(-n // p)
  c = max(1, min(region, k, math.ceil(capacity * k / p)))
  g = xs + rs
  new_rs = g.copy()
  y = np.zeros(n, xs.dtype)
  for w in range(p):
    off = topk_offsets(g[w], k)
    by_size = off[np.argsort(-np.abs(g[w, off]), kind="stable")]
    for j in range(p):
      mine = [o for o in by_size if o // region == j][:c]
      y[mine] += g[w, mine]
      new_rs[w, mine] = 0
  return y / np.asarray(p, xs.dtype), new_rs


def gtopk(xs, rs, density):
  p, n = xs.shape
  k = _k(density, n)
  g = xs + rs
  new_rs = g.copy()
  held = {}
  for w in range(p):
    off = topk_offsets(g[w], k)
    held[w] = dict(zip(off.tolist(), g[w, off]))
    new_rs[w, off] = 0
  for j in range((p - 1).bit_length()):
    s = 2**j
    for w in range(0, p, 2 * s):
      if w + s >= p:
        continue
      total = dict(held[w])
      for o, v in held.pop(w + s).items():
        total[o] = total.get(o, np.float32(0)) + v
      offs = np.array(sorted(total))
      vals = np.array([total[o] for o in offs], xs.dtype)
      keep = np.sort(np.argsort(-np.abs(vals), kind="stable")[:k])
      drop = np.setdiff1d(np.arange(len(offs)), keep)
      new_rs[w, offs[drop]] += vals[drop]
      held[w] = dict(zip(offs[keep].tolist(), vals[keep]))
  y = np.zeros(n, xs.dtype)
  for o, v in held[0].items():
    y[o] = v / np.asarray(p, xs.dtype)
  return y, new_rs


def oktopk_init(p, n):
  region = -(-n // p)
  return {"residual": np.zeros((p, n), np.float32), "local": np.zeros(p, np.float32),
          "global": np.float32(0), "bounds": np.minimum(np.arange(p + 1) * region, n),
          "step": 0}


def _kth(magnitudes, k):
  return np.sort(magnitudes)[::-1][k - 1]


def oktopk(xs, state, density, capacity=2.0, tau=32, tau_regions=32):
  """One Ok-Topk step; thresholds are |value| magnitudes (float32). Returns (y, state)."""
  p, n = xs.shape
  k = _k(density, n)
  c = max(1, min(n, math.ceil(capacity * k / p)))
  estimate = state["step"] % tau == 0
  g = xs + state["residual"]
  residual = g.copy()
  local = state["local"].copy()
  bounds = state["bounds"]
  owner = np.clip(np.searchsorted(bounds, np.arange(n), side="right") - 1, 0, p - 1)
  totals = [dict() for _ in range(p)]  # owner j: offset -> sum, in sender order
  for w in range(p):
    if estimate:
      local[w] = _kth(np.abs(g[w]), k)
    for j in range(p):
      mine = [i for i in np.flatnonzero(np.abs(g[w]) >= local[w]) if owner[i] == j][:c]
      for i in mine:
        totals[j][i] = totals[j].get(i, np.float32(0)) + g[w, i]
        residual[w, i] = 0
  sent = []
  for j in range(p):
    offs = np.array(sorted(totals[j]), dtype=np.int64)
    sums = np.array([totals[j][i] for i in offs], np.float32)
    candidate = np.ones(len(offs), bool) if estimate else np.abs(sums) >= state["global"]
    keys = np.where(candidate, np.abs(sums), -1)
    chosen = np.sort(np.argsort(-keys, kind="stable")[:c])
    chosen = chosen[candidate[chosen]]
    for idx in np.setdiff1d(np.arange(len(offs)), chosen):
      residual[j, offs[idx]] += sums[idx]
    sent.append((offs[chosen], sums[chosen]))
  gathered = np.concatenate([np.abs(v) for _, v in sent] + [np.zeros(p * c)])[:p * c]
  threshold = _kth(gathered, min(k, p * c)) if estimate else state["global"]
  y = np.zeros(n, np.float32)
  result = []
  for j, (offs, sums) in enumerate(sent):
    accept = np.abs(sums) >= threshold
    y[offs[accept]] = sums[accept] / np.float32(p)
    result.extend(offs[accept].tolist())
    for i, v in zip(offs[~accept], sums[~accept]):
      residual[j, i] += v
  if (state["step"] + 1) % tau_regions == 0 and len(result) >= p:
    ordered = np.sort(result)
    bounds = np.concatenate([[0], ordered[(np.arange(1, p) * len(ordered)) // p], [n]])
  return y, {"residual": residual, "local": local, "global": np.float32(threshold),
             "bounds": bounds, "step": state["step"] + 1}


def dense_bf16(xs):
  """DDP's bf16 compression over a ring: each device's x / P rounded to bfloat16; chunk j
  (of ceil(n / P)) summed in bfloat16 in ring order from device j (each addition rounded);
  the sums cast back to float32."""
  import ml_dtypes

  bf16 = ml_dtypes.bfloat16
  p, n = xs.shape
  c = math.ceil(n / p)
  terms = np.zeros((p, p * c), np.float32)
  terms[:, :n] = xs / np.float32(p)
  terms = terms.astype(bf16).reshape(p, p, c)  # [device, chunk, entry]
  out = np.zeros((p, c), bf16)
  for j in range(p):
    total = terms[j, j]
    for step in range(1, p):
      total = (terms[(j + step) % p, j].astype(np.float32)
               + total.astype(np.float32)).astype(bf16)
    out[j] = total
  return out.reshape(-1)[:n].astype(np.float32)


def chunks_of(size, chunk):
  """(chunk length, chunks): as few chunks as fit, of nearly equal length."""
  count = -(-size // chunk)
  return -(-size // count), count


def sparseloco_quantize(values, bits, sigmas):
  """Codes and decoded values: centred on the mean, bins of sigmas * std / 2^bits, each bin
  decoded to the mean of its values."""
  bins = 2 ** bits
  mean = values.mean()
  centred = values - mean
  std = np.sqrt((centred ** 2).sum() / max(len(values) - 1, 1))
  scale = sigmas * std / bins
  scale = scale if scale > 0 else 1.0
  codes = np.clip(np.round(centred / scale) + bins // 2, 0, bins - 1).astype(int)
  table = np.array([centred[codes == b].mean() if (codes == b).any() else 0.0
                    for b in range(bins)])
  return codes, mean + table[codes]


def sparseloco(xs, rs, shapes, density, chunk, bits, sigmas=6.0):
  """One aggregation of P workers: (y, new residuals)."""
  p, n = xs.shape
  g = xs.astype(np.float64) + rs
  y = np.zeros(n)
  new_rs = g.copy()
  for w in range(p):
    start = 0
    for shape in shapes:
      size = math.prod(shape)
      c, count = chunks_of(size, chunk)
      k = min(c, max(1, math.ceil(density * c)))
      leaf = np.zeros(c * count)
      leaf[:size] = g[w, start:start + size]
      chosen = np.concatenate([topk_offsets(leaf[j * c:(j + 1) * c], k) + j * c
                               for j in range(count)])
      values = leaf[chosen]
      sent = values if bits is None else sparseloco_quantize(values, bits, sigmas)[1]
      real = chosen < size
      y[start + chosen[real]] += sent[real]
      new_rs[w, start + chosen[real]] -= sent[real]
      start += size
  return y / p, new_rs
