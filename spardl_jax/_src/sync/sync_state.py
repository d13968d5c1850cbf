"""The state a gradient sync keeps, and where it lives on the mesh.

:class:`SyncState` holds one row per device (its layout is declared here, once, for
:mod:`spardl_jax._src.sync.placement`); :class:`SyncStats` is what the last sync did, read with
:func:`sync_stats` at no communication cost. ``optax.MultiSteps`` around a sync accumulates
local gradients per device, so its state's layout is declared here too.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from spardl_jax._src.core import protocol
from spardl_jax._src.core.protocol import FRESH, MEAN, PER_DEVICE, REPLICATED, SAME, SUM, Field

__all__ = ['SyncStats', 'SyncState', 'Pending', 'BuiltFor', 'states_in',
           'check_sync_alone', 'sync_stats']


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
    density: float32, the density of the level the last sync used (1 for the dense
      warm-up and for dense methods).
  """

  selected: jax.Array
  bytes_sent: jax.Array
  residual_norm: jax.Array
  h: jax.Array
  nonfinite: jax.Array
  density: jax.Array

  @classmethod
  def zeros(cls, lead: int) -> "SyncStats":
    """The statistics before the first sync, with ``lead`` rows."""
    ints, floats = jnp.zeros((lead,), jnp.int32), jnp.zeros((lead,), jnp.float32)
    return cls(selected=ints, bytes_sent=floats, residual_norm=floats, h=ints,
               nonfinite=ints, density=floats)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class BuiltFor:
  """What a :class:`SyncState` was built for: the ``shapes`` of its float leaves, in
  flattening order, and the mesh ``axes`` the sync reduces over. Part of the state's pytree
  structure (no array): gradients of another structure with the same total size, whose
  entries would silently meet other leaves' residuals, are refused at trace time, and
  :func:`sync_stats` finds the syncs over an axis by it. Nothing is stored in a checkpoint
  for it."""

  shapes: tuple[tuple[int, ...], ...]
  axes: tuple[str, ...] = ()


@protocol.layout(message=Field(fold=MEAN), held=Field(fold=SAME))
class Pending(NamedTuple):
  """What a delayed sync (``delay=1``) holds from one step to the next.

  Attributes:
    message: ``(1, N)`` on a device: this device's gradient of the last step, flattened as
      the sync flattens it (the method's entries, then the dense leaves' entries), which the
      next step's sync sends. A restore onto another device count gives every new device the
      devices' mean: the next sync then delivers the mean gradient the old devices would
      have (summing it, as a residual is, would scale that one step by ``P / P'``).
    held: ``(1,)`` bool, False before the first step (nothing to send yet).
  """

  message: jax.Array
  held: jax.Array


@protocol.layout(method_state=Field(PER_DEVICE), velocity=Field(PER_DEVICE, SUM),
                 count=Field(PER_DEVICE, SAME), stats=Field(PER_DEVICE),
                 pending=Field(PER_DEVICE), placed=Field(PER_DEVICE, FRESH))
class SyncState(NamedTuple):
  """State of :func:`spardl_jax.sync_gradients`; every leaf has a leading device axis.

  Attributes:
    method_state: the all-reduce's per-device state (for SparDL a
      :class:`~spardl_jax.collectives.SparDLState` whose ``residual`` is ``(1, n)`` on a device and
      ``(P, n)`` globally), in the promoted dtype of the gradient leaves.
    velocity: ``(1, n)`` on a device, this device's momentum-corrected velocity ``u`` (only
      with ``momentum``; None otherwise). Like the residual it is a per-device sum of
      gradient mass, and a restore onto another device count folds it the same way.
    count: ``(1,)`` int32, the syncs so far (the same on every device); it picks the level.
    stats: :class:`SyncStats` of the last update.
    built_for: the :class:`BuiltFor` the state was built for (no array).
    pending: the :class:`Pending` message of a delayed sync (``delay=1``); None otherwise.
    placed: ``(1,)`` int32, the devices of the mesh the rows were laid out for. A restore that
      cut, padded or copied the rows for another device count (Orbax's ``strict=False``, a
      hand-made one) keeps the old count, and the first update refuses the state by it;
      ``sj.checkpoint.refold`` writes the new one.
  """

  method_state: Any
  velocity: jax.Array | None
  count: jax.Array  # type: ignore[assignment]  # a field named count shadows tuple.count
  stats: SyncStats
  built_for: BuiltFor
  pending: Pending | None = None
  placed: jax.Array | None = None

  def idle(self) -> SyncState:
    """This state after a step that ran no sync (an outer loop's inner step): everything it
    holds as it was, and its statistics saying nothing was sent."""
    stats = self.stats
    return self._replace(stats=stats._replace(bytes_sent=jnp.zeros_like(stats.bytes_sent)))


