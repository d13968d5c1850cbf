"""The suite compiles with XLA:CPU's quick-to-build settings (tests/conftest.py); users run
XLA's defaults. A process with the defaults computes SparDL syncs of both wire formats: they
match the NumPy model, conserve mass, agree on every device, and equal the suite's own
programs bit for bit."""

import os
import subprocess
import sys

import numpy as np

from spardl_jax.collectives import SparDLConfig
from tests import harness, reference

P, N, DENSITY, SYNCS = 4, 5003, 0.05, 2
CONFIGS = {"exact": SparDLConfig(density=DENSITY, wire="exact"),
           "compact_teams": SparDLConfig(density=DENSITY, teams=2, sag="recursive",
                                             wire="compact")}
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

# Runs in a fresh process (XLA reads its flags once, at start-up); argv[1]: the .npz to write.
WORKER = f"""
import sys
sys.path.insert(0, {REPO!r})
import jax
jax.config.update("jax_num_cpu_devices", {P})
import numpy as np
from tests.core import test_default_codegen as case
np.savez(sys.argv[1], **case.syncs())
"""


def syncs() -> dict[str, np.ndarray]:
  """Every config's outputs over SYNCS syncs fed back: {name_what_sync: (P, N) array}."""
  rng = np.random.default_rng(0)
  xs = [harness.gradients(rng, P, N, heavy_tails=t == 1) for t in range(SYNCS)]
  out = {}
  for name, config in CONFIGS.items():
    state = harness.rows(P, N, config)
    for t, x in enumerate(xs):
      out[f"{name}_x_{t}"] = x
      out[f"{name}_r_{t}"] = np.asarray(state.residual)
      out[f"{name}_y_{t}"], state = harness.run_state(x, state, config)
      out[f"{name}_h_{t}"] = np.asarray(state.controller.last_h)
    out[f"{name}_r_{SYNCS}"] = np.asarray(state.residual)
  return out


def test_xla_defaults_give_the_models_answer_and_the_suites_bits(tmp_path):
  from tests import conftest  # already loaded by pytest; the worker must not run it
  flags = os.environ.get("XLA_FLAGS", "").split()
  env = dict(os.environ, XLA_FLAGS=" ".join(f for f in flags if f not in conftest.QUICK_BUILD))
  path = tmp_path / "defaults.npz"
  subprocess.run([sys.executable, "-c", WORKER, str(path)], env=env, check=True, timeout=300)
  defaults, ours = dict(np.load(path)), syncs()
  for name, config in CONFIGS.items():
    for t in range(SYNCS):
      x, rs, ys = (defaults[f"{name}_{what}_{t}"] for what in "xry")
      new_rs = defaults[f"{name}_r_{t + 1}"]
      h = int(defaults[f"{name}_h_{t}"][0])
      want_y, want_rs = reference.spardl(x, rs, DENSITY, teams=config.teams, h=h,
                                         wire=config.wire)
      np.testing.assert_array_equal(ys, np.broadcast_to(ys[0], ys.shape))
      np.testing.assert_allclose(ys[0], want_y, rtol=1e-6, atol=1e-7)
      np.testing.assert_allclose(new_rs, want_rs, rtol=1e-6, atol=1e-6)
      harness.assert_conserved(x, rs, ys, new_rs)
  assert ours.keys() == defaults.keys()
  for key, value in ours.items():
    np.testing.assert_array_equal(defaults[key], value, err_msg=key)
