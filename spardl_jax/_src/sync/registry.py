"""Gradient all-reduce methods by name: the registry of :mod:`spardl_jax._src.core.protocol`.

Every method implements :class:`~spardl_jax._src.core.protocol.AllReduce` and registers itself
once (SparDL in :mod:`spardl_jax._src.core.allreduce`, the competitors in
:mod:`spardl_jax._src.baselines`). The optax transformation (:mod:`spardl_jax._src.sync.transform`),
the trainer, the benchmarks and :func:`describe` read that registry, so a new algorithm
plugs in at one place. This module adds text parsing (``'oktopk:tau=16'``) and the sharded
runners that hold one state row per device.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

import spardl_jax._src.baselines  # noqa: F401  (registers the competitors)
import spardl_jax._src.core.allreduce  # noqa: F401  (registers SparDL)
from spardl_jax._src.core import protocol
from spardl_jax._src.core.config import SparDLConfig
from spardl_jax._src.core.nonfinite import NonFinite, any_device, check_policy, skip_if
from spardl_jax._src.core.protocol import AllReduce, Cost, FlatVector, register
from spardl_jax._src.core.topk import default_method as default_selection
from spardl_jax._src.core.density import AUTO, at_devices

__all__ = ['from_config', 'names', 'is_sparse', 'parse_teams', 'parse_density',
           'option_parser', 'split_spec', 'sharded_allreduce',
           'MethodSpec', 'parse', 'make', 'describe', 'init_rows', 'abstract_rows', 'sharded',
           'default_selection', 'AUTO',
           # The protocol a method implements, and its registration (docs/new-method.md).
           'AllReduce', 'Cost', 'FlatVector', 'register']


def names() -> tuple[str, ...]:
  """The registered methods' names, in registration order (the core's SparDL, the
  baselines, then any registered later: the registry is the only list)."""
  return tuple(protocol.registered())


def from_config(config) -> AllReduce:
  """The registered method whose options class ``config`` is an instance of, built with it.

    >>> import spardl_jax as sj
    >>> from_config(sj.collectives.SparDLConfig(density=0.01)).name
    'spardl'
  """
  for cls in protocol.registered().values():
    if cls.Config is not None and type(config) is cls.Config:
      return cls(config)
  raise TypeError(f"from_config: no registered method takes a {type(config).__name__}.")


def is_sparse(name: str) -> bool:
  """Whether the registered method ``name`` keeps a fraction of the entries (its
  ``sparse``): the trainer's convergence recipe is for those."""
  return protocol.registered()[name].sparse


def option_parser(hint) -> Callable[[str], Any]:
  """How ``key=value`` text becomes an option annotated ``hint``: ``int`` and ``float`` as
  themselves, a ``Literal`` (or ``str``) as the text (its config checks the choice), an
  optional one with ``'none'`` for None, and one that may also be a literal (``int |
  Literal['auto']``) with that literal kept as text."""
  args = typing.get_args(hint)
  if typing.get_origin(hint) in (typing.Union, types.UnionType):
    literals = {a for arg in args if typing.get_origin(arg) is typing.Literal
                for a in typing.get_args(arg)}
    rest = [arg for arg in args if arg is not type(None) and typing.get_origin(arg) is None]
    inner = option_parser(rest[0]) if len(rest) == 1 else str

    def parse(text: str):
      if type(None) in args and text.lower() == "none":
        return None
      return text if text in literals else inner(text)
    parse.__name__ = " or ".join([getattr(inner, "__name__", "value"),
                                  *map(repr, sorted(literals)),
                                  *(["'none'"] if type(None) in args else [])])
    return parse
  return hint if hint in (int, float) else str


def parse_density(text: str):
  """A ``density`` value from text: a number or ``'auto'`` (picked from the devices when
  the method is made, so no config's type says it; any case)."""
  return AUTO if text.strip().lower() == AUTO else float(text)