def states_in(tree, cls: type) -> list:
  """The nodes of type ``cls`` (a state NamedTuple) inside ``tree``, in tree order."""
  return [node for node in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, cls))
          if isinstance(node, cls)]


def check_sync_alone(state, who: str, what: str) -> None:
  """Raises unless ``state`` is a :class:`SyncState` itself: a transformation that wraps a
  sync (an outer loop, the synced Adam) takes the sync alone, not a chain around it;
  ``what`` says what the sync does there."""
  found = states_in(state, SyncState)
  if len(found) != 1 or found[0] is not state:
    raise ValueError(f"{who}: sync must be a gradient sync (spardl_jax.spardl, "
                     f"spardl_jax.sync_gradients), not a chain; it {what}.")


def sync_stats(opt_state, *, by_part: bool = False, axis: str | None = None):
  """The :class:`SyncStats` inside an optimizer state (e.g. of an ``optax.chain``), each
  field a plain array (a Flax NNX optimizer's state holds each leaf in a variable: its
  value is returned).

  A state with several syncs (``optax.multi_transform`` with a sparse sync on the matrices
  and a dense one on the biases, an outer loop over islands with a sync inside each island,
  a fragmented outer loop's syncs) is read with ``by_part=True``: a dict from each sync's
  path in the state (``inner_states['matrices'].inner_state[0]``, the label inside) to its
  statistics; a step's bytes are the sum of the parts' ``bytes_sent``. ``axis`` keeps only
  the syncs that reduce over that mesh axis: the bytes over one link (an island axis'
  ``sum(s.bytes_sent for s in sync_stats(state, by_part=True, axis="island").values())``).

  Raises:
    ValueError: if the state holds no :class:`SyncState` (over ``axis``), or several
      without ``by_part``.
  """
  flat = jax.tree_util.tree_flatten_with_path(
      opt_state, is_leaf=lambda x: isinstance(x, SyncState))[0]
  found = [(jax.tree_util.keystr(path), node) for path, node in flat
           if isinstance(node, SyncState) and (axis is None or axis in node.built_for.axes)]
  over = "" if axis is None else f" over {axis!r}"

  def plain(state):
    return SyncStats(*(jax.tree.leaves(field)[0] for field in state.stats))

  if by_part:
    if not found:
      raise ValueError(f"sync_stats: the optimizer state holds no SyncState{over} (no "
                       f"gradient sync in this optimizer?).")
    return {path: plain(state) for path, state in found}
  if len(found) != 1:
    where = "" if not found else (f" (at {', '.join(path for path, _ in found)}); read each "
                                  f"with sync_stats(opt_state, by_part=True)")
    raise ValueError(f"sync_stats: expected one SyncState{over} in the optimizer state, "
                     f"found {len(found)}{where}.")
  return plain(found[0][1])


def _multisteps_fields(state: optax.MultiStepsState, rows: PartitionSpec | None):
  """Around a sync, ``optax.MultiSteps`` accumulates each device's own gradient (not synced
  yet): per device, concatenated along the gradients' first axis on a one-axis mesh. Without
  a sync inside, its state is laid out as what it holds says (no declaration)."""
  if not states_in(state.inner_opt_state, SyncState):
    return None
  if rows is not None and (rows != PartitionSpec(rows[0]) or isinstance(rows[0], tuple)):
    raise ValueError(
        "opt_state_specs: optax.MultiSteps around a gradient sync is supported on a "
        "one-axis mesh only; on a mesh of several axes accumulate the gradients before "
        "the sync in the train step instead.")
  if jax.tree.leaves(state.skip_state):
    raise ValueError(
        "opt_state_specs: optax.MultiSteps around a gradient sync has a "
        "should_skip_update_fn (such as optax.skip_not_finite). It decides on each "
        "device's own gradient whether to run the micro-step, so a device with a NaN "
        "would skip the collectives the others wait in (a hang). Drop it: the sync's "
        "nonfinite='skip' (the default) skips a bad step on every device alike.")
  if any(not leaf.shape for leaf in jax.tree.leaves(state.acc_grads)):
    raise ValueError(
        "opt_state_specs: optax.MultiSteps around a gradient sync accumulates local "
        "gradients per device, along their first axis; a 0-d parameter has none. "
        "Reshape scalar parameters to shape (1,).")
  return {"mini_step": Field(REPLICATED), "gradient_step": Field(REPLICATED),
          "acc_grads": Field(PER_DEVICE, MEAN), "skip_state": Field(REPLICATED)}


protocol.declare_layout(optax.MultiStepsState, _multisteps_fields)
