"""Gradient all-reduce methods behind one interface, selectable by name.

Every method runs inside ``jax.shard_map`` on a flat local gradient and returns the mean over
the axis, bit-identical on every device, plus its new per-device state. The optax
transformation (:mod:`spardl_jax.transform`), the trainer and the benchmark pick a method by
name, so a new algorithm plugs in here once.

=========  ==========================================================  =====================
name       algorithm                                                   options
=========  ==========================================================  =====================
dense      ``pmean`` (ring all-reduce)                                 none
spardl     SparDL (SRS + SAG + Bruck + GRES)                           :class:`SparDLConfig`
topka      all-gather of local top-k                                   ``density``
topkdsa    SparCML split-reduce-gather, dense switch                   ``density, capacity``
gtopk      tree merge of top-k + broadcast                             ``density``
oktopk     Ok-Topk: thresholds, balanced regions                       ``density, capacity,
                                                                       tau, tau_regions``
=========  ==========================================================  =====================
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from spardl_jax import cost, gtopk, oktopk, topka, topkdsa
from spardl_jax.allreduce import init_state, resolve_teams, spardl_allreduce
from spardl_jax.config import SparDLConfig


class AllReduce(NamedTuple):
  """A gradient all-reduce usable by the optax transformation and the benchmark.

  Attributes:
    name: the method's registry name.
    config: its options (a frozen dataclass), or None.
    init: ``(n, dtype, p) -> state``, the per-device state for a flat gradient of length
      ``n`` on ``p`` devices (a pytree of arrays; ``()`` when the method keeps none).
    apply: ``(x, state, axis_name) -> (mean, state)`` inside ``shard_map``; ``x`` is the
      ``(n,)`` local gradient.
    stats: ``(n, p, itemsize, state, rank) -> (bytes_sent, h)`` after an all-reduce that
      left ``state``: the bytes device ``rank`` sent (the formula the HLO traffic tests
      check; a capacity bound for threshold methods) and SparDL's cross-team pairs per
      block (0 for other methods).
    formula: ``(p, n, itemsize) -> {'rounds', 'bytes', ...}`` per-worker cost, ``bytes``
      the most any worker sends.
  """

  name: str
  config: Any
  init: Callable[[int, Any, int], Any]
  apply: Callable[[jax.Array, Any, str], tuple[jax.Array, Any]]
  stats: Callable[[int, int, int, Any, Any], tuple[Any, Any]]
  formula: Callable[[int, int, int], dict]


def dense() -> AllReduce:
  """Dense ``pmean``, the reference every sparse method is measured against.

  Its traffic is counted as a ring all-reduce, ``2 (P - 1) / P * n`` elements per device, in
  ``2 (P - 1)`` rounds.
  """
  def formula(p, n, itemsize):
    return {"rounds": 2 * (p - 1), "bytes": 2 * (p - 1) * n * itemsize // p}

  return AllReduce(
      name="dense", config=None, init=lambda n, dtype, p: (),
      apply=lambda x, state, axis_name: (jax.lax.pmean(x, axis_name), state),
      stats=lambda n, p, itemsize, state, rank: (formula(p, n, itemsize)["bytes"], 0),
      formula=formula)


def spardl(config: SparDLConfig) -> AllReduce:
  """SparDL (:func:`spardl_jax.spardl_allreduce`) with the given configuration."""

  def formula(p, n, itemsize, h=None):
    teams, _ = resolve_teams(config, p, n, itemsize)
    return cost.spardl_cost(p, n, config.density, teams, itemsize=itemsize, sag=config.sag,
                            h=h)

  def stats(n, p, itemsize, state, rank):
    h = state.controller.last_h
    return formula(p, n, itemsize, h)["bytes"], h

  return AllReduce(
      name="spardl", config=config, init=lambda n, dtype, p: init_state(n, config, dtype),
      apply=lambda x, state, axis_name: spardl_allreduce(x, state, config,
                                                         axis_name=axis_name),
      stats=stats, formula=formula)


def _baseline(name: str, module, config) -> AllReduce:
  """The baseline of ``module`` (``init_state``, ``<name>_allreduce`` and ``formula``)."""
  allreduce = getattr(module, f"{name}_allreduce")

  def formula(p, n, itemsize):
    return module.formula(p, n, config, itemsize)

  def stats(n, p, itemsize, state, rank):
    traffic = formula(p, n, itemsize)
    if "bytes_per_device" in traffic:
      return jnp.asarray(traffic["bytes_per_device"])[rank], 0
    return traffic["bytes"], 0

  return AllReduce(name=name, config=config,
                   init=lambda n, dtype, p: module.init_state(n, p, config, dtype),
                   apply=lambda x, state, axis_name: allreduce(x, state, config,
                                                               axis_name=axis_name),
                   stats=stats, formula=formula)


Method = Literal["dense", "spardl", "topka", "topkdsa", "gtopk", "oktopk"]
METHODS: tuple[Method, ...] = ("dense", "spardl", "topka", "topkdsa", "gtopk", "oktopk")


def parse_teams(text: str):
  """A ``teams`` value from text: an int or ``'auto'``."""
  return text if text == "auto" else int(text)


_OPTION_TYPES = {"density": float, "teams": parse_teams, "sag": str, "residuals": str,
                 "capacity": float, "tau": int, "tau_regions": int}


def parse(text: str, *, density: float, teams=1, sag: str = "auto",
          residuals: str = "global") -> tuple[str, dict]:
  """``method[:key=value[:key=value...]]`` -> ``(method, options)`` for :func:`make`.

  Options not given in ``text`` are the defaults passed here: ``density`` for every sparse
  method, ``teams``, ``sag`` and ``residuals`` for SparDL. Baselines take their own keys
  (``capacity``, ``tau``, ``tau_regions``), e.g. ``'oktopk:tau=16'``.
  """
  method, *pairs = text.split(":")
  options = {}
  if method == "spardl":
    options = {"density": density, "teams": teams, "sag": sag, "residuals": residuals}
  elif method != "dense":  # the baselines
    options = {"density": density}
  for pair in pairs:
    key, sep, value = pair.partition("=")
    if not sep or key not in _OPTION_TYPES:
      raise ValueError(f"method spec {text!r}: {pair!r} is not key=value with key one of "
                       f"{sorted(_OPTION_TYPES)}.")
    options[key] = _OPTION_TYPES[key](value)
  return method, options


def make(method: str, **options) -> AllReduce:
  """The all-reduce called ``method``, built from its options.

  Args:
    method: one of :data:`METHODS`.
    **options: the method's options (see the table in the module docstring).

  Raises:
    ValueError: for an unknown method; TypeError for an option it does not take.
  """
  if method == "dense":
    if options:
      raise ValueError(f"method 'dense' takes no options, got {sorted(options)}.")
    return dense()
  if method == "spardl":
    return spardl(SparDLConfig(**options))
  baselines = {"topka": (topka, topka.TopkAConfig), "topkdsa": (topkdsa, topkdsa.TopkDSAConfig),
               "gtopk": (gtopk, gtopk.GTopkConfig), "oktopk": (oktopk, oktopk.OkTopkConfig)}
  if method in baselines:
    module, config_class = baselines[method]
    return _baseline(method, module, config_class(**options))
  raise ValueError(f"method must be one of {METHODS}, got {method!r}.")


def init_rows(method: AllReduce, p: int, n: int, dtype=jnp.float32):
  """``method``'s initial state for ``p`` devices: every leaf gets a leading ``(p,)`` axis."""
  return jax.tree.map(lambda a: jnp.broadcast_to(a, (p, *a.shape)), method.init(n, dtype, p))


