"""What a sync refuses when it is traced, before any collective: a step whose batch axes
are not the sync's, and ``optax.apply_if_finite`` around it (a per-device decision before
the collectives, so a hang)."""

from __future__ import annotations

import functools
import inspect

import optax

from spardl_jax._src.sync.settings import SyncOptions

__all__ = ['check_batch_axes', 'refuse_apply_if_finite']


def check_batch_axes(options: SyncOptions, batch_axes) -> None:
  """The axes a step split its batch over (:func:`spardl_jax.data_parallel_step` says,
  through ``tx.update``'s extra argument ``batch_axes``) must be the axes the sync reduces
  over: a step split over a host's ``local_axis`` too, with a sync that does not reduce
  over it, would average each slice of the vector over part of the batch."""
  if batch_axes is None or tuple(batch_axes) == options.data_axes:
    return
  if len(batch_axes) > len(options.data_axes):
    raise ValueError(
        f"sync_gradients: update: the step splits the batch over {tuple(batch_axes)}, but "
        f"this sync reduces over {options.data_axes} only; build it with "
        f"local_axis={batch_axes[-1]!r}, or drop the step's local_axis.")
  raise ValueError(
      f"sync_gradients: update: this sync reduces over {options.data_axes} "
      f"(local_axis={options.local_axis!r}), but the step splits the batch over "
      f"{tuple(batch_axes)}; give the step local_axis={options.local_axis!r} too, or build "
      f"the sync with the step's axes.")


@functools.cache
def _apply_if_finite_code() -> frozenset:
  wrapped = optax.apply_if_finite(optax.identity(), 1)
  return frozenset({wrapped.init.__code__, wrapped.update.__code__})


def refuse_apply_if_finite() -> None:
  """Raises when ``optax.apply_if_finite`` is calling this sync's init or update.

  It decides on each device's own gradient, before the sync, whether to run it (a
  ``lax.cond``): a device with a NaN skips the collectives the others wait in (a hang, then
  an abort after 40 s on CPU). Nothing the sync is handed shows the wrapper: it receives
  only its own state and the gradients, the wrapper's state sits above it, a state can be
  built by ``tx.init`` under ``shard_map``, with ``axis_size`` or with ``init_opt_state``,
  and JAX has no public way to ask whether a trace is inside a ``cond`` branch. So the
  check looks for the wrapper's own functions among the callers: one walk of the Python
  stack at trace time, nothing in the compiled step.
  """
  codes = _apply_if_finite_code()
  frame = inspect.currentframe()
  while frame is not None:
    if frame.f_code in codes:
      raise ValueError(
          "sync_gradients: optax.apply_if_finite wraps a gradient sync. It decides on each "
          "device's own gradient before the sync runs, so a device with a NaN would skip "
          "the collectives the others wait in (a hang). The sync agrees on every device "
          "itself: use nonfinite='skip' (the default), which zeroes that step's update "
          "everywhere and keeps the residuals; wrap only optimizers that come after the "
          "sync.")
    frame = frame.f_back
