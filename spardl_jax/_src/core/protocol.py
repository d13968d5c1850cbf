"""What a gradient all-reduce is, and the one registry every method registers itself in.

SparDL and each competitor implement :class:`AllReduce` with keyword-only arguments and
register their class once with :func:`register`. The optax transformation, the trainer's
``--method``/``--compare``, the benchmarks and the docs read the registry, so a new method
plugs in at one place. This module depends on nothing else in the package, so the SparDL
core and the baselines can both register here without knowing of each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple, Protocol, TypeVar, runtime_checkable

import jax

__all__ = ['AllReduce', 'Cost', 'PaperCost', 'SUM', 'SAME', 'MEAN', 'FRESH', 'FOLD_RULES',
           'PER_DEVICE', 'PER_REPLICA', 'REPLICATED', 'LIKE_PARAMS', 'PLACES', 'Field', 'declare_layout',
           'layout', 'folds', 'declared_fields', 'HasResidual', 'residual', 'FlatVector',
           'register', 'registered', 'build']

@runtime_checkable
class AllReduce(Protocol):
  """A gradient all-reduce over one mesh axis, usable inside ``jax.shard_map``.

  Implementations are frozen dataclasses holding their validated ``config``.

  Attributes:
    name: the registry name (``'spardl'``, ``'dense'``, ...).
    summary: one line for tables and ``--help``.
    Config: the options class (a frozen dataclass) or None when there are no options.
    nonfinite_reaches_result: True when a NaN or inf in any device's input (gradient plus
      state) always reaches the result (as when every selection ranks them above finite
      values and nothing is held back for capacity): the result, bit-identical everywhere,
      then tells every device about it with no extra communication.
    sparse: True when the method keeps a fraction ``config.density`` of the entries (the
      trainer gives sparse methods its convergence recipe).
    leafwise: True when the method works per gradient leaf and needs :meth:`for_leaves`
      before ``init`` (PowerSGD); False when it sees one flat vector.
    config: an instance of ``Config`` (or None).

  A method whose state carries error feedback keeps it in a field named ``residual`` (see
  :class:`HasResidual`): a dense warm-up delivers it, a checkpoint folds it, statistics
  report its norm. :class:`FlatVector` gives the defaults of a method that sees one flat
  vector.
  """

  name: ClassVar[str]
  summary: ClassVar[str]
  Config: ClassVar[type | None]
  nonfinite_reaches_result: ClassVar[bool]
  sparse: ClassVar[bool]
  leafwise: ClassVar[bool]
  config: Any

  def for_leaves(self, shapes) -> "AllReduce":
    """This all-reduce for a gradient whose float leaves have these shapes, flattened in
    order (itself, for a method that sees one flat vector)."""

  def paper_cost(self, *, p: int, n: int, k: int) -> "PaperCost | None":
    """The paper's Table 1 row for this method with ``k`` selected entries in all (the ring
    all-reduce for dense methods), or None for a method the paper does not cost."""

  def init(self, *, n: int, dtype: Any, p: int) -> Any:
    """The per-device state for a flat ``(n,)`` gradient of ``dtype`` on ``p`` devices: a
    pytree of arrays (``()`` when the method keeps none). Its structure never changes."""

  def apply(self, x: jax.Array, state: Any, *, axis_name: Any) -> tuple[jax.Array, Any]:
    """``(mean, new_state)`` inside ``shard_map``: ``x`` is this device's ``(n,)`` gradient;
    ``mean`` ``(n,)`` is bit-identical on every device; ``new_state`` has ``state``'s
    structure."""

  def stats(self, *, n: int, p: int, itemsize: int, state: Any, rank: Any
            ) -> tuple[Any, Any]:
    """``(bytes_sent, h)`` after an all-reduce that left ``state``: the bytes device
    ``rank`` sent (what the HLO traffic tests check; a capacity bound for threshold
    methods) and SparDL's cross-team pairs per block (0 for other methods)."""

  def formula(self, *, p: int, n: int, itemsize: int) -> "Cost":
    """This method's :class:`Cost` for an ``(n,)`` gradient of ``itemsize`` bytes on ``p``
    devices."""