parse_density.__name__ = "density (a number in (0, 1], or 'auto')"
# A ``teams`` value from text (an int or 'auto'), as a spec reads it: for a command line.
parse_teams = option_parser(typing.get_type_hints(SparDLConfig)["teams"])


def _option_types() -> dict[str, Callable[[str], Any]]:
  """How ``key=value`` text becomes each registered config's option, from its type."""
  types_: dict[str, Callable[[str], Any]] = {}
  for cls in protocol.registered().values():
    if cls.Config:
      hints = typing.get_type_hints(cls.Config)
      for field in dataclasses.fields(cls.Config):
        types_[field.name] = (parse_density if field.name == "density" else
                              option_parser(hints[field.name]))
  return types_


def split_spec(text: str) -> tuple[str, list[str]]:
  """``'method:key=value:...'`` -> ``(method, ['key=value', ...])``; a key given twice is a
  ValueError (the last one would silently win)."""
  method, *pairs = text.split(":")
  keys = [pair.partition("=")[0] for pair in pairs]
  twice = sorted({key for key in keys if keys.count(key) > 1})
  if twice:
    raise ValueError(f"method spec {text!r}: {', '.join(twice)} given more than once.")
  return method, pairs


class MethodSpec(NamedTuple):
  """A method spec read once (:func:`parse`): the registered method's name and its options,
  a ``density`` possibly still ``"auto"`` or a rule, picked when the method is built for the
  devices it runs on."""

  method: str
  options: dict

  def build(self, p: int | None = None) -> AllReduce:
    """The all-reduce for ``p`` devices (:func:`make`; ``p`` only matters to a density
    picked from the devices)."""
    return make(self.method, p=p, **self.options)


def parse(text: str, **defaults) -> MethodSpec:
  """``method[:key=value[:key=value...]]`` -> the :class:`MethodSpec` (``(method,
  options)``) that :meth:`MethodSpec.build` or :func:`make` turns into the all-reduce.

  Each method takes the fields of its ``Config`` as keys. ``defaults`` give the options
  ``text`` leaves out, each to the methods whose ``Config`` has that field (a
  ``density`` reaches every sparse method, a ``teams`` only SparDL):

    >>> spec = parse("oktopk:tau=16", density=0.01, teams=2)
    >>> spec
    MethodSpec(method='oktopk', options={'density': 0.01, 'tau': 16})
    >>> spec.build(p=8).name
    'oktopk'
  """
  method, pairs = split_spec(text)
  if method not in protocol.registered():
    raise ValueError(f"method spec {text!r}: the method must be one of {names()}.")
  config = protocol.registered()[method].Config
  fields = {f.name for f in dataclasses.fields(config)} if config else set()
  options = {key: value for key, value in defaults.items() if key in fields}
  types = _option_types()
  for pair in pairs:
    key, sep, value = pair.partition("=")
    if not sep or key not in fields:
      raise ValueError(f"method spec {text!r}: {pair!r} is not key=value with key one of "
                       f"{sorted(fields)} (the options of {method!r}).")
    try:
      options[key] = types[key](value)
    except ValueError:
      raise ValueError(f"method spec {text!r}: {key}={value!r} is not a valid "
                       f"{types[key].__name__}.") from None
  return MethodSpec(method, options)


def make(method: str, *, p: int | None = None, **options) -> AllReduce:
  """The all-reduce called ``method``, built from its options.

  Args:
    method: one of :func:`names`.
    p: the devices of the data axis, where ``density`` is picked from them (``"auto"`` or
      a :func:`~spardl_jax.density_rule`); unused otherwise.
    **options: the fields of the method's ``Config`` (see :func:`describe`).

  Raises:
    ValueError: for an unknown method, or a density rule without ``p``; TypeError for an
      option it does not take.
  """
  if "density" in options:
    options["density"] = at_devices(options["density"], p, f"method {method!r}")
  return protocol.build(method, **options)


