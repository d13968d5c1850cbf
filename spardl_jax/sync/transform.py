"""The optax transformation that synchronizes gradients with a sparse all-reduce.

``optax.chain(spardl(axis_name="data", density=0.01), optax.sgd(0.1))`` turns each device's
local gradient pytree into the synchronized mean gradient, inside a data-parallel
``jax.shard_map`` train step. The per-device residual lives in the optimizer state with a
leading device axis: ``(P, n)`` globally, sharded ``PartitionSpec(axis_name)``, ``(1, n)`` on
each device (see :mod:`spardl_jax.sync.data_parallel` for the shardings and a sharded init).
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from spardl_jax.core.allreduce import bound_axes
from spardl_jax.core.config import ETHERNET_10G, Residuals, Sag
from spardl_jax.sync import methods


class SyncStats(NamedTuple):
  """Statistics of the last synchronization, gathered without any communication.

  Each field is ``(1,)`` on a device and ``(P,)`` globally (one entry per device).

  Attributes:
    selected: int32, nonzero entries of the synchronized gradient (same on every device).
    bytes_sent: float32, bytes this device sent (the method's formula, checked against the
      compiled HLO by the tests).
    residual_norm: float32, L2 norm of this device's residual after the synchronization.
    h: int32, pairs per block sent across teams by SparDL (B-SAG's adaptive ``h``; ``kb``
      otherwise; 0 for dense).
    nonfinite: int32, syncs so far in which some device's gradient (or residual) was not
      finite (NaN or inf); the same on every device. Under ``nonfinite='skip'`` those syncs
      returned zeros and left the method's state as it was.
  """

  selected: jax.Array
  bytes_sent: jax.Array
  residual_norm: jax.Array
  h: jax.Array
  nonfinite: jax.Array


class SyncState(NamedTuple):
  """State of :func:`sync_gradients`; every leaf has a leading device axis.

  Attributes:
    method_state: the all-reduce's per-device state (for SparDL a
      :class:`~spardl_jax.SparDLState` whose ``residual`` is ``(1, n)`` on a device and
      ``(P, n)`` globally), in the promoted dtype of the gradient leaves.
    stats: :class:`SyncStats` of the last update.
  """

  method_state: Any
  stats: SyncStats


def _float_leaves(tree) -> tuple[list, Any]:
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
  if not leaves:
    raise ValueError("sync_gradients: the gradient pytree has no floating-point leaves to "
                     "synchronize.")
  return leaves, jnp.result_type(*(x.dtype for x in leaves))


def _devices(axis_name, axis_size: int | None) -> tuple[int, int]:
  """``(lead, p)``: the leading device axis of the state ``init`` creates here, and the
  number of devices on the axis."""
  try:
    return 1, jax.lax.axis_size(axis_name)  # Inside shard_map: this device's own slice.
  except NameError:  # the axis is not bound here: outside shard_map
    pass
  if axis_size is not None:
    return axis_size, axis_size
  bound = bound_axes()
  if bound:
    raise ValueError(
        f"sync_gradients: axis_name={axis_name!r}, but init runs inside jax.shard_map over "
        f"the axes {bound}; pass the data-parallel axis of that mesh as "
        f"axis_name (the same to the transformation and to init_opt_state).")
  mesh = jax.sharding.get_abstract_mesh()
  if axis_name in mesh.axis_names:
    return mesh.shape[axis_name], mesh.shape[axis_name]
  raise ValueError(
      f"sync_gradients: init was called outside shard_map, so the number of devices on axis "
      f"{axis_name!r} is unknown. Use spardl_jax.init_opt_state(tx, params, mesh), call init "
      f"inside jax.shard_map, run under jax.set_mesh(mesh), or pass axis_size=P.")


NonFinite = Literal["skip", "propagate"]
NONFINITE_POLICIES = ("skip", "propagate")


def _any_device_nonfinite(allreduce, flat, local, y, axis_name) -> jax.Array:
  """() bool, True on every device when some device's ``flat`` (+ residual) is not finite.

  Where the method guarantees that a non-finite input reaches its result (every selection
  ranks NaN and inf above any finite value and ``y`` is bit-identical everywhere), the
  result itself tells: no extra communication. Otherwise one scalar ``pmax`` (4 bytes, one
  latency round) makes the devices agree.
  """
  if allreduce.nonfinite_reaches_result:
    return ~jnp.all(jnp.isfinite(y))
  local_bad = ~jnp.all(jnp.isfinite(flat))
  residual = getattr(local, "residual", None)
  if residual is not None:
    local_bad |= ~jnp.all(jnp.isfinite(residual))
  return jax.lax.pmax(local_bad.astype(jnp.int32), axis_name) > 0


def sync_gradients(method: methods.Method = "spardl", *, axis_name: str = "data",
                   axis_size: int | None = None, nonfinite: NonFinite = "skip",
                   **options) -> optax.GradientTransformation:
  """Synchronizes gradients across ``axis_name`` with the all-reduce ``method``.

  ``update`` must run inside ``jax.shard_map`` over ``axis_name`` with the local gradient
  of each device; it returns the mean gradient over the axis, bit-identical on every device
  (typed *varying* by JAX, so the train step needs ``check_vma=False`` to return the new
  parameters replicated). All floating-point leaves are flattened into one vector in their
  promoted dtype (e.g. float32 for a bfloat16/float32 mix), reduced in one all-reduce, and
  cast back to each leaf's dtype. Non-float leaves (integers, ``float0``) pass through
  unchanged and are not communicated.

  **Non-finite gradients.** Every device learns in the same step whether any device's
  gradient (plus residual) holds a NaN or an inf, and all take the same decision, so no
  device ever skips a collective the others wait in. With ``nonfinite='skip'`` (default)
  that sync returns zeros on every device and leaves the method's state (residuals, the
  B-SAG controller, thresholds) exactly as before, so one bad step poisons nothing; the
  ``nonfinite`` counter of :class:`SyncStats` counts such steps. ``'propagate'`` returns
  what the all-reduce computed (NaNs included) and keeps its new state. The optimizer after
  the sync then sees a zero gradient: plain SGD does not move, momentum and Adam moments
  decay by one step. Do not wrap the sync in ``optax.apply_if_finite``: it decides on each
  device's own gradient before the sync runs (a hang); :func:`spardl_jax.opt_state_specs`
  rejects that structure.

  Args:
    method: one of :data:`spardl_jax.methods.METHODS`.
    axis_name: the data-parallel mesh axis.
    axis_size: number of devices on the axis, only needed when ``init`` runs outside
      ``shard_map`` without a mesh set (:func:`spardl_jax.init_opt_state` needs none).
    nonfinite: ``'skip'`` or ``'propagate'``, see above.
    **options: the method's options (for ``'spardl'``: ``density``, ``teams``, ``sag``,
      ``residuals``, ``alpha``, ``beta``).

  Returns:
    An ``optax.GradientTransformation`` whose state is a :class:`SyncState`.
  """
  if nonfinite not in NONFINITE_POLICIES:
    raise ValueError(f"sync_gradients: nonfinite must be one of {NONFINITE_POLICIES}, got "
                     f"{nonfinite!r}.")
  allreduce = methods.make(method, **options)
  if axis_size is not None and (isinstance(axis_size, bool) or not isinstance(axis_size, int)
                                or axis_size < 1):
    raise ValueError(f"sync_gradients: axis_size must be a positive int, got {axis_size!r}.")

  def init_fn(params):
    leaves, dtype = _float_leaves(params)
    n = sum(int(np.prod(x.shape)) for x in leaves)
    lead, p = _devices(axis_name, axis_size)

    def per_device(a):
      a = jnp.asarray(a)
      return jnp.broadcast_to(a[None], (lead, *a.shape))

    stats = SyncStats(selected=jnp.zeros((lead,), jnp.int32),
                      bytes_sent=jnp.zeros((lead,), jnp.float32),
                      residual_norm=jnp.zeros((lead,), jnp.float32),
                      h=jnp.zeros((lead,), jnp.int32),
                      nonfinite=jnp.zeros((lead,), jnp.int32))
    return SyncState(jax.tree.map(per_device, allreduce.init(n=n, dtype=dtype, p=p)), stats)

  def update_fn(updates, state, params=None):
    del params
    if not isinstance(state, SyncState):
      raise TypeError(f"sync_gradients: state must be the SyncState from init, got "
                      f"{type(state).__name__}.")
    for leaf in jax.tree.leaves(state):
      if leaf.shape[:1] != (1,):
        raise ValueError(
            f"sync_gradients: update must run inside jax.shard_map over {axis_name!r} with the "
            f"state sharded PartitionSpec({axis_name!r}) (each device sees a leading axis of "
            f"1), got a state leaf of shape {leaf.shape}; see spardl_jax.opt_state_specs.")
    leaves, treedef = jax.tree.flatten(updates)
    is_float = [jnp.issubdtype(x.dtype, jnp.floating) for x in leaves]
    floats, dtype = _float_leaves(updates)
    local = jax.tree.map(lambda a: a[0], state.method_state)
    flat = jnp.concatenate([x.astype(dtype).reshape(-1) for x in floats])
    n = sum(x.size for x in floats)
    residual = getattr(local, "residual", None)
    if residual is not None and residual.shape != (n,):
      raise ValueError(f"sync_gradients: the gradients have {n} float entries but the state "
                       f"was initialized for {residual.shape[0]}; init with the same params.")
    y, new_local = allreduce.apply(flat, local, axis_name=axis_name)
    bad = _any_device_nonfinite(allreduce, flat, local, y, axis_name)
    if nonfinite == "skip":
      y = jnp.where(bad, jnp.zeros_like(y), y)
      new_local = jax.tree.map(lambda new, old: jnp.where(bad, old, new), new_local, local)
    local = new_local
    p = jax.lax.axis_size(axis_name)
    residual = getattr(local, "residual", None)
    bytes_sent, h = allreduce.stats(n=n, p=p, itemsize=np.dtype(dtype).itemsize, state=local,
                                    rank=jax.lax.axis_index(axis_name))
    stats = SyncStats(
        selected=jnp.count_nonzero(y).astype(jnp.int32)[None],
        bytes_sent=jnp.full((1,), bytes_sent, jnp.float32),
        h=jnp.full((1,), h, jnp.int32),
        residual_norm=(jnp.zeros((1,), jnp.float32) if residual is None else
                       jnp.linalg.norm(residual.astype(jnp.float32))[None]),
        nonfinite=state.stats.nonfinite + bad.astype(jnp.int32))
    out, start = [], 0
    for x, f in zip(leaves, is_float):
      if f:
        out.append(y[start:start + x.size].reshape(x.shape).astype(x.dtype))
        start += x.size
      else:
        out.append(x)
    new_state = SyncState(jax.tree.map(lambda a: a[None], local), stats)
    return jax.tree.unflatten(treedef, out), new_state

  return optax.GradientTransformation(init_fn, update_fn)


def spardl(*, axis_name: str = "data", density: float = 0.01, teams: int | str = 1,
           sag: Sag = "auto", residuals: Residuals = "global",
           alpha: float = ETHERNET_10G["alpha"], beta: float = ETHERNET_10G["beta"],
           axis_size: int | None = None,
           nonfinite: NonFinite = "skip") -> optax.GradientTransformation:
  """SparDL gradient synchronization as an optax transformation.

  Example::

    tx = optax.chain(spardl(axis_name="data", density=0.01), optax.sgd(0.1, momentum=0.9))

  Args:
    axis_name: the data-parallel mesh axis.
    density: fraction of each block kept by every top-k selection, in (0, 1].
    teams: number of teams ``d`` (must divide the number of devices), or ``'auto'`` to pick
      it from the alpha-beta model.
    sag: ``'auto'``, ``'recursive'`` (R-SAG) or ``'bruck'`` (B-SAG) for ``teams > 1``.
    residuals: ``'global'`` (GRES, default), ``'local'`` or ``'none'``.
    alpha, beta: latency (s) and seconds per byte of the network, for ``teams='auto'``.
    See :class:`~spardl_jax.SparDLConfig` for details.
    axis_size: see :func:`sync_gradients`.
    nonfinite: ``'skip'`` (default) or ``'propagate'``: what a step with a NaN or inf on
      some device does (see :func:`sync_gradients`).

  Returns:
    An ``optax.GradientTransformation`` (state :class:`SyncState`).

  References:
    Zhao et al., "SparDL: Distributed Deep Learning Training with Efficient Sparse
    Communication", ICDE 2024.
  """
  return sync_gradients("spardl", axis_name=axis_name, axis_size=axis_size,
                        nonfinite=nonfinite, density=density,
                        teams=teams, sag=sag, residuals=residuals, alpha=alpha, beta=beta)


def sync_stats(opt_state) -> SyncStats:
  """The :class:`SyncStats` inside an optimizer state (e.g. of an ``optax.chain``).

  Raises:
    ValueError: if the state holds no or several :class:`SyncState`.
  """
  found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, SyncState))
           if isinstance(s, SyncState)]
  if len(found) != 1:
    raise ValueError(f"sync_stats: expected one SyncState in the optimizer state, found "
                     f"{len(found)}.")
  return found[0].stats

