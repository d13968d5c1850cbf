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