def describe() -> str:
  """A table of the registered methods: name, algorithm and options."""
  rows = []
  for name, cls in protocol.registered().items():
    options = ", ".join(f.name for f in dataclasses.fields(cls.Config)) if cls.Config else "-"
    rows.append(f"{name:<9} {cls.summary:<44} {options}")
  return "\n".join(rows)


def init_rows(method: AllReduce, p: int, n: int, dtype=jnp.float32):
  """``method``'s initial state for ``p`` devices: every leaf gets a leading ``(p,)`` axis.

  The rows are host NumPy arrays, read-only broadcast views that take no memory per row:
  place them with :func:`spardl_jax._src.parallel.rows.shard_rows` (or ``jax.device_put`` with a
  ``PartitionSpec(axis_name)`` sharding), which copies each device only its own row. An eager
  device broadcast would compile a program per leaf shape and build all ``p`` rows on one
  device before resharding them.
  """
  return jax.tree.map(lambda a: np.broadcast_to(np.asarray(a), (p, *np.shape(a))),
                      method.init(n=n, dtype=dtype, p=p))


def abstract_rows(method: AllReduce, p: int, n: int, sharding, dtype=jnp.float32):
  """:func:`init_rows` as ``jax.ShapeDtypeStruct`` leaves placed with ``sharding``: what
  ``sharded(method, ...).lower`` needs for the state, without allocating it."""
  return jax.tree.map(
      lambda a: jax.ShapeDtypeStruct((p, *a.shape), a.dtype, sharding=sharding),
      jax.eval_shape(functools.partial(method.init, n=n, dtype=dtype, p=p)))


def sharded(method: AllReduce, mesh: jax.sharding.Mesh, axis_name: str = "data", *,
            nonfinite: NonFinite = "skip"):
  """``method`` over arrays that hold one row per device, jitted.

  Per-device state lives in arrays with a leading device axis sharded over ``axis_name``
  (the residual is ``(P, n)``; each device sees its ``(1, n)`` row), the layout optimizer
  state uses in data-parallel JAX. A NaN or inf in any device's row is handled as
  ``nonfinite`` says, alike on every device (:mod:`spardl_jax._src.core.nonfinite`; by default
  the call returns zeros and the state unchanged).

  Raises:
    ValueError: ``axis_name`` is not an axis of ``mesh``, or ``nonfinite`` is not a policy.

  Returns:
    ``f(grads, state) -> (ys, state)``: ``grads`` ``(P, n)`` (row ``w`` is device ``w``'s
    gradient) and ``state`` from :func:`init_rows`, both sharded ``PartitionSpec(axis_name)``;
    every row of ``ys`` is the same mean.
  """
  if axis_name not in mesh.axis_names:
    raise ValueError(f"sharded: axis_name={axis_name!r} is not an axis of the mesh; its axes "
                     f"are {tuple(mesh.axis_names)}.")
  check_policy("sharded", nonfinite)
  rows = PartitionSpec(axis_name)

  def step(grad, state):
    x, old = grad[0], jax.tree.map(lambda a: a[0], state)
    y, new = method.apply(x, old, axis_name=axis_name)
    if nonfinite == "skip":
      bad = any_device(method.nonfinite_reaches_result, x, old, y, axis_name)
      y, new = skip_if(bad, y, new, old)
    return y[None], jax.tree.map(lambda a: a[None], new)

  return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(rows, rows), out_specs=(rows, rows)))


def sharded_allreduce(config: SparDLConfig, mesh: jax.sharding.Mesh, axis_name: str = "data",
                      *, nonfinite: NonFinite = "skip"):
  """SparDL with ``config`` as one ``jit(shard_map(...))`` over ``(P, n)`` gradient rows and
  ``(P, ...)`` state rows (:func:`sharded` of the method ``from_config(config)``); the
  state from ``sj.collectives.init_rows(sj.methods.from_config(config), P, n)``."""
  return sharded(from_config(config), mesh, axis_name, nonfinite=nonfinite)
