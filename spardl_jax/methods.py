"""Gradient all-reduce methods behind one interface, selectable by name.

Every method runs inside ``jax.shard_map`` on a flat local gradient and returns the mean over
the axis, bit-identical on every device, plus its new per-device state. The optax
transformation (:mod:`spardl_jax.transform`), the trainer and the benchmark pick a method by
name, so a new algorithm plugs in here once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax

from spardl_jax import traffic
from spardl_jax.allreduce import init_state, spardl_allreduce
from spardl_jax.config import BlockLayout, SparDLConfig


class AllReduce(NamedTuple):
  """A gradient all-reduce usable by the optax transformation.

  Attributes:
    name: the method's registry name.
    init: ``(n, dtype) -> state``, the per-device state for a flat gradient of length ``n``
      (a pytree of arrays; ``()`` when the method keeps none).
    apply: ``(x, state, axis_name) -> (mean, state)`` inside ``shard_map``; ``x`` is the
      ``(n,)`` local gradient.
    bytes_sent: ``(n, p, itemsize) -> int``, bytes each device sends in one all-reduce (the
      formula the HLO traffic tests check).
  """

  name: str
  init: Callable[[int, Any], Any]
  apply: Callable[[jax.Array, Any, str], tuple[jax.Array, Any]]
  bytes_sent: Callable[[int, int, int], int]


def dense() -> AllReduce:
  """Dense ``pmean``, the reference every sparse method is measured against.

  Its traffic is counted as a ring all-reduce, ``2 (P - 1) / P * n`` elements per device.
  """
  return AllReduce(
      name="dense",
      init=lambda n, dtype: (),
      apply=lambda x, state, axis_name: (jax.lax.pmean(x, axis_name), state),
      bytes_sent=lambda n, p, itemsize: 2 * (p - 1) * n * itemsize // p)


def spardl(config: SparDLConfig) -> AllReduce:
  """SparDL (:func:`spardl_jax.spardl_allreduce`) with the given configuration."""

  def bytes_sent(n, p, itemsize):
    kb = BlockLayout.make(n, p // config.teams, config.density).kb
    return traffic.spardl_formula(p, kb, itemsize)["bytes"]

  return AllReduce(
      name="spardl",
      init=lambda n, dtype: init_state(n, config, dtype),
      apply=lambda x, state, axis_name: spardl_allreduce(x, state, config,
                                                         axis_name=axis_name),
      bytes_sent=bytes_sent)


Method = Literal["dense", "spardl"]
METHODS: tuple[Method, ...] = ("dense", "spardl")


def make(method: str, **options) -> AllReduce:
  """The all-reduce called ``method``, built from its options.

  Args:
    method: one of :data:`METHODS`.
    **options: the method's options: for ``'spardl'`` the fields of :class:`SparDLConfig`
      (``density``, ``teams``, ``residuals``); ``'dense'`` takes none.

  Raises:
    ValueError: for an unknown method or options it does not take.
  """
  if method == "dense":
    if options:
      raise ValueError(f"method 'dense' takes no options, got {sorted(options)}.")
    return dense()
  if method == "spardl":
    return spardl(SparDLConfig(**options))
  raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
