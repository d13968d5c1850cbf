"""PowerSGD: rank-r low-rank gradient compression with error feedback (what users of
PyTorch DDP pick instead of sparsity).

Each gradient leaf of two or more axes is a matrix ``M`` (its axes split where rows + columns
is least, so a Flax convolution kernel ``(h, w, c_in, c_out)`` becomes ``(h w, c_in c_out)``
or ``(h w c_in, c_out)``, never ``(h, w c_in c_out)``; plus this device's error) is
approximated by one step of subspace iteration, warm-started from the last step's ``Q``::

  P = M Q;  P <- all-reduce(P);  P <- orthonormal columns of P
  Q = M^T P;  Q <- all-reduce(Q);  approximation = P Q^T / (number of devices)

Each device keeps ``M - approximation`` as its error, so ``sum(errors) + P * y == sum(M)``
exactly as SparDL's residuals. Leaves that compression would not shrink by at least
``min_compression_rate`` (1-D leaves, biases, small matrices) are all-reduced dense, in the
same all-reduce as the ``P`` factors. Two all-reduces per step in all, as PyTorch's
``powerSGD_hook``. Its ``start_powerSGD_iter`` (dense all-reduce for the first steps) is
the sync's generic ``warmup_steps`` (:func:`spardl_jax.powersgd` takes ``start_iter``).

PowerSGD needs the leaves' shapes, so the transformation binds them with
:meth:`PowerSGD.for_leaves` before ``init``; unbound (a flat vector, as in the one-sync
benchmark) every entry is one 1-D leaf and goes dense.

References:
  Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
  Distributed Optimization", NeurIPS 2019; PyTorch ``torch.distributed.algorithms.
  ddp_comm_hooks.powerSGD_hook``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from spardl_jax._src.baselines.common import PerLeaf, check_local
from spardl_jax._src.baselines.dense import formula as dense_formula
from spardl_jax._src.core import flat, protocol
from spardl_jax._src.core.config import check_number

__all__ = ['PowerSGDConfig', 'PowerSGDState', 'Leaf', 'matrix', 'plan', 'PowerSGD']


@dataclasses.dataclass(frozen=True, kw_only=True)
class PowerSGDConfig:
  """Options of PowerSGD.

  Attributes:
    rank: the rank ``r`` of each matrix's approximation (an int >= 1).
    min_compression_rate: compress a ``(m, k)`` matrix only if ``m k >= rate * r (m + k)``
      (PyTorch's default 2; below 1 compresses matrices the factors do not shrink, as tests
      at full rank do).
    seed: the seed of the initial ``Q`` (the same on every device).
  """

  rank: int = 4
  min_compression_rate: float = 2.0
  seed: int = 0

  def __post_init__(self):
    who = "PowerSGDConfig"
    check_number(who, "rank", self.rank, "an int >= 1", integral=True, accept=lambda r: r >= 1)
    check_number(who, "min_compression_rate", self.min_compression_rate, "a number > 0",
                 accept=lambda rate: rate > 0)
    # jax.random.key takes a C long: beyond it, an OverflowError at the first trace.
    check_number(who, "seed", self.seed, "an int in [-2**63, 2**63)", integral=True,
                 accept=lambda seed: -2**63 <= seed < 2**63)


@protocol.folds(residual=protocol.SUM, qs=protocol.SAME)
class PowerSGDState(NamedTuple):
  """Per-device state.

  Attributes:
    residual: ``(n,)`` this device's error (what the approximation left out), flat in leaf
      order like the gradient.
    qs: one ``(k_i, r)`` warm-start ``Q`` per compressed matrix, the same on every device.
  """

  residual: jax.Array
  qs: tuple


class Leaf(NamedTuple):
  """One leaf of the flat gradient: where it starts, its 2-D view, the rank of its factors
  and whether they are worth sending instead of the leaf."""

  start: int
  rows: int
  cols: int
  rank: int
  compressed: bool

  @property
  def size(self) -> int:
    return self.rows * self.cols


def matrix(shape) -> tuple[int, int]:
  """``(rows, cols)`` of a leaf: its leading axes against the rest, split where rows + cols
  is least (the first such split), which makes rank-r factors smallest. PyTorch's
  ``(shape[0], -1)`` fits its ``(c_out, c_in, h, w)`` kernels; on Flax's ``(h, w, c_in,
  c_out)`` it would give a 3-row matrix that no rank-r factors shrink.

    >>> matrix((3, 3, 64, 64))  # a convolution kernel
    (576, 64)
    >>> matrix((768, 12, 64))  # an attention projection, (features, heads, head size)
    (768, 768)
  """
  size = math.prod(shape)
  if len(shape) < 2 or not size:
    return size, 1
  rows = min((math.prod(shape[:k]) for k in range(1, len(shape))),
             key=lambda r: r + size // r)
  return rows, size // rows


def plan(shapes, config: PowerSGDConfig) -> list[Leaf]:
  """The leaves of a flat gradient made of ``shapes`` (in order)."""
  leaves, start = [], 0
  for shape in shapes:
    size = math.prod(shape)
    rows, cols = matrix(shape)
    rank = min(config.rank, rows, cols)
    compressed = len(shape) >= 2 and rows * cols >= config.min_compression_rate * rank * (
        rows + cols)
    leaves.append(Leaf(start, rows, cols, rank, bool(compressed)))
    start += size
  return leaves


def _psum_flat(parts: list, axis_name, dtype) -> jax.Array:
  """One all-reduce (sum) of ``parts`` flattened and concatenated."""
  return jax.lax.psum(flat.concat(parts or [jnp.zeros((0,), dtype)]), axis_name)


def _orthonormal(p: jax.Array) -> jax.Array:
  """Orthonormal columns spanning ``p`` (Householder QR, deterministic, so identical on
  every device from the identical all-reduced ``p``)."""
  q, _ = jnp.linalg.qr(p.astype(jnp.float32))
  return q.astype(p.dtype)


@protocol.register
@dataclasses.dataclass(frozen=True)
class PowerSGD(PerLeaf):
  """PowerSGD as a registered all-reduce (options: :class:`PowerSGDConfig`)."""

  name: ClassVar[str] = "powersgd"
  summary: ClassVar[str] = "PowerSGD rank-r, error feedback, warm start"
  Config: ClassVar[type] = PowerSGDConfig
  nonfinite_reaches_result: ClassVar[bool] = False  # a NaN can vanish in the projection
  sparse: ClassVar[bool] = False  # low rank, not a fraction of the entries
  config: PowerSGDConfig
  shapes: tuple | None = None

  def paper_cost(self, *, p: int, n: int, k: int) -> None:
    """Not in the paper."""
    del p, n, k

  def _leaves(self, n: int) -> list[Leaf]:
    return plan(self.leaf_shapes(n), self.config)

  def init(self, *, n: int, dtype, p: int) -> PowerSGDState:
    del p
    key = jax.random.key(self.config.seed)
    matrices = [leaf for leaf in self._leaves(n) if leaf.compressed]
    qs = tuple(jax.random.normal(jax.random.fold_in(key, i), (leaf.cols, leaf.rank), dtype)
               for i, leaf in enumerate(matrices))
    return PowerSGDState(jnp.zeros((n,), dtype), qs)

  def apply(self, x, state, *, axis_name):
    check_local("powersgd", x, state.residual)
    leaves = self._leaves(x.shape[0])
    matrices = [leaf for leaf in leaves if leaf.compressed]
    p = jax.lax.axis_size(axis_name)
    g = x + state.residual
    pieces = [g[leaf.start:leaf.start + leaf.size] for leaf in leaves]
    ms = [piece.reshape(leaf.rows, leaf.cols)
          for leaf, piece in zip(leaves, pieces) if leaf.compressed]
    dense = [piece for leaf, piece in zip(leaves, pieces) if not leaf.compressed]
    # First all-reduce: every P factor and every uncompressed leaf, in one message.
    first = _psum_flat([m @ q for m, q in zip(ms, state.qs)] + dense, axis_name, x.dtype)
    ps, at = [], 0
    for leaf in matrices:
      ps.append(_orthonormal(first[at:at + leaf.rows * leaf.rank].reshape(leaf.rows, -1)))
      at += leaf.rows * leaf.rank
    dense_sum = first[at:]
    # Second all-reduce: the Q factors.
    second = _psum_flat([m.T @ pf for m, pf in zip(ms, ps)], axis_name, x.dtype)
    means, new_qs, at_q, at_d = [], [], 0, 0
    pfactors = iter(ps)
    for leaf in leaves:
      if leaf.compressed:
        q = second[at_q:at_q + leaf.cols * leaf.rank].reshape(leaf.cols, leaf.rank)
        at_q += q.size
        means.append((next(pfactors) @ q.T / p).reshape(-1))
        new_qs.append(q)
      else:
        means.append(dense_sum[at_d:at_d + leaf.size] / p)
        at_d += leaf.size
    y = flat.concat(means, x.dtype)
    # Uncompressed leaves were reduced exactly: their error is 0 (up to rounding of the mean).
    residual = flat.concat([piece - mean if leaf.compressed else jnp.zeros_like(mean)
                            for leaf, piece, mean in zip(leaves, pieces, means)], x.dtype)
    return y, PowerSGDState(residual, tuple(new_qs))

  def formula(self, *, p: int, n: int, itemsize: int) -> protocol.Cost:
    """Two ring all-reduces: of the P factors with the dense leaves, then of the Q factors."""
    leaves = self._leaves(n)
    first = sum(leaf.rows * leaf.rank if leaf.compressed else leaf.size for leaf in leaves)
    second = sum(leaf.cols * leaf.rank for leaf in leaves if leaf.compressed)
    sizes = [s for s in (first, second) if s]
    return protocol.Cost(sum(dense_formula(p, s).rounds for s in sizes),
                         sum(dense_formula(p, s, itemsize).bytes for s in sizes))

  def stats(self, *, n: int, p: int, itemsize: int, state, rank):
    del state, rank
    return self.formula(p=p, n=n, itemsize=itemsize).bytes, 0
