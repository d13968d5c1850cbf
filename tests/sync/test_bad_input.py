"""Bad input to the public functions: one row per mistake, each refused before any work with
one line naming the parameter and what it allows (docs/reliability.md lists every row)."""

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import spardl_jax as sj
from spardl_jax.collectives import SparDLConfig, SparDLState, sharded_allreduce, spardl_allreduce
from tests import harness

PARAMS = {"w": jnp.zeros((10,))}
CFG = SparDLConfig(density=0.5)


REPLICATED = P()


def in_shard_map(fn, *args, specs=REPLICATED):
  """Traces ``fn(*args)`` inside shard_map over 2 devices (tracing is where it fails)."""
  return jax.eval_shape(jax.shard_map(fn, mesh=harness.mesh(2), in_specs=specs,
                                      out_specs=REPLICATED, check_vma=False), *args)


def update_with(tx, grads, state, state_specs):
  return in_shard_map(lambda g, s: tx.update(g, s)[0], grads, state,
                      specs=(P(), state_specs))


def allreduce_nonfinite():
  state = SparDLState.initial(8)
  in_shard_map(lambda x: spardl_allreduce(x, state, CFG, axis_name=harness.AXIS,
                                             nonfinite="ignore")[0], jnp.zeros(8))


def update_unbound_axis():
  state = sj.init_opt_state(sj.spardl(density=0.5), PARAMS, harness.mesh(2))
  specs = sj.opt_state_specs(sj.spardl(density=0.5), PARAMS, harness.mesh(2))
  update_with(sj.spardl(density=0.5, axis_name="batch"), PARAMS, state, specs)


def dense_state_to_spardl():
  dense = sj.sync_gradients("dense")
  update_with(sj.spardl(density=0.5), PARAMS, sj.init_opt_state(dense, PARAMS, harness.mesh(2)),
              sj.opt_state_specs(dense, PARAMS, harness.mesh(2)))


def other_structure_same_size():
  tx = sj.spardl(density=0.5)
  initialized = {"x": jnp.zeros(20), "y": jnp.zeros(30)}
  grads = {"a": jnp.zeros(30), "b": jnp.zeros(20)}
  update_with(tx, grads, sj.init_opt_state(tx, initialized, harness.mesh(2)),
              sj.opt_state_specs(tx, initialized, harness.mesh(2)))


def other_structure_another_transformation():
  """The state of one instance fed to another of the same options: the state, not the
  instance, says which leaves it was built for."""
  initialized = {"x": jnp.zeros(20), "y": jnp.zeros(30)}
  built_by = sj.spardl(density=0.5)
  update_with(sj.spardl(density=0.5), {"a": jnp.zeros(30), "b": jnp.zeros(20)},
              sj.init_opt_state(built_by, initialized, harness.mesh(2)),
              sj.opt_state_specs(built_by, initialized, harness.mesh(2)))


def wrapped():
  return optax.apply_if_finite(optax.chain(sj.spardl(density=0.5), optax.sgd(0.1)), 3)


def apply_if_finite_update():
  """A state built without the wrapper, then updated through it."""
  inner = optax.chain(sj.spardl(density=0.5), optax.sgd(0.1))
  state = optax.ApplyIfFiniteState(jnp.zeros((), jnp.int32), jnp.array(True),
                                   jnp.zeros((), jnp.int32),
                                   sj.init_opt_state(inner, PARAMS, harness.mesh(2)))
  specs = optax.ApplyIfFiniteState(P(), P(), P(), sj.opt_state_specs(inner, PARAMS,
                                                                    harness.mesh(2)))
  update_with(wrapped(), PARAMS, state, specs)


