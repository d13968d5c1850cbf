"""The SparDL sparse all-reduce: SRS + Spar-All-Gather + Bruck all-gather + global residual
collection.

``spardl_allreduce`` runs inside ``jax.shard_map`` over a named mesh axis: each device passes
its local flat gradient and its own residual state, and gets back the mean of the sparsified
sum over the axis (bit-identical on every device) and its new residual.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from spardl_jax._src.core import (bruck, cost, gres, h_controller, ints, messages, protocol, sag,
                             schedule, sparse, srs, topk)
from spardl_jax._src.core.config import Blocks, SparDLConfig, check_dtype, check_number
from spardl_jax._src.core.nonfinite import NonFinite, check_policy, skip_if

__all__ = ['SparDLState', 'bound_axes', 'saturated_sum', 'the_rest',
           'axis_size', 'resolve_teams', 'spardl_allreduce', 'BlockFrame', 'block_frame',
           'to_blocks', 'from_blocks', 'own_block_selection', 'gather_team', 'scatter_result',
           'collect_residual', 'SparDLMethod']


@protocol.folds(residual=protocol.SUM)
class SparDLState(NamedTuple):
  """Per-device state of the SparDL all-reduce; build it with :meth:`initial`.

  Both fields are required, so the state that goes into :func:`spardl_allreduce` and the one
  that comes out have the same pytree structure (a ``lax.scan`` carry, no retrace).

  Attributes:
    residual: ``(n,)`` this device's residual (discarded gradient mass carried to the next
      step), the dtype of the gradient.
    controller: the B-SAG ``h`` controller (:class:`~spardl_jax._src.core.h_controller.HState`,
      the same on every device); ``last_h`` is ``kb`` when B-SAG is not used.
  """

  residual: jax.Array
  controller: h_controller.HState

  @classmethod
  def initial(cls, n: int, dtype=jnp.float32) -> "SparDLState":
    """The state before the first sync of a flat ``(n,)`` gradient of ``dtype`` (float32,
    bfloat16 or float16): a zero residual and the controller before its first step. Nothing
    in it depends on the options (what does needs the device count, known at trace time)."""
    n = check_number("SparDLState.initial", "n", n, "a positive int (the gradient length)",
                     integral=True, accept=lambda n: n >= 1)
    check_dtype("dtype", dtype)
    return cls(residual=jnp.zeros((int(n),), dtype), controller=h_controller.empty())


def bound_axes() -> list[str]:
  """The mesh axes bound here: shard_map makes its mesh's axes manual in the abstract mesh
  it sets while tracing (empty outside shard_map)."""
  return sorted(map(str, getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ())))


def axis_size(axis_name, *, who: str = "spardl_allreduce") -> int:
  """The size of ``axis_name``, with a clear error naming ``who`` when it is not bound."""
  try:
    return jax.lax.axis_size(axis_name)
  except NameError:
    bound = bound_axes()
    if not bound:
      raise ValueError(
          f"{who} must be called inside jax.shard_map over axis_name={axis_name!r}; no mesh "
          f"axis is bound here (called outside shard_map?).") from None
    raise ValueError(
        f"{who}: axis_name={axis_name!r} is not a bound mesh axis; the bound axes here are "
        f"{bound}.") from None


def _validate(x: jax.Array, state: SparDLState, config: SparDLConfig) -> None:
  if not isinstance(config, SparDLConfig):
    raise TypeError(f"spardl_allreduce: config must be a SparDLConfig, got {type(config).__name__}.")
  check_dtype("x", x.dtype)
  if x.ndim != 1:
    raise ValueError(
        f"spardl_allreduce: x must be the flat local gradient of shape (n,), got shape "
        f"{x.shape}; flatten it first (e.g. jax.flatten_util.ravel_pytree).")
  if not isinstance(state, SparDLState) or not isinstance(state.controller, h_controller.HState):
    got = (f"a SparDLState whose controller is {type(state.controller).__name__}"
           if isinstance(state, SparDLState) else type(state).__name__)
    raise TypeError(f"spardl_allreduce: state must be a SparDLState from SparDLState.initial "
                    f"(residual and controller), got {got}.")
  if state.residual.shape != x.shape:
    raise ValueError(
        f"spardl_allreduce: state.residual has shape {state.residual.shape} but x has shape "
        f"{x.shape}; create the state with SparDLState.initial({x.shape[0]}).")
  if state.residual.dtype != x.dtype:
    raise TypeError(f"spardl_allreduce: state.residual dtype {state.residual.dtype} differs from "
                    f"x dtype {x.dtype}; pass dtype=x.dtype to SparDLState.initial.")


def resolve_teams(config: SparDLConfig, p: int, n: int, itemsize: int) -> tuple[int, str]:
  """``(d, kind)``: the team count for ``p`` workers and ``'none'``, ``'recursive'`` or
  ``'bruck'``; raises a clear error when ``teams`` does not fit ``p``."""
  d = config.teams
  if d == "auto":
    d = cost.choose_teams(p, n, config.density, alpha=config.alpha, beta=config.beta,
                          itemsize=itemsize, sag=config.sag, wire=config.wire)
  if p % d:
    raise ValueError(f"SparDLConfig: teams={d} does not divide the {p} workers on "
                     f"the axis; allowed values: {cost.team_counts(p)}.")
  return d, ("none" if d == 1 else cost.sag_kind(d, config.sag))


def spardl_allreduce(x: jax.Array, state: SparDLState, config: SparDLConfig, *,
                     axis_name, nonfinite: NonFinite = "skip"
                     ) -> tuple[jax.Array, SparDLState]:
  """SparDL sparse all-reduce (mean) of the local flat gradient ``x`` over ``axis_name``.

  Call inside ``jax.shard_map``. With ``g = x + state.residual``, the ``P`` workers run
  Spar-Reduce-Scatter (block-wise top-kb before every send), select top-kb of their summed
  block, agree across teams (Spar-All-Gather, when ``teams > 1``), Bruck-all-gather the
  (offset, value) pairs inside the team and scatter them into the dense result.
  Communication (``d = 1``): ``2 ceil(log2 P)`` rounds, ``4 kb (P - 1)`` elements per worker,
  one packed message per round (``docs/design.md`` has every case). The new residual
  follows global residual collection, so ``sum(residuals) + P * y == sum(x + old
  residuals)`` up to float rounding (with the default ``config.residuals='global'``;
  ``'local'`` and ``'none'`` drop mass on purpose).

  Results are ``varying`` over the axis in JAX's type system although they are identical on
  every device: return them with ``out_specs=P(axis)`` or use ``check_vma=False``.

  A NaN or inf in any device's ``x`` (or residual) always reaches ``y`` (every selection
  ranks it first), so every device sees it in the same call; with ``nonfinite='skip'``
  (default) that call returns zeros and the state unchanged on every device, and the books
  stay finite (:mod:`spardl_jax._src.core.nonfinite`).

  Args:
    x: ``(n,)`` float32, bfloat16 or float16 array, this device's gradient (float64 is
      rejected: selection keys are float32 bits, see ``docs/design.md``).
    state: this device's :class:`SparDLState` from :meth:`SparDLState.initial` (``residual`` of
      shape ``(n,)`` and ``x``'s dtype, and the controller).
    config: a :class:`SparDLConfig`.
    axis_name: the ``shard_map`` mesh axis to reduce over.
    nonfinite: ``'skip'`` (default) or ``'propagate'`` (return what was computed, NaNs in
      the result and the residuals included).

  Returns:
    ``(y, new_state)``: ``y`` ``(n,)`` the mean over the axis of the sparsified ``g``,
    bit-identical on every device; ``new_state`` with the new residual, of the same pytree
    structure, shapes and dtypes as ``state`` (so it can be a ``lax.scan`` carry).

  Example (8 devices; at density 1 the result is the mean):

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8],
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> config = SparDLConfig(density=1.0)
    >>> def step(x):  # each device: its (1, 4) row, a fresh state
    ...   y, state = spardl_allreduce(x[0], SparDLState.initial(4), config, axis_name="data")
    ...   return y[None]
    >>> x = jnp.arange(32.0).reshape(8, 4)  # row w is device w's gradient
    >>> y = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(x)
    >>> np.asarray(y)[0], bool((np.asarray(y) == np.asarray(y)[0]).all())
    (array([14., 15., 16., 17.], dtype=float32), True)

  References:
    Zhao et al., "SparDL: Distributed Deep Learning Training with Efficient Sparse
    Communication", ICDE 2024, Sections III-B/C and Algorithm 1.
  """
  p = axis_size(axis_name)
  _validate(x, state, config)
  check_policy("spardl_allreduce", nonfinite)
  y, new_state = _stages(x, state, config, p=p, axis_name=axis_name)
  if nonfinite == "skip":  # NaN and inf always reach y: it tells every device alike
    return skip_if(~jnp.all(jnp.isfinite(y)), y, new_state, state)
  return y, new_state


def _stages(x: jax.Array, state: SparDLState, config: SparDLConfig, *, p: int,
            axis_name) -> tuple[jax.Array, SparDLState]:
  """The paper's stages, in order (Algorithm 1)."""
  frame = block_frame(x.shape[0], config, p=p, itemsize=np.dtype(x.dtype).itemsize,
                      axis_name=axis_name)
  buf = to_blocks(saturated_sum(x, state.residual), frame)
  reduced = srs.spar_reduce_scatter(buf, kb=frame.kb, chunk=frame.chunk, rank=frame.rank, p=p,
                                    axis_name=axis_name, wire=frame.wire)
  own_off, own_val, own_err = own_block_selection(reduced.buf, frame)
  agreed = sag.spar_all_gather(own_off, own_val, state.controller, kind=frame.kind,
                               kb=frame.kb, p=p, q=frame.q, team=frame.team,
                               axis_name=axis_name, wire=frame.wire)
  rows_off, rows_val, counts = gather_team(agreed, frame, axis_name=axis_name)
  controller = sag.next_controller(agreed, counts, kb=frame.kb, d=frame.d)
  y, in_result = scatter_result(rows_off, rows_val, frame, p=p)
  if config.residuals == "none":
    return from_blocks(y, frame), SparDLState(jnp.zeros_like(x), controller)
  residual = collect_residual(reduced, agreed, own_err, None if config.residuals == "local"
                              else in_result, frame, gradient=(x, state.residual),
                              own_values=own_val)
  return from_blocks(y, frame), SparDLState(from_blocks(residual, frame), controller)


