"""bounded_dispatch keeps a loop over simulated CPU devices from deadlocking XLA:CPU: at most
`depth` steps in flight, and a 400-step loop that never waits finishes."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spardl_jax as sj
from spardl_jax._src.parallel import dispatch, launch
from tests import harness

LOOP = os.path.join(os.path.dirname(__file__), "dispatch_loop.py")


def psum_step(p):
  mesh = harness.mesh(p)
  f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, harness.AXIS) * 0.5, mesh=mesh,
                            in_specs=P(harness.AXIS), out_specs=P(harness.AXIS)))
  return f, jax.device_put(jnp.ones((p, 64)), NamedSharding(mesh, P(harness.AXIS)))


@pytest.mark.parametrize("depth", [1, 3])
def test_at_most_depth_steps_are_in_flight(depth):
  f, x = psum_step(8)
  step = sj.bounded_dispatch(f, depth=depth)
  outs = []
  for _ in range(30):
    x = step(x)
    outs.append(x)
    assert sum(not out.is_ready() for out in outs) <= depth
  assert jax.block_until_ready(x).shape == (8, 64)


def test_a_step_that_returns_nothing_is_guarded_by_what_it_updates():
  """A step that updates the objects it is given and returns nothing (a Flax NNX train
  step): the new arrays they hold count as its outputs; a step with no array at all to wait
  for is refused at its first call."""
  f, x = psum_step(8)

  class Holder:  # a pytree of one array, replaced by each step, as an NNX module's are
    def __init__(self, value):
      self.value = value

  jax.tree_util.register_pytree_node(Holder, lambda h: ((h.value,), None),
                                     lambda _, children: Holder(children[0]))
  holder = Holder(x)

  def update(h):
    h.value = f(h.value)

  step = sj.bounded_dispatch(update, depth=2)
  made = []
  for _ in range(20):
    step(holder)
    made.append(holder.value)
    assert sum(not out.is_ready() for out in made) <= 2
  with pytest.raises(ValueError, match="returned no array and its arguments hold none"):
    sj.bounded_dispatch(lambda: None)()


def test_one_device_waits_for_nothing():
  f, x = psum_step(1)
  assert not dispatch._several_cpu_devices(f(x))
  assert dispatch._several_cpu_devices(psum_step(2)[0](psum_step(2)[1]))


def test_bad_depth_is_named():
  with pytest.raises(ValueError, match="depth must be an int >= 1, got 0"):
    sj.bounded_dispatch(lambda: None, depth=0)


def test_a_loop_that_never_waits_finishes():
  """Without the bound, this loop aborted XLA:CPU in 11 of 11 runs on 2 cores (collective
  rendezvous timeout, exit 134; docs/reliability.md); with it, it finishes."""
  proc = subprocess.run([sys.executable, LOOP, "bounded", "400"],
                        env=launch.child_environment(), capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0 and "finished 400" in proc.stdout, proc.stderr[-2000:]
