"""What the baseline all-reduces share: a residual-only state, whole-vector top-k, a
whole-axis all-gather, the direct split exchange of (P, c) tables, and input checks.

Built on SparDL's sparse maths (:mod:`spardl_jax._src.core.sparse`); SparDL itself uses none of
this module.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from spardl_jax._src.core import bruck, messages, protocol, schedule, topk
from spardl_jax._src.core.config import check_dtype
from spardl_jax._src.core.sparse import in_worker_order

__all__ = ['topk_count', 'local_topk', 'densify', 'allgather', 'ResidualState', 'init_residual',
           'Baseline', 'PerLeaf', 'check_local', 'exchange']


def topk_count(density: float, n: int) -> int:
  """``k = min(n, max(1, ceil(density * n)))``: the entries a whole-vector top-k keeps."""
  return min(n, max(1, int(np.ceil(density * n))))


def local_topk(g: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """Exact top-``k`` of a whole ``(n,)`` vector by ``|value|`` (ties to the lower index).

  Returns:
    ``(offsets, values)``, each ``(k,)``, offsets ascending.
  """
  n = g.shape[0]
  c = topk.chunk_size(n, k)
  buf = jnp.pad(g, (0, -(-n // c) * c - n))[None]
  offsets, values = topk.block_topk(buf, jnp.zeros((1,), jnp.int32), k, c)
  return offsets[0], values[0]


def densify(n: int, offsets: jax.Array, values: jax.Array, dtype) -> jax.Array:
  """``(n,)`` dense sum of sparse rows ``(R, L)`` added in row order (slots may repeat
  across rows, not within one)."""
  out = jnp.zeros((n,), dtype)
  for row in range(offsets.shape[0]):
    out = out.at[offsets[row]].add(values[row], mode="drop")
  return out


def allgather(block: jax.Array, axis_name) -> jax.Array:
  """Every worker's ``(1, W)`` block as ``(P, W)`` in rank order: a Bruck all-gather over the
  whole axis (``ceil(log2 P)`` rounds)."""
  p = jax.lax.axis_size(axis_name)
  rows = bruck.bruck_allgather(block, size=p, axis_name=axis_name,
                               permutation=lambda shift: schedule.team_permutation(p, p, shift))
  return in_worker_order(rows, jax.lax.axis_index(axis_name))


@protocol.folds(residual=protocol.SUM)
class ResidualState(NamedTuple):
  """Per-device state of an all-reduce that keeps only a residual: ``residual`` ``(n,)``."""

  residual: jax.Array


def init_residual(n: int, p: int, config, dtype=jnp.float32) -> ResidualState:
  """The initial state of a baseline that keeps only a residual: zeros, for any ``p``."""
  del p, config
  return ResidualState(jnp.zeros((n,), dtype))


@dataclasses.dataclass(frozen=True)
class Baseline(protocol.FlatVector):
  """The :class:`~spardl_jax._src.core.protocol.AllReduce` of a baseline module: subclasses set
  ``name``, ``summary``, ``Config`` and the module's functions ``allreduce(x, state, config,
  *, axis_name)``, ``cost(p, n, config, itemsize)``, ``paper(p, n, k)`` (its row of the
  paper's Table 1) and (when the state is more than a residual) ``initial(n, p, config,
  dtype)``, as static methods."""

  config: Any
  # Their top-k selections rank NaN and inf first; Ok-Topk, whose split messages hold the
  # first c selected entries in index order, says otherwise.
  nonfinite_reaches_result: ClassVar[bool] = True
  sparse: ClassVar[bool] = True  # each keeps a fraction config.density (DensityConfig)
  # The module's functions, set by each subclass (declared here for the type checker).
  allreduce: ClassVar[Callable[..., tuple[jax.Array, Any]]]
  cost: ClassVar[Callable[..., protocol.Cost]]
  paper: ClassVar[Callable[..., protocol.PaperCost]]
  initial: ClassVar[Callable[..., Any]] = staticmethod(init_residual)

  def init(self, *, n: int, dtype, p: int):
    return self.initial(n, p, self.config, dtype)

  def apply(self, x, state, *, axis_name):
    return self.allreduce(x, state, self.config, axis_name=axis_name)

  def formula(self, *, p: int, n: int, itemsize: int) -> protocol.Cost:
    return self.cost(p, n, self.config, itemsize)

  def paper_cost(self, *, p: int, n: int, k: int) -> protocol.PaperCost:
    return self.paper(p, n, k)

  def stats(self, *, n: int, p: int, itemsize: int, state, rank):
    del state
    traffic = self.formula(p=p, n=n, itemsize=itemsize)
    if traffic.bytes_per_device is not None:  # uneven senders (gTopk's tree)
      return jnp.asarray(traffic.bytes_per_device)[rank], 0
    return traffic.bytes, 0


class PerLeaf:
  """What a method that works per gradient leaf shares (PowerSGD, SparseLoCo): binding the
  leaf shapes, and reading them back for a flat vector of ``n`` entries. The method is a
  frozen dataclass with a ``shapes: tuple | None = None`` field and a ``name``."""

  leafwise: ClassVar[bool] = True
  name: ClassVar[str]
  shapes: tuple | None

  def for_leaves(self, shapes):
    """This method for a gradient of these leaf shapes (flattened in order)."""
    return dataclasses.replace(self, shapes=tuple(tuple(int(d) for d in s) for s in shapes))

  def leaf_shapes(self, n: int) -> tuple:
    """The bound shapes (unbound: one leaf of ``n``), which must hold ``n`` entries."""
    shapes = self.shapes if self.shapes is not None else ((n,),)
    if sum(math.prod(s) for s in shapes) != n:
      raise ValueError(f"{self.name}: the leaf shapes {shapes} hold "
                       f"{sum(math.prod(s) for s in shapes)} entries, the gradient {n}.")
    return shapes


def check_local(who: str, x: jax.Array, residual: jax.Array) -> None:
  """Clear trace-time errors for a wrong local gradient or residual."""
  check_dtype("x", x.dtype, who=who)
  if x.ndim != 1:
    raise ValueError(f"{who}: x must be a flat float gradient of shape (n,), got "
                     f"{x.dtype}{list(x.shape)}.")
  if residual.shape != x.shape or residual.dtype != x.dtype:
    raise ValueError(f"{who}: the residual is {residual.dtype}{list(residual.shape)} but x is "
                     f"{x.dtype}{list(x.shape)}; initialize the state for this gradient.")


def exchange(table_off, table_val, *, p: int, rank, axis_name):
  """Direct split: row ``j`` goes to worker ``j`` (``P - 1`` rounds); returns the ``(P, c)``
  rows this worker received, in sender order (its own row included)."""
  c = table_off.shape[1]
  received = [messages.pack(table_off[rank][None], table_val[rank][None])]
  for shift in range(1, p):
    dest = (rank + shift) % p
    received.append(jax.lax.ppermute(
        messages.pack(table_off[dest][None], table_val[dest][None]), axis_name,
        perm=schedule.team_permutation(p, p, shift)))
  # received[s] came from rank - s: reverse the rotation to get sender order.
  rows = jnp.concatenate(received)[(rank - jnp.arange(p, dtype=jnp.int32)) % p]
  return messages.unpack(rows, c, table_val.dtype)