ROWS = [
    ("SparDLConfig density 0", lambda: SparDLConfig(density=0),
     r"SparDLConfig: density must be in \(0, 1\]"),
    ("spardl_allreduce nonfinite", allreduce_nonfinite,
     r"spardl_allreduce: nonfinite must be one of \('skip', 'propagate'\)"),
    ("sharded_allreduce axis not in the mesh",
     lambda: sharded_allreduce(CFG, harness.mesh(2), "model"),
     r"axis_name='model' is not an axis of the mesh; its axes are \('data',\)"),
    ("sharded nonfinite",
     lambda: sj.collectives.sharded(sj.methods.make("dense"), harness.mesh(2), nonfinite="nan"),
     r"sharded: nonfinite must be one of"),
    ("sync_gradients nonfinite", lambda: sj.sync_gradients("dense", nonfinite="ignore"),
     r"sync_gradients: nonfinite must be one of"),
    ("tx.update with an unbound axis_name", update_unbound_axis,
     r"axis_name='batch' is not a bound mesh axis; the bound axes here are \['data'\]"),
    ("a dense method's state fed to SparDL", dense_state_to_spardl,
     r"the state does not fit 'spardl' for 10 float entries"),
    ("gradients of another structure, same size", other_structure_same_size,
     r"float leaves have the shapes \(\(30,\), \(20,\)\), but the state was built for "
     r"\(\(20,\), \(30,\)\)"),
    ("another transformation's state, other structure", other_structure_another_transformation,
     r"float leaves have the shapes \(\(30,\), \(20,\)\), but the state was built for "
     r"\(\(20,\), \(30,\)\)"),
    ("apply_if_finite: init_opt_state",
     lambda: sj.init_opt_state(wrapped(), PARAMS, harness.mesh(2)),
     "apply_if_finite wraps a gradient sync"),
    ("apply_if_finite: tx.init inside shard_map",
     lambda: in_shard_map(wrapped().init, PARAMS), "apply_if_finite wraps a gradient sync"),
    ("apply_if_finite: tx.init with axis_size",
     lambda: optax.apply_if_finite(sj.spardl(density=0.5, axis_size=2), 3).init(PARAMS),
     "apply_if_finite wraps a gradient sync"),
    ("apply_if_finite: update", apply_if_finite_update, "apply_if_finite wraps a gradient sync"),
    *[(f"scale_by_frozen_adam eps={eps!r}",
       lambda eps=eps: sj.adam.scale_by_frozen_adam(freeze_step=3, eps=eps),
       "eps must be a finite number > 0") for eps in (float("nan"), 0, -1, "1e-8", float("inf"))],
    ("scale_by_frozen_adam b1=True", lambda: sj.adam.scale_by_frozen_adam(freeze_step=3, b1=True),
     r"b1 must be in \[0, 1\)"),
    ("density_warmup factor=inf",
     lambda: sj.density_warmup(0.01, steps=10, factor=float("inf")),
     "factor must be a finite number > 1"),
    ("density_warmup target=True", lambda: sj.density_warmup(True, steps=10),
     r"target must be in \(0, 1\]"),
    ("density text other than auto", lambda: sj.spardl(density="aut"),
     r"density must be a number, 'auto', a density_rule\(...\) or a non-empty list"),
    ("density_rule base=0", lambda: sj.density_rule(0), r"density_rule: base must be in \(0, 1\]"),
    ("density_rule at=1", lambda: sj.density_rule(at=1), "density_rule: at must be an int >= 2"),
    ("density_rule most below base", lambda: sj.density_rule(0.05, most=0.01),
     r"density_rule: most must be in \[base, 1\] \(base 0.05\)"),
    ("density auto on a method without a density", lambda: sj.powersgd(density="auto"),
     "method 'powersgd' has no option density"),
    ("density auto built without the devices", lambda: sj.methods.make("spardl", density="auto"),
     r"method 'spardl': density='auto' is picked from the number of devices; give p="),
    ("PowerSGD seed beyond 64 bits", lambda: sj.methods.make("powersgd", seed=2 ** 70),
     r"seed must be an int in \[-2\*\*63, 2\*\*63\)"),
    ("MultiSteps with a per-device skip around the sync",
     lambda: sj.init_opt_state(optax.MultiSteps(
         optax.chain(sj.spardl(density=0.5), optax.sgd(0.1)), 2,
         should_skip_update_fn=optax.skip_not_finite), PARAMS, harness.mesh(2)),
     "MultiSteps around a gradient sync has a should_skip_update_fn"),
    ("an option no method or sync has", lambda: sj.spardl(foo=1),
     r"method 'spardl' has no option foo; its options are \['alpha', 'beta', 'density'"),
    ("a method spec key given twice",
     lambda: sj.options.parse("spardl:density=0.1:density=0.2", density=0.01),
     "density given more than once"),
    ("a weight prediction's scale given as text",
     lambda: sj.weight_prediction(sj.spardl(delay=1), optax.sgd(0.1), scale="0.5"),
     r"weight_prediction: scale must be in \[0, 1\], got '0.5'"),
    ("a weight prediction's scale of None",
     lambda: sj.weight_prediction(sj.spardl(delay=1), optax.sgd(0.1), scale=None),
     r"weight_prediction: scale must be in \[0, 1\], got None"),
    ("an integer leaf among data_parallel_step's parameters",
     lambda: sj.data_parallel_step(lambda p, x: jnp.sum(x * p["w"]), sj.spardl(),
                                   harness.mesh(2))(
         {"w": jnp.zeros(4), "steps": jnp.zeros((), jnp.int32)},
         sj.init_opt_state(sj.spardl(), {"w": jnp.zeros(4)}, harness.mesh(2)), jnp.ones((2, 4))),
     r"data_parallel_step: params\['steps'\] is int32; the step takes the gradient of every"),
    ("the retired clip_norm", lambda: sj.spardl(clip_norm=1.0),
     r"clip_norm is retired.*optax.clip_by_global_norm"),
]


@pytest.mark.parametrize("call,message", [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_bad_input_is_one_clear_line(call, message):
  with pytest.raises((ValueError, TypeError), match=message) as error:
    call()
  assert "\n" not in str(error.value)