def _largest(g: jax.Array, sign: jax.Array) -> jax.Array:
  return jnp.asarray(jnp.finfo(g.dtype).max, g.dtype) * jnp.sign(sign).astype(g.dtype)


def saturated_sum(x: jax.Array, residual: jax.Array) -> jax.Array:
  """``g = x + residual``, each entry where two finite terms sum beyond the dtype's range
  held at its largest finite value of their sign: a residual that keeps a wire's rounding
  error of a value near float32's maximum, plus the same value again. Elementwise, in the
  pass that adds; :func:`the_rest` is what was held back."""
  g = x + residual
  return jnp.where(jnp.isinf(g) & jnp.isfinite(x) & jnp.isfinite(residual), _largest(g, x), g)


def the_rest(x: jax.Array, residual: jax.Array) -> jax.Array:
  """What :func:`saturated_sum` held back of ``x + residual``, entrywise (zero where it held
  nothing): ``x`` minus the largest finite value, plus ``residual``."""
  g = x + residual
  held = jnp.isinf(g) & jnp.isfinite(x) & jnp.isfinite(residual)
  return jnp.where(held, (x - _largest(g, x)) + residual, jnp.zeros_like(g))


class BlockFrame(NamedTuple):
  """The layout stage: how this worker's flat ``(n,)`` gradient becomes team blocks.

  Attributes:
    layout: the :class:`~spardl_jax._src.core.config.Blocks` (``q`` blocks of ``m``, ``kb``).
    d: the team count; kind: ``'none'``, ``'recursive'`` or ``'bruck'`` (the SAG).
    chunk: the two-stage selection's chunk length ``c``
      (:func:`~spardl_jax._src.core.topk.chunk_size`).
    wire: the message format (:class:`~spardl_jax._src.core.messages.Wire`).
    mc: a block's length in the buffer, ``m`` rounded up to a multiple of ``c``.
    rank: () int32 position in the team; team: () int32 team index.
  """

  layout: Blocks
  d: int
  kind: str
  chunk: int
  wire: messages.Wire
  mc: int
  rank: jax.Array
  team: jax.Array

  @property
  def q(self) -> int:
    return self.layout.q

  @property
  def kb(self) -> int:
    return self.layout.kb

  @property
  def size(self) -> int:
    """Length of the flat block buffer, ``q * mc``; also the position of an empty slot."""
    return self.layout.q * self.mc

  def positions(self, rows: jax.Array, offsets: jax.Array) -> jax.Array:
    """Flat buffer positions of ``offsets`` ``(L, kb)`` in block ``rows`` ``(L,)``;
    :attr:`size` for empty slots."""
    return jnp.where(offsets.reshape(-1) == sparse.INVALID, self.size,
                     srs.flat_positions(rows, offsets, self.mc))


