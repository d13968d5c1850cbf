"""A plain NumPy model of SparDL (d = 1), written from docs/design.md, independent of the
library: dense buffers in global block order, one loop over workers per step, and top-k by a
stable argsort. The tests compare the JAX implementation with it."""

import math

import ml_dtypes
import numpy as np


def topk_offsets(block, kb):
  """Offsets of the kb largest |values| (ties to the lower index), ascending."""
  order = np.argsort(-np.abs(block.astype(np.float32)), kind="stable")
  return np.sort(order[:kb])


def layout(n, q, density):
  m = -(-n // q)
  return m, min(m, max(1, math.ceil(density * m)))


def _top_of_union(s, union, kb):
  """Mask of the kb largest |s| among `union` (ties to the lower index); all of it if fewer."""
  keys = np.where(union, np.abs(s.astype(np.float32)), -1)
  order = np.argsort(-keys, kind="stable")[:kb]
  kept = np.zeros_like(union)
  kept[order] = True
  return kept & union


QUANTIZED = {"int8": 8, "int4": 4, "int2": 2}


def quantized(v, bits):
  """Each row of ``v`` as ``bits``-bit integers times a power of two ``2^e`` (``e`` at least
  -126, and at most the greatest with ``(2^(bits-1) - 1) 2^e`` below float32's largest finite
  value), rounded half to even and clipped to ``±(2^(bits-1) - 1)``: for int8 and int4 the
  least ``e`` with ``(2^(bits-1) - 1) 2^e >= max |row|``; for int2 the greatest with
  ``2^e <= max |row|`` (its largest values clip to ``±2^e``)."""
  qmax = 2 ** (bits - 1) - 1
  out = np.zeros_like(v)
  for i, row in enumerate(v.reshape(-1, v.shape[-1]).astype(np.float64)):
    top = np.abs(row).max()
    if top == 0:
      continue
    if bits == 2:
      e = int(np.floor(np.log2(top)))
      while 2.0 ** e > top:
        e -= 1
      while 2.0 ** (e + 1) <= top:
        e += 1
    else:
      e = int(np.ceil(np.log2(top / qmax)))
      while qmax * 2.0 ** (e - 1) >= top:
        e -= 1
      while qmax * 2.0 ** e < top:
        e += 1
    highest = 127
    while qmax * 2.0 ** highest > float(np.finfo(np.float32).max):
      highest -= 1
    e = min(max(e, -126), highest)
    out.reshape(-1, v.shape[-1])[i] = np.clip(np.round(row / 2.0 ** e), -qmax, qmax) * 2.0 ** e
  return out


def as_sent(v, wire):
  """Values as the wire carries them: float32 rounded to bfloat16 in the compact format;
  in a quantized one, each row (a block's values) scaled on its own."""
  if wire in QUANTIZED:
    return quantized(v, QUANTIZED[wire])
  if wire == "compact" and v.dtype == np.float32:
    return v.astype(ml_dtypes.bfloat16).astype(np.float32)
  return v


def spardl(xs, rs, density, residuals="global", teams=1, sag="recursive", h=None,
           wire="exact"):
  """One SparDL all-reduce of P workers.

  Args:
    xs, rs: (P, n) gradients and residuals, float32.
    residuals: 'global' (GRES), 'local' (each worker keeps its own gradient where it never
      selected anything) or 'none'.
    teams: d, contiguous teams of Q = P / d.
    sag: 'recursive' (R-SAG) or 'bruck' (B-SAG, sending top-h pairs across teams).
    wire: 'exact', 'compact' or a quantized format ('int8', 'int4', 'int2'). Compact rounds
      every value at its first send (a quantized format every block, on its own); the sender
      keeps value - rounded (a value held in copies by a group of teams: the group's
      lowest team keeps it).
  Returns:
    y (n,) the mean result, new residuals (P, n).
  """
  p, n = xs.shape
  d = teams
  q = p // d
  m, kb = layout(n, q, density)
  g = np.zeros((p, q * m), xs.dtype)
  g[:, :n] = xs + rs
  buf = g.reshape(p, q, m).copy()        # buf[w, b] = worker w's copy of its team's block b
  xi = np.full_like(buf, np.nan)          # in-procedure residuals, each set exactly once
  chose = np.zeros(buf.shape, bool)        # chose[w, b, o]: worker w ever selected it
  l = (q - 1).bit_length()

  def sparsify(w, b, k=kb):
    off = topk_offsets(buf[w, b], kb)
    vals = as_sent(buf[w, b, off], wire)
    if k < kb:  # B-SAG sends the top-h of its candidates as they travel
      keep = np.sort(np.argsort(-np.abs(vals.astype(np.float32)), kind="stable")[:k])
      off, vals = off[keep], vals[keep]
    assert np.isnan(xi[w, b]).all(), "a block was sparsified twice"
    xi[w, b] = buf[w, b]
    xi[w, b, off] = buf[w, b, off] - vals
    chose[w, b, off] = True
    return off, vals

  for s in range(1, l + 1):
    delta = 2 ** (l - s)
    bag = range(delta, q) if s == 1 else range(delta, 2 * delta)
    inbox = {}
    for w in range(p):
      t, r = divmod(w, q)
      inbox[t * q + (r + delta) % q] = [((r + j) % q, *sparsify(w, (r + j) % q)) for j in bag]
    for w in range(p):
      for b, off, vals in inbox[w]:
        assert np.isnan(xi[w, b]).all(), "received a block already sent"
        buf[w, b, off] += vals
  # Each worker's pairs of its own block r, as a dense (m,) vector and a mask.
  vec = np.zeros((p, m), xs.dtype)
  mask = np.zeros((p, m), bool)
  for w in range(p):
    off, vals = sparsify(w, w % q, h if (d > 1 and sag == "bruck") else kb)
    vec[w, off] = vals
    mask[w, off] = True
  shares = []  # (P, m) discard shares and rounding errors, in the order they arise

  def round_copies(vec, group):
    """vec as sent by groups of `group` teams holding copies; the lowest team keeps the
    rounding error."""
    sent = as_sent(vec, wire)
    holder = (np.arange(p) // q) % group == 0
    shares.append(np.where(holder[:, None], vec - sent, 0).astype(vec.dtype))
    return sent

  if d > 1 and sag == "recursive":
    for j in range(d.bit_length() - 1):
      vec = round_copies(vec, 2 ** j)
      new_vec, new_mask, share = np.zeros_like(vec), np.zeros_like(mask), np.zeros_like(vec)
      for w in range(p):
        t, r = divmod(w, q)
        low, high = sorted([w, (t ^ 2 ** j) * q + r])
        total = (np.zeros(m, xs.dtype) + vec[low]) + vec[high]
        union = mask[low] | mask[high]
        kept = _top_of_union(total, union, kb)
        new_vec[w] = np.where(kept, total, 0)
        new_mask[w] = kept
        share[w] = np.where(union & ~kept, total * np.asarray(0.5 ** (j + 1), xs.dtype), 0)
      vec, mask = new_vec, new_mask
      shares.append(share)
  elif d > 1:
    new_vec, new_mask = np.zeros_like(vec), np.zeros_like(mask)
    for w in range(p):
      r = w % q
      total = np.zeros(m, xs.dtype)
      for t in range(d):  # team order
        total = total + vec[t * q + r]
      union = mask[r::q].any(axis=0)
      kept = _top_of_union(total, union, kb)
      new_vec[w], new_mask[w] = np.where(kept, total, 0), kept
    vec, mask = new_vec, new_mask
  if d > 1:
    vec = round_copies(vec, d)
  result = np.zeros(q * m, xs.dtype)
  in_result = np.zeros(q * m, bool)
  for r in range(q):
    result[r * m:(r + 1) * m] = vec[r]
    in_result[r * m:(r + 1) * m] = mask[r]
  y = (result / np.asarray(p, xs.dtype))[:n]
  if residuals == "global":
    kept_xi = xi.reshape(p, -1).copy()
    for share in shares:  # added step by step, as the shares arrive
      for w in range(p):
        r = w % q
        kept_xi[w, r * m:(r + 1) * m] += share[w]
    new_rs = np.where(in_result, kept_xi, g)
  elif residuals == "local":  # a worker keeps only the rounding error of what it sent
    sent_error = np.where(chose, xi, 0).reshape(p, -1)
    new_rs = np.where(chose.reshape(p, -1), sent_error, g)
  else:
    new_rs = np.zeros_like(g)
  return y, new_rs[:, :n]
