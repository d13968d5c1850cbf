"""Syncing rarely: a DiLoCo-style outer loop whose pseudo-gradient goes through a sync.

Every replica runs ``every`` inner optimizer steps on its own gradients with no
communication across replicas; then the replicas' parameter changes (the pseudo-gradient) are
averaged by a gradient sync (:func:`spardl_jax.sync_gradients`: SparDL, dense, or any
registered method, its residual carrying what it did not send to the next round) and an
outer optimizer applies the average (DiLoCo: Nesterov SGD, lr 0.7, momentum 0.9).

A replica is one device of the sync's axis, or an **island**: a group of devices with fast
links inside (a host, a cluster) whose inner optimizer holds a sync of its own over the
island's data axis, so that the island's devices take one inner step on the island's mean
gradient and stay bit-identical; only the outer sync crosses the islands' axis, each device
of an island sending its slice of the island's pseudo-gradient (``docs/outer-loop.md``,
"Islands").

Streaming DiLoCo's two ideas are options: the parameters synced in ``fragments`` at
staggered steps (each outer sync moves about ``1/fragments`` of them), and the outer update
applied ``overlap`` steps after its sync starts (the sync's collectives then depend on the
state only, so a runtime may run them under the next step's compute).

The parameters the train step holds are the **global** ones (the anchor of the round,
identical on every device, what a checkpoint saves and what evaluation sees); each replica's
drift from them lives in the state and :func:`replica_params` adds it for the gradient. The
returned update is zero on inner steps and the outer step where a sync lands, so the
parameters after an outer step are bit-identical on every device by construction.

References:
  Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
  arXiv 2311.08105. Douillard et al., "Streaming DiLoCo with overlapping communication",
  arXiv 2501.18512 (fragments, overlap). Sarfi et al., "SparseLoCo", arXiv 2508.15706
  (top-k of the pseudo-gradient with low-bit values and error feedback).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from spardl_jax._src.core import protocol
from spardl_jax._src.core.config import check_number
from spardl_jax._src.core.protocol import LIKE_PARAMS, MEAN, PER_REPLICA, REPLICATED, SAME, Field
from spardl_jax._src.sync import delay
from spardl_jax._src.sync.moves import moves_the_point
from spardl_jax._src.sync.packing import columns, replicas_over
from spardl_jax._src.sync.placement import ParamLayout, state_specs
from spardl_jax._src.sync.specs import context_specs, leaf_specs, use_param_specs
from spardl_jax._src.sync.sync_state import SyncState, states_in
from spardl_jax._src.sync.transform import built_with, sync_gradients

__all__ = ['DiLoCoState', 'diloco', 'sparseloco', 'find_outer', 'replica_params']


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Period:
  """What a :class:`DiLoCoState` was built for: ``every`` inner steps a round, the
  parameters in ``fragments`` synced at staggered steps, each outer update applied
  ``overlap`` steps after its sync starts. Part of the state's pytree structure (no array),
  so a step of another period refuses it; nothing is stored in a checkpoint for it."""

  every: int
  fragments: int = 1
  overlap: int = 0

  def __str__(self) -> str:
    return ", ".join([f"every={self.every}",
                      *([f"fragments={self.fragments}"] if self.fragments != 1 else []),
                      *([f"overlap={self.overlap}"] if self.overlap else [])])


@protocol.layout(count=Field(REPLICATED), offset=Field(PER_REPLICA, MEAN),
                 inner=Field(PER_REPLICA, MEAN), held=Field(PER_REPLICA, MEAN),
                 arrived=Field(LIKE_PARAMS, SAME))
class DiLoCoState(NamedTuple):
  """State of :func:`diloco`.

  Attributes:
    count: () int32, inner steps taken (the same on every device).
    offset: this replica's parameters minus the global ones, shaped like the parameters
      with a leading replica axis (``(1, ...)`` on a device, ``(M, ...)`` globally for ``M``
      replicas); zero right after an outer step (without ``overlap``). A restore onto
      another replica count gives every replica the mean, so the mean pseudo-gradient the
      next outer step syncs is unchanged.
    inner: the inner optimizer's state, per replica (a leading replica axis on every leaf;
      an island's own sync keeps its rows per device, as every sync does).
    sync: the outer sync's :class:`~spardl_jax.states.SyncState` (its residual is the error
      feedback of the pseudo-gradient); with ``fragments`` F > 1 a tuple of F, one a
      fragment.
    outer: the outer optimizer's state (the same on every device); a tuple of F with
      fragments.
    period: the :class:`Period` the state was built for (no array).
    held: with ``overlap``: the offset a fragment's sync started from (the pseudo-gradient
      in flight, negated), per replica, zero elsewhere; None without.
    arrived: with ``overlap``: the synced mean waiting to be applied, like the parameters
      (the same on every device); None without.
  """

  count: jax.Array  # type: ignore[assignment]  # a field named count shadows tuple.count
  offset: Any
  inner: Any
  sync: Any
  outer: Any
  period: Period
  held: Any = None
  arrived: Any = None


def _check(every, fragments, overlap, inner, sync, outer) -> None:
  # The step count is an int32 on the device.
  check_number("diloco", "every (inner steps per outer step)", every,
               "an int in [1, 2**31 - 1]", integral=True, accept=lambda e: 1 <= e < 2**31)
  check_number("diloco", "fragments", fragments, f"an int in [1, every] (every={every})",
               integral=True, accept=lambda f: 1 <= f <= every)
  check_number("diloco", "overlap", overlap,
               f"an int in [0, every // fragments) (= [0, {every // fragments}): a fragment's "
               f"update lands before the next fragment's sync starts)", integral=True,
               accept=lambda t: 0 <= t < every // fragments)
  for name, tx in (("inner", inner), ("sync", sync), ("outer", outer)):
    if not isinstance(tx, optax.GradientTransformation):
      raise TypeError(f"diloco: {name} must be an optax.GradientTransformation, got "
                      f"{type(tx).__name__}.")
  if built_with(sync) is None:
    raise ValueError("diloco: sync must be a gradient sync (spardl_jax.spardl, "
                     "spardl_jax.sync_gradients), not a chain; it averages the "
                     "pseudo-gradient over the replicas' axis.")


def _is_sync(x) -> bool:
  return isinstance(x, SyncState)


def _replica_rows(tree, lead: int):
  """Every leaf of ``tree`` with a leading replica axis of ``lead`` rows, but a nested
  sync's state, whose rows are per device already."""
  def rows(node):
    if _is_sync(node):
      return node
    a = jnp.asarray(node)
    return jnp.broadcast_to(a[None], (lead, *a.shape))
  return jax.tree.map(rows, tree, is_leaf=_is_sync)


