"""The SparDL sparse all-reduce: SRS + Spar-All-Gather + Bruck all-gather + global residual
collection.

``spardl_allreduce`` runs inside ``jax.shard_map`` over a named mesh axis: each device passes
its local flat gradient and its own residual state, and gets back the mean of the sparsified
sum over the axis (bit-identical on every device) and its new residual.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from spardl_jax import bruck, cost, gres, h_controller, messages, sag, schedule, sparse, srs, topk
from spardl_jax.config import BlockLayout, SparDLConfig


class SparDLState(NamedTuple):
  """Per-device state of the SparDL all-reduce.

  Attributes:
    residual: ``(n,)`` this device's residual (discarded gradient mass carried to the next
      step), the dtype of the gradient.
    controller: the B-SAG ``h`` controller (:class:`~spardl_jax.h_controller.HState`, the
      same on every device); ``last_h`` is ``kb`` when B-SAG is not used.
  """

  residual: jax.Array
  controller: h_controller.HState = None


def init_state(n: int, config: SparDLConfig, dtype=jnp.float32) -> SparDLState:
  """The initial per-device state for a flat gradient of length ``n``: a zero residual.

  Args:
    n: length of the flat gradient (a positive int).
    config: the all-reduce options (kept for the state fields that depend on them).
    dtype: a float dtype, the dtype of the gradients that will be reduced.
  """
  del config  # Sizes that depend on it are only known at trace time (they need P).
  if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
    raise ValueError(f"init_state: n must be a positive int (the gradient length), got {n!r}.")
  _check_float("dtype", dtype)
  return SparDLState(residual=jnp.zeros((int(n),), dtype), controller=h_controller.empty())


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


def resolve_teams(config: SparDLConfig, p: int, n: int, itemsize: int) -> tuple[int, str]:
  """``(d, kind)``: the team count for ``p`` workers and ``'none'``, ``'recursive'`` or
  ``'bruck'``; raises a clear error when ``teams`` does not fit ``p``."""
  d = config.teams
  if d == "auto":
    d = cost.choose_teams(p, n, config.density, alpha=config.alpha, beta=config.beta,
                          itemsize=itemsize, sag=config.sag)
  if p % d:
    divisors = [t for t in range(1, p + 1) if p % t == 0]
    raise ValueError(f"SparDLConfig: teams={d} does not divide the {p} workers on "
                     f"the axis; allowed values: {divisors}.")
  return d, ("none" if d == 1 else cost.sag_kind(d, config.sag))


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
  d, kind = resolve_teams(config, p, n, np.dtype(x.dtype).itemsize)
  q = p // d
  layout = BlockLayout.make(n, q, config.density)
  kb = layout.kb
  c = topk.chunk_size(layout.m, kb)
  mc = -(-layout.m // c) * c
  size = q * mc
  index = jax.lax.axis_index(axis_name).astype(jnp.int32)
  rank, team = index % q, index // q

  def positions(rows, offsets):  # flat buffer positions; `size` for empty slots
    return jnp.where(offsets.reshape(-1) == sparse.INVALID, size,
                     srs.flat_positions(rows, offsets, mc))

  g = x + state.residual
  buf = jnp.pad(g, (0, layout.padded - n)).reshape(q, layout.m)
  buf = jnp.pad(buf, ((0, 0), (0, mc - layout.m)))
  reduced = srs.spar_reduce_scatter(buf, kb=kb, chunk=c, rank=rank, p=p, axis_name=axis_name)
  own = rank[None]
  offsets, values = topk.block_topk(reduced.buf, own, kb, c)  # (1, kb), ascending
  offsets, values = offsets[0], values[0]
  sent, shares, count = offsets, [], None
  previous = state.controller if state.controller is not None else h_controller.empty()
  controller = previous._replace(last_h=jnp.int32(kb))
  if kind == "recursive":
    offsets, values, shares = sag.recursive_sag(offsets, values, kb=kb, p=p, q=q, team=team,
                                                axis_name=axis_name)
  elif kind == "bruck":
    ladder = schedule.h_ladder(kb, d)
    controller = h_controller.start(previous, kb=kb, d=d)
    level = jnp.searchsorted(jnp.asarray(ladder, jnp.int32),
                             jnp.ceil(controller.h).astype(jnp.int32))
    level = jnp.minimum(level, len(ladder) - 1)
    h = jnp.asarray(ladder, jnp.int32)[level]
    ordered_off, ordered_val = sag.by_magnitude(offsets, values)
    sent = jnp.where(jnp.arange(kb) < h, ordered_off, sparse.INVALID)
    offsets, values, count = sag.bruck_sag(ordered_off, ordered_val, level, ladder=ladder,
                                           kb=kb, p=p, q=q, team=team, axis_name=axis_name)
    controller = controller._replace(last_h=h)
  # The count rides in the final all-gather, so every worker learns all Q counts.
  message = messages.pack(offsets[None], values[None],
                          None if count is None else count[None, None])
  gathered = bruck.bruck_allgather(
      message, size=q, axis_name=axis_name,
      permutation=lambda shift: schedule.team_permutation(p, q, shift))
  unpacked = messages.unpack(gathered, kb, x.dtype, extra=0 if count is None else 1)
  # Row j of the gathered blocks is the block of team rank (rank + j) mod q.
  rows = (rank + jnp.arange(q, dtype=jnp.int32)) % q
  result_at = positions(rows, unpacked[0])
  unique = kind == "none"  # Only SAG leaves empty slots (which all map to `size`).
  y = jnp.zeros((size,), x.dtype).at[result_at].set(
      (unpacked[1] / p).reshape(-1), mode="drop", unique_indices=unique)
  y = _unblock(y, layout, mc)
  if count is not None:
    mean_count = jnp.sum(unpacked[2]).astype(jnp.float32) / q
    controller = h_controller.update(controller, mean_count, kb=kb, d=d)
  if config.residuals == "none":
    return y, SparDLState(residual=jnp.zeros_like(x), controller=controller)
  in_result = jnp.zeros((size,), jnp.bool_).at[result_at].set(True, mode="drop",
                                                                 unique_indices=unique)
  selected = jnp.concatenate([reduced.selected, positions(own, sent[None])])
  residual = gres.collect_residuals(reduced.buf.reshape(-1),
                                    None if config.residuals == "local" else in_result,
                                    reduced.receipts, selected)
  if config.residuals == "global":
    for share in shares:  # R-SAG discards: they count only where the index is in the result
      at = positions(own, share.offsets[None])
      at = jnp.where(in_result.at[at].get(mode="fill", fill_value=False), at, size)
      residual = residual.at[at].add(share.values, mode="drop")
  return y, SparDLState(residual=_unblock(residual, layout, mc), controller=controller)


def _unblock(flat: jax.Array, layout: BlockLayout, mc: int) -> jax.Array:
  """``(q * mc,)`` block buffer layout -> ``(n,)``; free when no padding was added."""
  blocks = flat.reshape(layout.q, mc)[:, :layout.m]
  return blocks.reshape(-1)[:layout.n]