def block_frame(n: int, config: SparDLConfig, *, p: int, itemsize: int,
                axis_name) -> BlockFrame:
  """Layout: ``d`` teams of ``Q = P / d`` contiguous ranks, ``Q`` blocks of ``m = ceil(n /
  Q)`` each keeping ``kb`` (``docs/design.md``, "Block layout")."""
  d, kind = resolve_teams(config, p, n, itemsize)
  layout = Blocks.make(n, p // d, config.density)
  chunk = topk.chunk_size(layout.m, layout.kb)
  index = jax.lax.axis_index(axis_name).astype(jnp.int32)
  return BlockFrame(layout=layout, d=d, kind=kind, chunk=chunk,
                    wire=cost.wire_format(config.wire, layout),
                    mc=-(-layout.m // chunk) * chunk, rank=ints.rem(index, layout.q),
                    team=ints.div(index, layout.q))


def to_blocks(g: jax.Array, frame: BlockFrame) -> jax.Array:
  """``(n,)`` -> the ``(q, mc)`` zero-padded block buffer (row ``b`` is block ``b``)."""
  layout = frame.layout
  buf = jnp.pad(g, (0, layout.padded - layout.n)).reshape(layout.q, layout.m)
  return jnp.pad(buf, ((0, 0), (0, frame.mc - layout.m)))


def from_blocks(flat: jax.Array, frame: BlockFrame) -> jax.Array:
  """``(q * mc,)`` flat block buffer -> ``(n,)``; free when no padding was added."""
  layout = frame.layout
  return flat.reshape(layout.q, frame.mc)[:, :layout.m].reshape(-1)[:layout.n]


def own_block_selection(buf: jax.Array, frame: BlockFrame
                        ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """Top-``kb`` of the worker's own reduced block (block ``rank``): ``(kb,)`` ascending
  offsets, their values as the wire carries them (so the owner uses the same values as
  everyone it sends them to) and the rounding error GRES leaves in the worker's residual
  (None when values travel unchanged)."""
  offsets, values = topk.block_topk(buf, frame.rank[None], frame.kb, frame.chunk)
  return offsets[0], frame.wire.round(values[0]), frame.wire.rounding_error(values[0])


def gather_team(agreed: sag.SagResult, frame: BlockFrame, *, axis_name
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The final Bruck all-gather inside the team: every worker's ``(kb,)`` agreed pairs.

  B-SAG's distinct count rides in the same message as one extra word, so every worker
  learns all ``Q`` counts without another round.

  Returns:
    ``(offsets, values, counts)``: ``(q, kb)`` rows in the rotated frame (row ``j`` is the
    block of team rank ``(rank + j) mod q``) and the ``(q,)`` counts (zeros without B-SAG).
  """
  q, p = frame.q, frame.q * frame.d
  count = None if agreed.count is None else agreed.count[None, None]
  message = frame.wire.pack(agreed.offsets[None], agreed.values[None], count)
  gathered = bruck.bruck_allgather(
      message, size=q, axis_name=axis_name,
      permutation=lambda shift: schedule.team_permutation(p, q, shift))
  unpacked = frame.wire.unpack(gathered, frame.kb, agreed.values.dtype,
                               extra=0 if count is None else 1)
  counts = (jnp.zeros((q,), jnp.int32) if count is None else unpacked[2].reshape(q))
  return unpacked[0], unpacked[1], counts


def scatter_result(offsets: jax.Array, values: jax.Array, frame: BlockFrame, *, p: int
                   ) -> tuple[jax.Array, jax.Array]:
  """The gathered ``(q, kb)`` pairs, divided by ``P``, into the dense flat block buffer.

  Returns:
    ``(y, in_result)``: ``(q * mc,)`` result and the bool mask of its selected positions.
  """
  rows = ints.rem(frame.rank + jnp.arange(frame.q, dtype=jnp.int32), frame.q)
  at = frame.positions(rows, offsets)
  unique = frame.kind == "none"  # Only SAG leaves empty slots (which all map to `size`).
  y = jnp.zeros((frame.size,), values.dtype).at[at].set(
      (values / p).reshape(-1), mode="drop", unique_indices=unique)
  in_result = jnp.zeros((frame.size,), jnp.bool_).at[at].set(True, mode="drop",
                                                              unique_indices=unique)
  return y, in_result


def collect_residual(reduced: srs.SRSResult, agreed: sag.SagResult,
                     own_error: jax.Array | None, in_result: jax.Array | None,
                     frame: BlockFrame, *, gradient: tuple[jax.Array, jax.Array],
                     own_values: jax.Array) -> jax.Array:
  """Residual collection in the flat block buffer: GRES with ``in_result``, LRES without.

  ``own_error`` is the rounding error of the worker's own selection, in the order of
  ``agreed.sent``. Under GRES, R-SAG's discarded shares count only where the index made the
  result (elsewhere the gradient is restored there anyway). ``gradient`` is ``(x, old
  residual)``: where their sum was held at the largest finite value (:func:`saturated_sum`,
  an entry that is then always among the largest of its block, so selected), what was held
  back stays with the part of the sent value that did not travel, held itself at the largest
  finite value: the residual never overflows. Reading ``x`` and the old residual at the
  selected places costs more than the rest of this (they are random reads), so they are read
  only when this worker selected a value of at least half the largest finite one
  (``own_values``: its own block's, as sent).
  """
  own = frame.rank[None]
  selected = jnp.concatenate([reduced.selected, frame.positions(own, agreed.sent[None])])
  # The rest of a held entry, read where this worker selected (a few kb entries).
  flat = jnp.minimum(
      ints.div(selected, frame.mc) * frame.layout.m + ints.rem(selected, frame.mc),
      frame.layout.n - 1)
  valid = (selected < frame.size) & (ints.rem(selected, frame.mc) < frame.layout.m)
  x, old = gradient
  top = jnp.finfo(reduced.buf.dtype).max
  rest = jax.lax.cond(
      jnp.maximum(reduced.peak, jnp.max(jnp.abs(own_values))) >= top / 2,
      lambda: jnp.where(valid, the_rest(x[flat], old[flat]), 0).astype(reduced.buf.dtype),
      lambda: jnp.zeros_like(selected, reduced.buf.dtype))
  errors = rest
  if own_error is not None:
    errors = rest + (own_error if reduced.errors is None else
                     jnp.concatenate([reduced.errors, own_error]))
  errors = jnp.clip(errors, -top, top)
  residual = gres.collect_residuals(reduced.buf.reshape(-1), in_result, reduced.receipts,
                                    selected, sent_errors=errors)
  if in_result is None:
    return residual
  for share in agreed.shares:
    at = frame.positions(own, share.offsets[None])
    at = jnp.where(in_result.at[at].get(mode="fill", fill_value=False), at, frame.size)
    residual = residual.at[at].add(share.values, mode="drop")
  return residual


@protocol.register
@dataclasses.dataclass(frozen=True)
class SparDLMethod(protocol.FlatVector):
  """SparDL (:func:`spardl_allreduce`) as a registered :class:`~spardl_jax._src.core.protocol.AllReduce`."""

  name: ClassVar[str] = "spardl"
  summary: ClassVar[str] = "SparDL (SRS + SAG + Bruck + GRES)"
  Config: ClassVar[type] = SparDLConfig
  sparse: ClassVar[bool] = True
  # Every selection (SRS, own block, R-SAG merges, B-SAG's top-h with h >= 1) keeps the
  # largest keys first, and NaN/inf keys are the largest: they always reach y.
  nonfinite_reaches_result: ClassVar[bool] = True
  config: SparDLConfig

  def init(self, *, n: int, dtype, p: int) -> SparDLState:
    del p
    return SparDLState.initial(n, dtype)

  def apply(self, x, state, *, axis_name):
    # Callers apply their own agreed policy (sync_gradients, methods.sharded) around it.
    return spardl_allreduce(x, state, self.config, axis_name=axis_name,
                            nonfinite="propagate")

  def paper_cost(self, *, p: int, n: int, k: int) -> protocol.PaperCost:
    teams, _ = resolve_teams(self.config, p, n, itemsize=4)
    return cost.spardl_paper_cost(p, k, teams, sag=self.config.sag)

  def formula(self, *, p: int, n: int, itemsize: int, h=None) -> cost.SparDLCost:
    teams, _ = resolve_teams(self.config, p, n, itemsize)
    return cost.spardl_cost(p, n, self.config.density, teams, itemsize=itemsize,
                            sag=self.config.sag, h=h, wire=self.config.wire)

  def stats(self, *, n: int, p: int, itemsize: int, state: SparDLState, rank):
    del rank  # every worker sends the same bytes
    h = state.controller.last_h
    return self.formula(p=p, n=n, itemsize=itemsize, h=h).bytes, h