def _replica_local(tree):
  """:func:`_replica_rows`' inverse on a device: the replica axis dropped, a nested sync's
  state as it is."""
  return jax.tree.map(lambda n: n if _is_sync(n) else n[0], tree, is_leaf=_is_sync)


def _fragment_leaves(params, fragments: int) -> tuple:
  """The leaf indices of each fragment: contiguous leaves in flattening order, each fragment
  about ``1 / fragments`` of the entries (``(None,)``, the whole tree, for one); a clear error
  where some fragment would be empty."""
  if fragments == 1:
    return (None,)
  sizes = [max(1, int(jnp.size(x))) for x in jax.tree.leaves(params)]
  total, before, owners = sum(sizes), 0, []
  for size in sizes:
    owners.append(min(fragments - 1, (2 * before + size) * fragments // (2 * total)))
    before += size
  parts = tuple(tuple(i for i, o in enumerate(owners) if o == f) for f in range(fragments))
  if not all(parts):
    raise ValueError(f"diloco: fragments={fragments}, but the parameters' {len(sizes)} leaves "
                     f"of {sizes} entries cannot make {fragments} fragments of about "
                     f"{total // fragments} entries each; use fewer fragments.")
  return parts


def _take(tree, leaves):
  """The leaves of ``tree`` at the indices ``leaves``, as a list (one fragment); the tree
  itself for ``None`` (one fragment of every leaf)."""
  if leaves is None:
    return tree
  flat = jax.tree.leaves(tree)
  return [flat[i] for i in leaves]


def _put(tree, leaves, values):
  """``tree`` with its leaves at ``leaves`` replaced by ``values`` (the whole tree for
  ``None``)."""
  if leaves is None:
    return values
  flat, treedef = jax.tree.flatten(tree)
  for i, v in zip(leaves, values):
    flat[i] = v
  return jax.tree.unflatten(treedef, flat)


def _one_hot(index, count: int):
  return jnp.arange(count) == index


def diloco(inner: optax.GradientTransformation, sync: optax.GradientTransformation, *,
           every: int, outer: optax.GradientTransformation | None = None,
           fragments: int = 1, overlap: int = 0) -> optax.GradientTransformationExtraArgs:
  """An outer loop: ``every`` local steps of ``inner`` per replica, then the mean change
  through ``sync`` and one step of ``outer``.

  ``update(grads, state, params)`` runs inside the data-parallel ``jax.shard_map`` with
  ``params`` the global parameters and ``grads`` this device's gradient **at**
  ``replica_params(state, params)``. On inner steps it returns zeros (the global parameters
  stay) and moves this replica's offset by ``inner``'s update; a replica whose gradient is
  not finite skips its own inner step (an island decides from its own sync, which every
  device of the island agrees on; a lone device from its gradient, with no collective
  around). On every ``every``-th step the pseudo-gradient ``-offset`` (the global parameters
  minus the replica's, DiLoCo's sign) is averaged by ``sync``, ``outer`` turns the mean into
  the update every device returns, and the offsets restart at zero. Only that step
  communicates across replicas (a ``lax.switch`` on the step count, which every device agrees
  on). If the sync skips a non-finite pseudo-gradient (its ``nonfinite='skip'``), that round
  is dropped on every replica: the mean is zero and the offsets restart; the residual is
  kept.

  **Islands.** Where ``inner`` holds a sync of its own over another axis than ``sync``'s
  (``optax.chain(sj.sync_gradients("dense", axis_name="data"), optax.adamw(lr))`` with
  ``sync`` over ``"island"``, on a mesh ``("island", "data")``), each replica is an island:
  its devices average their gradients every inner step through that sync, hold one replica
  bit for bit, and the outer sync runs over the island axis, each device sending its slice
  of the pseudo-gradient. Lay the state out over the island axis (``axis_name="island"`` to
  :func:`~spardl_jax.init_opt_state` and :func:`~spardl_jax.opt_state_specs`, or
  :func:`~spardl_jax.data_parallel_step` with ``axis_name="island", local_axis="data"``).

  **Fragments** (Streaming DiLoCo): with ``fragments=F`` the parameters' leaves are cut into
  ``F`` contiguous fragments of about ``1/F`` of the entries; fragment ``f`` is synced at the
  steps ``s`` (from 1) with ``s % every == (f + 1) * every // F % every``, each with a sync
  state and an outer state of its own, so one outer sync moves a fragment and the peak bytes
  fall ``F``-fold (the bytes of a round are the same).

  **Overlap** (Streaming DiLoCo): with ``overlap=τ ≥ 1`` a fragment's offset is held at its
  turn, its sync runs at the next step on the held offset alone (nothing that step computes
  feeds its collectives, so a runtime may run them under the step's forward and backward
  pass; on XLA:CPU, whose devices may start independent collectives in another order, the
  held message waits for the step's gradient, as a delayed sync's does), and the mean is
  applied ``τ`` steps after the turn: the replica keeps the inner steps it took meanwhile
  (its offset loses the held part only), so no inner step is lost.

  With ``every=1``, ``inner=optax.sgd(lr)``, ``outer=optax.sgd(1.0)`` and a sync at density
  1 this is per-step sync training with ``optax.sgd(lr)``, to float32 rounding.

  Example (DiLoCo with a SparDL outer sync at 3 %, 4-bit values; ``docs/outer-loop.md``):

    >>> import jax, jax.numpy as jnp, optax, spardl_jax as sj
    >>> mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
    >>> tx = sj.diloco(optax.sgd(0.05, momentum=0.9), sj.spardl(density=0.03, wire="int4"),
    ...                every=30, outer=optax.sgd(0.7, momentum=0.5, nesterov=True))
    >>> state = sj.init_opt_state(tx, {"w": jnp.zeros((100, 10))}, mesh)
    >>> state.offset["w"].shape, state.sync.method_state.residual.shape
    ((8, 100, 10), (8, 1000))

  Two islands of four devices, a dense sync inside each, SparDL across:

    >>> mesh = jax.make_mesh((2, 4), ("island", "data"), devices=jax.devices()[:8])
    >>> tx = sj.diloco(optax.chain(sj.sync_gradients("dense", axis_name="data"),
    ...                            optax.adamw(1e-3)),
    ...                sj.spardl(axis_name="island", density=0.03), every=30)
    >>> state = sj.init_opt_state(tx, {"w": jnp.zeros((100, 10))}, mesh, axis_name="island")
    >>> state.offset["w"].shape, state.sync.method_state.residual.shape  # slices of 1000 / 4
    ((2, 100, 10), (8, 250))

  Args:
    inner: the optimizer of the inner steps: any optax transformation; with a sync of its
      own over another axis than ``sync``'s for islands (above).
    sync: the pseudo-gradient's sync (:func:`spardl_jax.spardl`,
      :func:`spardl_jax.sync_gradients`), over the replicas' axis.
    every: inner steps per outer step (DiLoCo's ``H``), a positive int.
    outer: the outer optimizer; default DiLoCo's ``optax.sgd(0.7, momentum=0.9,
      nesterov=True)``.
    fragments: ``F``, an int in ``[1, every]``: the parameters synced in ``F`` fragments at
      staggered steps (above).
    overlap: ``τ``, an int in ``[0, every // fragments)``: the steps between a fragment's
      turn and its outer update (above).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`DiLoCoState`;
    its ``update``'s extra argument ``param_specs`` goes to ``sync`` and to an island's own
    sync, ``batch_axes`` (what :func:`~spardl_jax.data_parallel_step` passes) is checked
    against the replicas' axes.
  """
  outer = optax.sgd(0.7, momentum=0.9, nesterov=True) if outer is None else outer
  _check(every, fragments, overlap, inner, sync, outer)
  options = built_with(sync)
  assert options is not None  # _check
  loop = _OuterLoop(optax.with_extra_args_support(inner), optax.with_extra_args_support(sync),
                    outer, options, Period(every, fragments, overlap))
  return optax.GradientTransformationExtraArgs(loop.init, loop.update)


class _OuterLoop(NamedTuple):
  """One :func:`diloco` as built: its transformations (the inner optimizer and the sync
  taking extra arguments), the sync's validated options and the :class:`Period`."""

  inner: Any
  sync: Any
  outer: Any
  options: Any
  period: Period

  @property
  def axis(self) -> str:
    """The replicas' axis: the outer sync's."""
    return self.options.axis_name

  def inner_syncs(self, inner_state) -> list:
    """The islands' own syncs inside ``inner_state`` (none for replicas of one device); a
    clear error for one over the replicas' axis."""
    found = states_in(inner_state, SyncState)
    if any(self.axis in s.built_for.axes for s in found):
      raise ValueError(f"diloco: inner holds a gradient sync over {self.axis!r}, the axis the "
                       f"outer sync averages the replicas over; the inner steps run on each "
                       f"replica alone. Pass that sync as sync=, the optimizer alone as "
                       f"inner=, or give inner a sync over an island's own data axis.")
    return found

  def init(self, params):
    fragments, overlap = self.period.fragments, self.period.overlap
    parts = _fragment_leaves(params, fragments)
    with replicas_over(self.axis):  # an island's sync leaves the replicas' axis alone
      inner_state = self.inner.init(params)
    islands = self.inner_syncs(inner_state)
    specs = _outer_specs(context_specs(), params, self.options, islands)
    sync_states = []
    for leaves in parts:
      with use_param_specs(None if specs is None else _take(specs, leaves)), \
          _whole(self.options, islands):
        sync_states.append(self.sync.init(_take(params, leaves)))
    if not all(_is_sync(s) for s in sync_states):
      raise ValueError("diloco: sync must be a gradient sync (spardl_jax.spardl, "
                       "spardl_jax.sync_gradients), not a chain; it averages the "
                       "pseudo-gradient over the replicas' axis.")
    outer_states = [self.outer.init(_take(params, leaves)) for leaves in parts]
    lead = sync_states[0].count.shape[0]  # 1 inside shard_map, P outside
    offset = jax.tree.map(lambda p: jnp.zeros((lead, *jnp.shape(p)), jnp.result_type(p)),
                          params)
    one = fragments == 1
    state = DiLoCoState(
        jnp.zeros((), jnp.int32), offset, _replica_rows(inner_state, lead),
        sync_states[0] if one else tuple(sync_states),
        outer_states[0] if one else tuple(outer_states), self.period,
        *((jax.tree.map(jnp.zeros_like, offset), jax.tree.map(jnp.zeros_like, params))
          if overlap else ()))
    return state if lead == 1 else _placed_like_the_sync(state, params)

  def update(self, grads, state, params=None, *, batch_axes=None, **extra_args):
    if not isinstance(state, DiLoCoState):
      raise TypeError(f"diloco: state must be the DiLoCoState from init, got "
                      f"{type(state).__name__}.")
    if state.period != self.period:
      raise ValueError(f"diloco: the state was built for {state.period}, this step has "
                       f"{self.period}; init with the same diloco.")
    if params is None:
      raise ValueError("diloco: update needs params (the global parameters): "
                       "tx.update(grads, state, params).")
    islands = self.inner_syncs(state.inner)
    _check_batch_axes(batch_axes, self.options.data_axes, islands)
    offset, new_inner = self.inner_step(grads, state, params, islands, extra_args)
    extra_args["param_specs"] = _outer_specs(extra_args.get("param_specs"), params,
                                             self.options, islands)
    rounds = _Rounds(self.sync, self.outer, _fragment_leaves(params, self.period.fragments),
                     params, extra_args, grads, lambda: _whole(self.options, islands))
    update, offset, syncs, outers, held, arrived = rounds.step(state, offset)
    one = self.period.fragments == 1
    return update, DiLoCoState(
        state.count + 1, _replica_rows(offset, 1), _replica_rows(new_inner, 1),
        syncs[0] if one else syncs, outers[0] if one else outers, state.period, held, arrived)

  def inner_step(self, grads, state, params, islands: list, extra_args):
    """This replica's inner step: ``(offset, inner state)`` after it, both as they were
    where the replica skips it (an island's syncs agreed on it, every device of the island
    alike; a replica of one device decides alone, with no collective around)."""
    offset, inner_state = _replica_local(state.offset), _replica_local(state.inner)
    with replicas_over(self.axis):
      step, new_inner = self.inner.update(grads, inner_state, optax.apply_updates(
          params, offset), **extra_args)
    if islands:
      finite = ~jnp.any(jnp.asarray([jnp.any(new.stats.nonfinite != old.stats.nonfinite)
                                     for new, old in zip(states_in(new_inner, SyncState),
                                                         islands)]))
    else:
      finite = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)
                                    if jnp.issubdtype(g.dtype, jnp.inexact)]))
    # A skipped inner step keeps the inner state, but what its syncs counted.
    new_inner = jax.tree.map(lambda new, old: new if _is_sync(new)
                             else jnp.where(finite, new, old), new_inner, inner_state,
                             is_leaf=_is_sync)
    offset = jax.tree.map(lambda o, s: jnp.where(finite, o + s, o).astype(o.dtype), offset,
                          step)
    return offset, new_inner


