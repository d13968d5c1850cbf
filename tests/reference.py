"""A plain NumPy model of SparDL (d = 1), written from docs/DESIGN.md, independent of the
library: dense buffers in global block order, one loop over workers per step, and top-k by a
stable argsort. The tests compare the JAX implementation with it."""

import math

import numpy as np


def topk_offsets(block, kb):
  """Offsets of the kb largest |values| (ties to the lower index), ascending."""
  order = np.argsort(-np.abs(block.astype(np.float32)), kind="stable")
  return np.sort(order[:kb])


def layout(n, q, density):
  m = -(-n // q)
  return m, min(m, max(1, math.ceil(density * m)))


def spardl(xs, rs, density, residuals="global"):
  """One SparDL all-reduce of P workers.

  Args:
    xs, rs: (P, n) gradients and residuals, float32.
    residuals: 'global' (GRES), 'local' (each worker keeps its own gradient where it never
      selected anything) or 'none'.
  Returns:
    y (n,) the mean result, new residuals (P, n).
  """
  p, n = xs.shape
  q = p
  m, kb = layout(n, q, density)
  g = np.zeros((p, q * m), xs.dtype)
  g[:, :n] = xs + rs
  buf = g.reshape(p, q, m).copy()        # buf[w, b] = worker w's copy of global block b
  xi = np.full_like(buf, np.nan)          # in-procedure residuals, each set exactly once
  chose = np.zeros(buf.shape, bool)        # chose[w, b, o]: worker w ever selected it
  l = (q - 1).bit_length()

  def sparsify(w, b):
    off = topk_offsets(buf[w, b], kb)
    vals = buf[w, b, off].copy()
    assert np.isnan(xi[w, b]).all(), "a block was sparsified twice"
    xi[w, b] = buf[w, b]
    xi[w, b, off] = 0
    chose[w, b, off] = True
    return off, vals

  for s in range(1, l + 1):
    delta = 2 ** (l - s)
    bag = range(delta, q) if s == 1 else range(delta, 2 * delta)
    inbox = {}
    for w in range(p):
      inbox[(w + delta) % q] = [((w + j) % q, *sparsify(w, (w + j) % q)) for j in bag]
    for w in range(p):
      for b, off, vals in inbox[w]:
        assert np.isnan(xi[w, b]).all(), "received a block already sent"
        buf[w, b, off] += vals
  result = np.zeros(q * m, xs.dtype)
  in_result = np.zeros(q * m, bool)
  for w in range(p):
    off, vals = sparsify(w, w)
    result[w * m + off] = vals
    in_result[w * m + off] = True
  y = (result / np.asarray(p, xs.dtype))[:n]
  if residuals == "global":
    new_rs = np.where(in_result, xi.reshape(p, -1), g)
  elif residuals == "local":
    new_rs = np.where(chose.reshape(p, -1), 0, g)
  else:
    new_rs = np.zeros_like(g)
  return y, new_rs[:, :n]
