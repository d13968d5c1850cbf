"""Bad input fails early with an error naming the parameter and the allowed values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import spardl_jax as sj
from spardl_jax.collectives import SparDLConfig, SparDLState, spardl_allreduce
from tests import harness


@pytest.mark.parametrize("density", [0, -0.1, 1.5, float("nan")])
def test_density_out_of_range(density):
  with pytest.raises(ValueError, match=r"density must be in \(0, 1\]"):
    SparDLConfig(density=density)


def test_numpy_scalars_are_numbers():
  """NumPy scalars are accepted wherever a Python number is, at their decimal value."""
  config = SparDLConfig(density=np.float32(0.1), teams=np.int64(2))
  assert config.density == 0.1 and config.teams == 2 and type(config.teams) is int
  okt = sj.methods.make("oktopk", density=np.float64(0.05), tau=np.int32(4),
                        capacity=np.float32(1.5)).config
  assert (okt.density, okt.tau, okt.capacity) == (0.05, 4, 1.5)
  with pytest.raises(TypeError, match="density must be a float"):
    SparDLConfig(density=np.bool_(True))


def test_density_wrong_type_and_teams():
  with pytest.raises(TypeError, match="density"):
    SparDLConfig(density="0.1")
  with pytest.raises(ValueError, match="teams must be a positive int"):
    SparDLConfig(density=0.1, teams=0)


def test_initial_state_checks():
  with pytest.raises(ValueError, match="n must be a positive int"):
    SparDLState.initial(0)
  with pytest.raises(TypeError, match="dtype must have one of the dtypes"):
    SparDLState.initial(10, jnp.int32)
  assert SparDLState.initial(10).residual.shape == (10,)


def call(p, x, state, config, axis_name=harness.AXIS):
  def step(x):
    return spardl_allreduce(x, state, config, axis_name=axis_name)[0][None]
  f = jax.shard_map(step, mesh=harness.mesh(p), in_specs=P(), out_specs=P(harness.AXIS))
  return jax.jit(f)(x)


CFG = SparDLConfig(density=0.1)


def test_non_float_x():
  x = jnp.arange(8, dtype=jnp.int32)
  with pytest.raises(TypeError, match=r"x must have one of the dtypes \('float32', 'bfloat16', "
                                      r"'float16'\), got int32"):
    call(2, x, SparDLState(jnp.zeros(8, jnp.int32), SparDLState.initial(8).controller), CFG)


def test_float64_rejected_with_the_reason():
  """Selection keys are float32 bits: float64 would select inexactly, so it is refused."""
  with pytest.raises(TypeError, match="float64 is rejected because selection keys are float32"):
    SparDLState.initial(8, jnp.float64)
  with jax.enable_x64(True):
    x = jnp.zeros(8, jnp.float64)
    state = SparDLState(jnp.zeros(8, jnp.float64), SparDLState.initial(8).controller)
    with pytest.raises(TypeError, match="spardl: x must have one of the dtypes"):
      call(2, x, state, CFG)


def test_state_without_controller_rejected():
  """States come from SparDLState.initial: one without its controller is refused, not restarted."""
  with pytest.raises(TypeError, match="missing 1 required positional argument: 'controller'"):
    SparDLState(jnp.zeros(8))
  with pytest.raises(TypeError, match="state must be a SparDLState from SparDLState.initial"
                                      ".*controller is NoneType"):
    call(2, jnp.zeros(8), SparDLState(jnp.zeros(8), None), CFG)


def test_x_not_flat():
  x = jnp.zeros((2, 4))
  with pytest.raises(ValueError, match=r"x must be the flat local gradient of shape \(n,\)"):
    call(2, x, SparDLState.initial(8), CFG)


def test_state_wrong_length_and_dtype():
  x = jnp.zeros(8)
  with pytest.raises(ValueError, match=r"state.residual has shape \(9,\)"):
    call(2, x, SparDLState.initial(9), CFG)
  with pytest.raises(TypeError, match="state.residual dtype"):
    call(2, x, SparDLState.initial(8, jnp.bfloat16), CFG)
  with pytest.raises(TypeError, match="state must be a SparDLState"):
    call(2, x, jnp.zeros(8), CFG)


def test_teams_not_dividing_p_and_bad_sag_options():
  x = jnp.zeros(8)
  with pytest.raises(ValueError, match=r"teams=4 does not divide the 6 workers.*\[1, 2, 3, 6\]"):
    call(6, x, SparDLState.initial(8), SparDLConfig(density=0.1, teams=4))
  with pytest.raises(ValueError, match="sag='recursive'.*power of two, got teams=3"):
    SparDLConfig(density=0.1, teams=3, sag="recursive")
  with pytest.raises(ValueError, match="sag must be one of"):
    SparDLConfig(density=0.1, teams=2, sag="ring")
  with pytest.raises(ValueError, match="teams must be a positive int.*or 'auto'"):
    SparDLConfig(density=0.1, teams="many")
  with pytest.raises(ValueError, match="beta must be positive"):
    SparDLConfig(density=0.1, teams="auto", beta=0)


def test_unknown_axis_name():
  with pytest.raises(ValueError, match=r"axis_name='model' is not a bound mesh axis.*\['data'\]"):
    call(2, jnp.zeros(8), SparDLState.initial(8), CFG, axis_name="model")


def test_outside_shard_map():
  f = jax.jit(lambda x: spardl_allreduce(x, SparDLState.initial(8), CFG, axis_name="data"))
  with pytest.raises(ValueError, match="must be called inside jax.shard_map"):
    f(jnp.zeros(8))
  with pytest.raises(ValueError, match="must be called inside jax.shard_map"):
    spardl_allreduce(jnp.zeros(8), SparDLState.initial(8), CFG, axis_name="data")


def test_config_type():
  with pytest.raises(TypeError, match="config must be a SparDLConfig"):
    call(2, jnp.zeros(8), SparDLState.initial(8), {"density": 0.1})