def _outer_specs(given, params, options, islands: list):
  """The parameters' specs for the outer sync: ``given`` (a door's), or over islands where
  none came and every other mesh axis the outer sync sees is an island's own data axis, the
  parameters replicated over all of them (the islands' syncs hold them so); None where the
  sync must be told (a model axis besides)."""
  if given is not None or not islands or options.param_specs is not None:
    return given
  inside = {a for s in islands for a in s.built_for.axes}
  if not set(columns(options.data_axes)) <= inside:
    return None
  return jax.tree.map(lambda _: PartitionSpec(), params)


def _whole(options, islands: list):
  """Where the outer sync compresses each parameter as a matrix (SparseLoCo's aggregation,
  PowerSGD), it cannot take an island's pseudo-gradient in slices: every device of the island
  syncs the whole of it (the same on each), its bytes over the slow link as many times as the
  island has devices. A context in which the islands' own axes are left alone; no context
  otherwise."""
  leafwise = any(level.allreduce.leafwise for level in options.levels)
  if not (leafwise and islands):
    return contextlib.nullcontext()
  return replicas_over(*(a for s in islands for a in s.built_for.axes))


def _index(hits, count: int):
  """The index of the one fragment ``hits`` marks, or ``count`` where it marks none."""
  return jnp.where(jnp.any(hits), jnp.argmax(hits), count)