def abstract_rows(method: AllReduce, p: int, n: int, sharding, dtype=jnp.float32):
  """:func:`init_rows` as ``jax.ShapeDtypeStruct`` leaves placed with ``sharding``: what
  ``sharded(method, ...).lower`` needs for the state, without allocating it."""
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                      jax.eval_shape(functools.partial(init_rows, method, p, n, dtype)))


def sharded(method: AllReduce, mesh: jax.sharding.Mesh, axis_name: str = "data"):
  """``method`` over arrays that hold one row per device, jitted.

  Per-device state lives in arrays with a leading device axis sharded over ``axis_name``
  (the residual is ``(P, n)``; each device sees its ``(1, n)`` row), the layout optimizer
  state uses in data-parallel JAX.

  Returns:
    ``f(grads, state) -> (ys, state)``: ``grads`` ``(P, n)`` (row ``w`` is device ``w``'s
    gradient) and ``state`` from :func:`init_rows`, both sharded ``PartitionSpec(axis_name)``;
    every row of ``ys`` is the same mean.
  """
  rows = PartitionSpec(axis_name)

  def step(grad, state):
    y, state = method.apply(grad[0], jax.tree.map(lambda a: a[0], state), axis_name)
    return y[None], jax.tree.map(lambda a: a[None], state)

  return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(rows, rows), out_specs=(rows, rows)))


def sharded_allreduce(config: SparDLConfig, mesh: jax.sharding.Mesh, axis_name: str = "data"):
  """:func:`sharded` for SparDL with ``config``; state from ``init_rows(spardl(config), ...)``."""
  return sharded(spardl(config), mesh, axis_name)