class Cost(NamedTuple):
  """A method's communication per sync (its ``formula``), what the tests hold to the compiled
  HLO: ``rounds`` of messages and ``bytes`` the busiest device sends (ints, or traced scalars
  for a method whose messages adapt, as B-SAG's ``h``), and ``bytes_per_device`` when the
  devices send unevenly (gTopk's tree; None when every device sends ``bytes``)."""

  rounds: Any
  bytes: Any
  bytes_per_device: tuple[int, ...] | None = None


class PaperCost(NamedTuple):
  """A row of the paper's Table 1: ``rounds`` (latency, in alpha) and ``elements``
  (bandwidth, ``(low, high)`` float32 words a worker sends, in beta per element)."""

  rounds: float
  elements: tuple[float, float]


# How a per-device state leaf moves onto another number of devices (a state type declares
# them per field; a field it leaves out takes its enclosing field's rule, at the top FRESH):
SUM = "sum"      # a per-device sum of gradient mass: fold to its total, spread evenly
SAME = "same"    # equal on every device: every new device gets it
MEAN = "mean"    # a per-device sample: every new device gets the mean
FRESH = "fresh"  # depends on the device count: restarted
FOLD_RULES = (SUM, SAME, MEAN, FRESH)

# Where a state field's leaves live on the mesh (a field that declares none lives where its
# enclosing field does; at the top, where what it holds says: a declared state by its own
# fields, a subtree shaped like the parameters by the parameters' specs, the rest replicated):
PER_DEVICE = "per_device"    # one row per device of the mesh: a leading axis, (P, ...) in all
PER_REPLICA = "per_replica"  # a leading axis over the data axis; under it, laid out as alone
REPLICATED = "replicated"    # the same on every device, stored once
LIKE_PARAMS = "like_params"  # shaped like the parameters: each leaf laid out as its parameter
PLACES = (PER_DEVICE, PER_REPLICA, REPLICATED, LIKE_PARAMS)


class Field(NamedTuple):
  """How one field of a state type is laid out on the mesh (``place``: one of
  :data:`PLACES`, or None to inherit it) and moves onto another device count (``fold``: one
  of :data:`FOLD_RULES`, or None to inherit it)."""

  place: str | None = None
  fold: str | None = None


# A state type's fields, or a function of one of its instances and the per-device rows'
# PartitionSpec (None where no mesh is involved) giving them, or None for "not declared".
Fields = dict[str, Field]
_LAYOUTS: dict[type, "Fields | Callable[[Any, Any], Fields | None]"] = {}

T = TypeVar("T", bound=type)


def declare_layout(cls: type, fields: "Fields | Callable[[Any, Any], Fields | None]") -> None:
  """Declares where each field of the state type ``cls`` (a NamedTuple) lives and how it
  folds: a dict of :class:`Field` s by field name, or, for a type whose layout depends on
  what an instance holds (``optax.MultiStepsState`` around a sync), a function
  ``fields(state, rows) -> dict | None`` that may also refuse a state it cannot lay out.
  ``spardl_jax.opt_state_specs``, ``init_opt_state`` and ``fold_rules`` read it; nothing
  else needs to know the type."""
  if isinstance(fields, dict):
    for name, field in fields.items():
      if name not in cls._fields:  # type: ignore[attr-defined]
        raise ValueError(f"declare_layout: {cls.__name__} has no field {name!r}.")
      if field.place not in (None, *PLACES) or field.fold not in (None, *FOLD_RULES):
        raise ValueError(f"declare_layout: {cls.__name__}.{name}={field!r}; places are "
                         f"{PLACES} (or None), fold rules {FOLD_RULES} (or None).")
  _LAYOUTS[cls] = fields