def _check_batch_axes(batch_axes, outer_axes: tuple[str, ...], islands: list) -> None:
  """The axes a step split its batch over (``data_parallel_step`` says): the outer sync's,
  then an island's own (the axes its syncs reduce over)."""
  if batch_axes is None:
    return
  axes = tuple(dict.fromkeys((*outer_axes, *(a for s in islands for a in s.built_for.axes))))
  if tuple(batch_axes) != axes:
    raise ValueError(
        f"diloco: the step splits the batch over {tuple(batch_axes)}, but the outer sync "
        f"reduces over {outer_axes}" + (f" and each island's own sync over "
                                          f"{axes[len(outer_axes):]}" if islands else "")
        + f"; give the step axis_name={axes[0]!r}"
        + (f", local_axis={axes[1]!r}" if len(axes) > 1 else " and no local_axis") + ".")


class _Rounds(NamedTuple):
  """The outer rounds of one :func:`diloco` step: each method acts on the fragment of
  index ``i`` (from a ``lax.switch``, which every device agrees on; ``len(parts)`` for
  none), the rest as they were."""

  sync: Any
  outer: Any
  parts: tuple
  params: Any
  extra_args: dict
  grads: Any
  whole: Any  # () -> the context the outer sync runs in (_whole)

  def step(self, state: DiLoCoState, offset):
    """The outer part of a step after the inner one moved ``offset``: ``(update, offset,
    syncs, outers, held, arrived)``, the syncs and outer states as tuples (one a
    fragment)."""
    period = state.period
    every, fragments, overlap = period.every, period.fragments, period.overlap
    syncs = (state.sync,) if fragments == 1 else state.sync
    outers = (state.outer,) if fragments == 1 else state.outer
    turns = jnp.asarray([(f + 1) * every // fragments % every for f in range(fragments)])
    phase = (state.count + 1 - turns) % every  # each fragment's steps since its turn
    update = jax.tree.map(jnp.zeros_like, self.params)
    if not overlap:
      update, offset, syncs, outers = self.now(_index(phase == 0, fragments), update, offset,
                                               syncs, outers)
      return update, offset, syncs, outers, None, None
    held = self.hold(_index(phase == 0, fragments), _replica_local(state.held), offset)
    arrived, syncs = self.send(_index(phase == 1, fragments), held, state.arrived, syncs)
    update, offset, held, outers = self.land(_index(phase == overlap, fragments), update,
                                             offset, held, arrived, outers)
    return update, offset, syncs, outers, _replica_rows(held, 1), arrived

  def _switch(self, i, branch, *args):
    return jax.lax.switch(i, [lambda *a, f=f: branch(f, *a) for f in range(len(self.parts))]
                          + [lambda *a: a], *args)

  def _sent(self, f, pseudo, syncs):
    """Fragment ``f``'s mean pseudo-gradient, and the syncs with its state moved (the
    others as after a step that sent nothing)."""
    extra = dict(self.extra_args)
    if extra.get("param_specs") is not None:
      extra["param_specs"] = _take(extra["param_specs"], self.parts[f])
    with self.whole():
      mean, new = self.sync.update(pseudo, syncs[f], _take(self.params, self.parts[f]),
                                   **extra)
    return mean, tuple(new if g == f else s.idle() for g, s in enumerate(syncs))

  def now(self, i, update, offset, syncs, outers):
    """Without overlap: fragment ``i`` syncs its pseudo-gradient, its outer step lands and
    its offset restarts."""
    def round_(f, update, offset, syncs, outers):
      leaves = self.parts[f]
      mean, syncs = self._sent(f, jax.tree.map(jnp.negative, _take(offset, leaves)), syncs)
      step, new = self.outer.update(mean, outers[f], _take(self.params, leaves))
      outers = tuple(new if g == f else o for g, o in enumerate(outers))
      return (_put(update, leaves, step),
              _put(offset, leaves, jax.tree.map(jnp.zeros_like, _take(offset, leaves))),
              syncs, outers)
    idle = tuple(s.idle() for s in syncs)
    return self._switch(i, round_, update, offset, idle, outers)

  def hold(self, i, held, offset):
    """Fragment ``i``'s turn: its offset held for the next step's sync."""
    return self._switch(i, lambda f, held: (_put(held, self.parts[f],
                                                 _take(offset, self.parts[f])),), held)[0]

  def send(self, i, held, arrived, syncs):
    """The step after fragment ``i``'s turn: its held offset synced (on the state alone:
    where the runtime may start collectives in any order, after this step's gradient), the
    mean kept until it lands."""
    def sent(f, arrived, syncs):
      pseudo = jax.tree.map(jnp.negative, _take(held, self.parts[f]))
      if delay.waits_for_gradient():
        grads = jax.tree.leaves(self.grads)
        pseudo = jax.tree.map(lambda p: delay.after(p, grads), pseudo)
      mean, syncs = self._sent(f, pseudo, syncs)
      return _put(arrived, self.parts[f], mean), syncs
    return self._switch(i, sent, arrived, tuple(s.idle() for s in syncs))

  def land(self, i, update, offset, held, arrived, outers):
    """``overlap`` steps after fragment ``i``'s turn: its outer step applies the mean that
    arrived, and its offset loses what was held (the inner steps since stay)."""
    def landed(f, update, offset, held, outers):
      leaves = self.parts[f]
      step, new = self.outer.update(_take(arrived, leaves), outers[f],
                                    _take(self.params, leaves))
      outers = tuple(new if g == f else o for g, o in enumerate(outers))
      kept = jax.tree.map(jnp.subtract, _take(offset, leaves), _take(held, leaves))
      return (_put(update, leaves, step), _put(offset, leaves, kept),
              _put(held, leaves, jax.tree.map(jnp.zeros_like, _take(held, leaves))), outers)
    return self._switch(i, landed, update, offset, held, outers)


def sparseloco(inner: optax.GradientTransformation, *, every: int, density: float = 0.03,
               decay: float = 0.95, lr: float = 1.0, method: str = "sparseloco",
               fragments: int = 1, overlap: int = 0,
               **sync_options) -> optax.GradientTransformationExtraArgs:
  """SparseLoCo's outer loop: ``every`` local steps of ``inner``, then each replica's
  pseudo-gradient added to its decayed error feedback (``e <- decay e + delta``), the
  compressed part of ``e`` averaged, and a plain outer step ``-lr * mean``: no outer
  momentum (the decayed accumulator stands in for it).

  That is :func:`diloco` with ``sync_gradients(method, density=density,
  residual_decay=decay, **sync_options)`` and ``outer=optax.sgd(lr)`` (``fragments`` and
  ``overlap`` as there; islands by an ``inner`` with a sync of its own). The default
  ``method`` is SparseLoCo's own aggregation (chunked top-k, 2-bit values, every selection
  gathered); ``method="spardl"`` puts SparDL's sync under the same rule (its result keeps
  about ``k`` entries, not their union).

  Example:

    >>> import jax, jax.numpy as jnp, optax, spardl_jax as sj
    >>> mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
    >>> tx = sj.sparseloco(optax.adamw(1e-3), every=30, density=0.02)
    >>> state = sj.init_opt_state(tx, {"w": jnp.zeros((100, 10))}, mesh)
    >>> state.sync.method_state.residual.shape
    (8, 1000)

  Args:
    inner: the optimizer of the inner steps (DiLoCo's and SparseLoCo's: AdamW).
    every: inner steps per outer step (``H``).
    density: fraction of each chunk (SparDL: of each block) sent, in (0, 1].
    decay: the error feedback's decay ``beta`` in [0, 1].
    lr: the outer step's rate (> 0).
    method: the registered method that averages the compressed accumulator.
    fragments, overlap: :func:`diloco`'s.
    **sync_options: the method's other options (``chunk``, ``bits`` for SparseLoCo's;
      ``wire`` for SparDL's) and :func:`~spardl_jax.sync_gradients`' (``axis_name``, ...).

  References:
    Sarfi, Thérien, Lidin, Belilovsky, "Communication Efficient LLM Pre-training with
    SparseLoCo", arXiv 2508.15706 (Algorithm 1: the decayed error feedback in place of
    DiLoCo's outer Nesterov momentum).
  """
  check_number("sparseloco", "lr", lr, "a finite number > 0",
               accept=lambda a: 0 < a < float("inf"))
  sync = sync_gradients(method, density=density, residual_decay=decay, **sync_options)
  return diloco(inner, sync, every=every, outer=optax.sgd(lr), fragments=fragments,
                overlap=overlap)


def _placed_like_the_sync(state: DiLoCoState, params) -> DiLoCoState:
  """Outside ``shard_map`` (``tx.init`` under ``jax.set_mesh``, as Linen's
  ``TrainState.create`` calls it): the sync already built its rows on their devices; the
  replicas' offsets and inner state, made here as one array, go on the data axis the same
  way (each replica its row), the rest as the state types declare
  (:mod:`spardl_jax._src.sync.placement`). Where the sync's rows show no layout (traced on
  ``Auto`` axes) the compiler places them."""
  rows = states_in(state.sync, SyncState)[0].count
  sharding = getattr(rows, "sharding", None)
  if not isinstance(sharding, NamedSharding):
    sharding = getattr(jax.typeof(rows), "sharding", None)
  if not isinstance(sharding, NamedSharding) or not sharding.spec or sharding.spec[0] is None:
    return state
  leaves = jax.tree.leaves(params)
  layout = ParamLayout(jax.tree.structure(params), tuple(leaf_specs(params)),
                       tuple(tuple(jnp.shape(x)) for x in leaves))
  specs = state_specs(state, PartitionSpec(sharding.spec[0]), layout)
  return jax.device_put(state, jax.tree.map(
      lambda spec: NamedSharding(sharding.mesh, spec), specs,
      is_leaf=lambda x: isinstance(x, PartitionSpec)))


@moves_the_point(0)
def _at_the_replica(tx, opt_state, params):
  del tx  # the state alone says where the replica is
  return replica_params(opt_state, params)


def replica_params(opt_state, params):
  """This replica's parameters, ``params`` plus its :class:`DiLoCoState` offset, inside the
  data-parallel ``shard_map`` (the point the gradient is taken at); ``params`` unchanged
  when ``opt_state`` holds no outer loop."""
  found = find_outer(opt_state)
  if found is None:
    return params
  return optax.apply_updates(params, jax.tree.map(lambda a: a[0], found.offset))


def find_outer(opt_state) -> DiLoCoState | None:
  """The :class:`DiLoCoState` inside an optimizer state, or None.

  Raises:
    ValueError: if it holds several.
  """
  found = states_in(opt_state, DiLoCoState)
  if len(found) > 1:
    raise ValueError(f"spardl_jax: the optimizer state holds {len(found)} outer loops "
                     f"(diloco); nest none in another.")
  return found[0] if found else None
