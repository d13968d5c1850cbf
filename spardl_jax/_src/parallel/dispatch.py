"""A bound on how far a training loop dispatches ahead, for several CPU devices in one process.

XLA:CPU runs a program that spans the ``P`` devices of one process by launching one task per
device on a pool of ``max(cores, P)`` threads: on a 2-core machine with 8 simulated devices,
exactly one collective's worth. Each launch first takes a slot of its device's in-flight
limit (32 programs per device); when a loop dispatches steps without waiting, a launch of a
later step can find its device's 32 slots taken and block its pool thread. Then an earlier
step's collective is left with fewer than ``P`` threads: ``P - 1`` devices wait in its
rendezvous for a device whose launch never gets a thread, and after 40 s XLA aborts the
process (``rendezvous.cc ... only 7 of them arrived``, exit 134). It happens at random,
more often the more collectives a step holds (SparDL's step has ``2 log2 P`` rounds).

Keeping at most a few steps in flight keeps every launch clear of the in-flight limit, so
the pool always has a thread for each device of the oldest step: :func:`bounded_dispatch`
waits for the result of the step ``depth`` calls back before returning. Waiting for every
step is safe too; ``docs/reliability.md`` has the measurements of both.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Any

import jax

from spardl_jax._src.core.config import check_number

__all__ = ['DEPTH', 'bounded_dispatch']

DEPTH = 4  # steps in flight: with up to 7 device programs a step, still under the 32 slots


def _several_cpu_devices(out) -> bool:
  """Whether ``out`` lives on more than one CPU device of this process (the hazard)."""
  for leaf in jax.tree.leaves(out):
    if isinstance(leaf, jax.Array):
      local = [d for d in leaf.sharding.device_set if d in set(jax.local_devices())]
      return len(local) > 1 and all(d in set(jax.local_devices(backend="cpu")) for d in local)
  return False


def _arrays(tree) -> list:
  return [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]


def bounded_dispatch(step: Callable[..., Any], *, depth: int = DEPTH) -> Callable[..., Any]:
  """``step`` (a jitted train step), waiting before it returns for the result of the call
  ``depth`` calls back when its outputs span several CPU devices of this process.

  Use it around a train step that runs collectives over simulated CPU devices (tests, CPU
  runs of a multi-device program) when the loop does not wait for each step: XLA:CPU can
  otherwise deadlock and abort the process (see the module docstring). On GPUs, TPUs and
  one device per process it returns the outputs untouched and waits for nothing. A step
  that returns nothing (a Flax NNX step that updates its model and optimizer in place) is
  guarded by the arrays its arguments hold after the call; one with neither is refused.

  Example (a step whose collective spans 8 simulated CPU devices):

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8],
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> step = jax.jit(jax.shard_map(lambda x: jax.lax.pmean(x, "data") + 1, mesh=mesh,
    ...                              in_specs=P("data"), out_specs=P("data")))
    >>> step = bounded_dispatch(step)
    >>> x = jnp.zeros((8, 4))
    >>> for _ in range(100):  # never waits itself: at most 4 steps in flight
    ...   x = step(x)
    >>> float(x[0, 0])
    100.0

  Args:
    step: the function to call; its outputs are any pytree holding a ``jax.Array``.
    depth: how many calls may be in flight (an int >= 1).

  Returns:
    A function with ``step``'s signature and outputs.
  """
  depth = check_number("bounded_dispatch", "depth", depth, "an int >= 1", integral=True,
                       accept=lambda d: d >= 1)
  in_flight: collections.deque = collections.deque()
  hazard: list[bool] = []  # decided at the first call, from where its outputs live

  @functools.wraps(step)
  def bounded(*args, **kwargs):
    given = {id(x) for x in _arrays((args, kwargs))}
    out = step(*args, **kwargs)
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(out)):
      return out  # traced inside a jit of the caller's: its dispatch is the caller's
    # What the step made: its outputs, or, for a step that returns nothing and updates the
    # objects it was given (a Flax NNX train step), the new arrays those hold now.
    made = _arrays(out) or [x for x in _arrays((args, kwargs)) if id(x) not in given]
    if not hazard:
      if not made:
        raise ValueError(
            f"bounded_dispatch: {getattr(step, '__name__', 'the step')} returned no array "
            f"and its arguments hold none, so there is nothing to wait for; return "
            f"something the step computes (its loss, say).")
      hazard.append(_several_cpu_devices(made))
    if hazard[0]:  # the smallest: all of a program's outputs are ready together
      in_flight.append(min(made, key=lambda x: x.size))
      while len(in_flight) > depth:
        jax.block_until_ready(in_flight.popleft())
    return out

  return bounded