def layout(**fields: Field) -> Callable[[T], T]:
  """Class decorator of a state type (a NamedTuple): :func:`declare_layout` with these
  fields, e.g. ``@layout(residual=Field(PER_DEVICE, SUM))``."""
  def declare(cls: T) -> T:
    declare_layout(cls, fields)
    return cls

  return declare


def folds(**rules: str) -> Callable[[T], T]:
  """Class decorator of a method's per-device state (a NamedTuple, always inside the sync's
  per-device rows): how each named field moves onto another number of devices (:data:`SUM`,
  :data:`SAME` or :data:`MEAN`; fields left out restart). :func:`layout` with no places."""
  for field, rule in rules.items():
    if rule not in (SUM, SAME, MEAN):
      raise ValueError(f"folds: {field}={rule!r}; the rules are {(SUM, SAME, MEAN)}.")
  return layout(**{field: Field(fold=rule) for field, rule in rules.items()})


def declared_fields(node, rows=None) -> Fields | None:
  """The :class:`Field` s the type of ``node`` declared (for a declaration by function, for
  this instance on a mesh whose per-device rows are ``rows``), or None."""
  fields = _LAYOUTS.get(type(node))
  return fields(node, rows) if callable(fields) else fields


@runtime_checkable
class HasResidual(Protocol):
  """A method state that carries error feedback: ``residual`` ``(n,)``, the gradient mass
  this device still owes the next syncs."""

  residual: jax.Array


def residual(state) -> jax.Array | None:
  """The residual of a method's per-device state, or None for a method that keeps none."""
  return state.residual if isinstance(state, HasResidual) else None


class FlatVector:
  """The defaults of an all-reduce that sees one flat vector: no leaf shapes to bind."""

  leafwise: ClassVar[bool] = False

  def for_leaves(self, shapes) -> "FlatVector":
    del shapes
    return self

  def paper_cost(self, *, p: int, n: int, k: int) -> PaperCost | None:
    del p, n, k
    return None


Method = TypeVar("Method", bound=type)
# Classes checked for the protocol's attributes when registered (a Protocol with class
# attributes is not a type a checker lets classes be assigned to, so the values are Any).
_REGISTRY: dict[str, Any] = {}


def register(cls: Method) -> Method:
  """Class decorator: adds an :class:`AllReduce` implementation under ``cls.name``."""
  entry: Any = cls  # checked here for the protocol's attributes
  for attribute in ("name", "summary", "Config", "nonfinite_reaches_result", "sparse",
                    "leafwise", "for_leaves", "paper_cost", "init", "apply", "stats",
                    "formula"):
    if not hasattr(cls, attribute):
      raise TypeError(f"register: {cls.__name__} lacks {attribute!r} of the AllReduce protocol.")
  if entry.name in _REGISTRY and _REGISTRY[entry.name] is not cls:
    raise ValueError(f"register: the method name {entry.name!r} is taken by "
                     f"{_REGISTRY[entry.name].__qualname__}.")
  _REGISTRY[entry.name] = cls
  return cls


def registered() -> dict[str, Any]:
  """The registered method classes by name, in registration order."""
  return dict(_REGISTRY)


def build(name: str, **options) -> AllReduce:
  """The method ``name`` with its options validated by its ``Config``.

  Raises:
    ValueError: for an unknown name, or options given to a method that takes none.
    TypeError: for an option the method's ``Config`` does not have.
  """
  if name not in _REGISTRY:
    raise ValueError(f"method must be one of {tuple(_REGISTRY)}, got {name!r}.")
  cls = _REGISTRY[name]
  if cls.Config is None:
    if options:
      raise ValueError(f"method {name!r} takes no options, got {sorted(options)}.")
    return cls()
  fields = sorted(f.name for f in dataclasses.fields(cls.Config))
  unknown = sorted(set(options) - set(fields))
  if unknown:
    raise TypeError(f"method {name!r} has no option {', '.join(unknown)}; its options are "
                    f"{fields}.")
  return cls(cls.Config(**options))
