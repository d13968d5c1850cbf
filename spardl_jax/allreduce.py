"""The SparDL sparse all-reduce: SRS + Bruck all-gather + global residual collection.

``spardl_allreduce`` runs inside ``jax.shard_map`` over a named mesh axis: each device passes
its local flat gradient and its own residual state, and gets back the mean of the sparsified
sum over the axis (bit-identical on every device) and its new residual.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from spardl_jax import bruck, gres, messages, srs, topk
from spardl_jax.config import BlockLayout, SparDLConfig


class SparDLState(NamedTuple):
  """Per-device state of the SparDL all-reduce.

  Attributes:
    residual: ``(n,)`` this device's residual (discarded gradient mass carried to the next
      step), the dtype of the gradient. Spar-All-Gather will add its own fields (the
      adaptive ``h`` of B-SAG) beside it.
  """

  residual: jax.Array


def init_state(n: int, config: SparDLConfig, dtype=jnp.float32) -> SparDLState:
  """The initial per-device state for a flat gradient of length ``n``: a zero residual.

  Args:
    n: length of the flat gradient (a positive int).
    config: the all-reduce options (kept for the state fields that depend on them).
    dtype: a float dtype, the dtype of the gradients that will be reduced.
  """
  del config  # The d = 1 state does not depend on it; B-SAG's will.
  if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
    raise ValueError(f"init_state: n must be a positive int (the gradient length), got {n!r}.")
  _check_float("dtype", dtype)
  return SparDLState(residual=jnp.zeros((int(n),), dtype))


def _check_float(name: str, dtype) -> None:
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
        f"spardl: {name} must have a floating dtype (float32, bfloat16, float16, "
        f"float64), got {np.dtype(dtype).name}.")


def _axis_size(axis_name) -> int:
  """The size of ``axis_name``, with a clear error when it is not bound."""
  try:
    return jax.lax.axis_size(axis_name)
  except NameError:
    bound = _bound_axis_names()
    if not bound:
      raise ValueError(
          f"spardl_allreduce must be called inside jax.shard_map over axis_name="
          f"{axis_name!r}; no mesh axis is bound here (called outside shard_map?)."
      ) from None
    raise ValueError(
        f"spardl_allreduce: axis_name={axis_name!r} is not a bound mesh axis; the "
        f"bound axes here are {sorted(map(str, bound))}.") from None


def _bound_axis_names() -> tuple:
  from jax._src import core  # The public API has no query for bound axis names.
  try:
    return tuple(core.unsafe_get_axis_names())
  except Exception:  # pragma: no cover - private API moved; the error stays clear enough.
    return ()


def _validate(x: jax.Array, state: SparDLState, config: SparDLConfig, p: int) -> None:
  if not isinstance(config, SparDLConfig):
    raise TypeError(f"spardl_allreduce: config must be a SparDLConfig, got {type(config).__name__}.")
  _check_float("x", x.dtype)
  if x.ndim != 1:
    raise ValueError(
        f"spardl_allreduce: x must be the flat local gradient of shape (n,), got shape "
        f"{x.shape}; flatten it first (e.g. jax.flatten_util.ravel_pytree).")
  if not isinstance(state, SparDLState):
    raise TypeError(f"spardl_allreduce: state must be a SparDLState (from init_state), got "
                    f"{type(state).__name__}.")
  if state.residual.shape != x.shape:
    raise ValueError(
        f"spardl_allreduce: state.residual has shape {state.residual.shape} but x has shape "
        f"{x.shape}; create the state with init_state(n={x.shape[0]}, ...).")
  if state.residual.dtype != x.dtype:
    raise TypeError(f"spardl_allreduce: state.residual dtype {state.residual.dtype} differs from "
                    f"x dtype {x.dtype}; pass dtype=x.dtype to init_state.")
  if p % config.teams:
    divisors = [d for d in range(1, p + 1) if p % d == 0]
    raise ValueError(f"SparDLConfig: teams={config.teams} does not divide the {p} workers on "
                     f"the axis; allowed values: {divisors}.")
  if config.teams != 1:
    raise NotImplementedError(
        f"SparDLConfig: teams={config.teams} needs Spar-All-Gather (R-SAG/B-SAG), which is not "
        f"implemented yet; use teams=1.")


def spardl_allreduce(x: jax.Array, state: SparDLState, config: SparDLConfig, *,
                     axis_name) -> tuple[jax.Array, SparDLState]:
  """SparDL sparse all-reduce (mean) of the local flat gradient ``x`` over ``axis_name``.

  Call inside ``jax.shard_map``. With ``g = x + state.residual``, the ``P`` workers run
  Spar-Reduce-Scatter (block-wise top-kb before every send), select top-kb of their summed
  block, Bruck-all-gather the (offset, value) pairs and scatter them into the dense result.
  Communication: ``2 ceil(log2 P)`` rounds, ``4 kb (P - 1)`` elements per worker, one packed
  message per round. The new residual follows global residual collection, so
  ``sum(residuals) + P * y == sum(x + old residuals)`` up to float rounding (with the
  default ``config.residuals='global'``; ``'local'`` and ``'none'`` drop mass on purpose).

  Results are ``varying`` over the axis in JAX's type system although they are identical on
  every device: return them with ``out_specs=P(axis)`` or use ``check_vma=False``.

  Args:
    x: ``(n,)`` float array, this device's gradient.
    state: this device's :class:`SparDLState` (``residual`` of shape ``(n,)``, ``x``'s dtype).
    config: a :class:`SparDLConfig`.
    axis_name: the ``shard_map`` mesh axis to reduce over.

  Returns:
    ``(y, new_state)``: ``y`` ``(n,)`` the mean over the axis of the sparsified ``g``,
    bit-identical on every device; ``new_state`` with the new residual.

  References:
    Zhao et al., "SparDL: Distributed Deep Learning Training with Efficient Sparse
    Communication", ICDE 2024, Sections III-B/C and Algorithm 1.
  """
  p = _axis_size(axis_name)
  _validate(x, state, config, p)
  n = x.shape[0]
  q = p // config.teams
  layout = BlockLayout.make(n, q, config.density)
  c = topk.chunk_size(layout.m, layout.kb)
  mc = -(-layout.m // c) * c
  rank = jax.lax.axis_index(axis_name).astype(jnp.int32) % q

  g = x + state.residual
  buf = jnp.pad(g, (0, layout.padded - n)).reshape(q, layout.m)
  buf = jnp.pad(buf, ((0, 0), (0, mc - layout.m)))
  reduced = srs.spar_reduce_scatter(buf, kb=layout.kb, chunk=c, rank=rank, p=p,
                                    axis_name=axis_name)
  gathered = bruck.bruck_allgather(messages.pack(reduced.offsets, reduced.values), q=q, p=p,
                                   axis_name=axis_name)
  offsets, values = messages.unpack(gathered, layout.kb, x.dtype)
  # Row j of the gathered blocks is the block of team rank (rank + j) mod q.
  rows = (rank + jnp.arange(q, dtype=jnp.int32)) % q
  positions = srs.flat_positions(rows, offsets, mc)
  size = q * mc
  y = jnp.zeros((size,), x.dtype).at[positions].set((values / p).reshape(-1),
                                                    unique_indices=True)
  y = _unblock(y, layout, mc)
  if config.residuals == "none":
    return y, SparDLState(residual=jnp.zeros_like(x))
  in_result = (None if config.residuals == "local" else
               jnp.zeros((size,), jnp.bool_).at[positions].set(True, unique_indices=True))
  residual = gres.collect_residuals(reduced.buf.reshape(-1), in_result, reduced.receipts,
                                    reduced.selected)
  return y, SparDLState(residual=_unblock(residual, layout, mc))


def sharded_allreduce(config: SparDLConfig, mesh: jax.sharding.Mesh, axis_name: str = "data"):
  """``spardl_allreduce`` over arrays that hold one row per device, jitted.

  The per-device residual lives in a global ``(P, n)`` array sharded over ``axis_name`` (each
  device sees its ``(1, n)`` row), the layout optimizer state uses in data-parallel JAX.

  Args:
    config: the all-reduce options.
    mesh: a mesh with axis ``axis_name`` of size ``P``.
    axis_name: the mesh axis to reduce over.

  Returns:
    ``f(grads, residuals) -> (ys, residuals)`` on ``(P, n)`` arrays sharded as
    ``PartitionSpec(axis_name)``: row ``w`` of ``grads`` is device ``w``'s gradient, every row
    of ``ys`` is the same mean, and the residuals are the devices' new residuals.
  """
  rows = PartitionSpec(axis_name)

  def step(grad, residual):
    y, state = spardl_allreduce(grad[0], SparDLState(residual[0]), config, axis_name=axis_name)
    return y[None], state.residual[None]

  return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(rows, rows), out_specs=(rows, rows)))


def _unblock(flat: jax.Array, layout: BlockLayout, mc: int) -> jax.Array:
  """``(q * mc,)`` block buffer layout -> ``(n,)``; free when no padding was added."""
  blocks = flat.reshape(layout.q, mc)[:, :layout.m]
  return blocks.reshape(-1)[:layout.n]
