"""A Flax user's whole programs (``tests/flax_user/``), each run as the user would run it: a
fresh process, 8 simulated devices, every mesh axis type in turn (Explicit, JAX's default
here, and Auto). Each program checks its own answers (dense ``jax.jit`` training at
density 1, a falling loss, distinct dropout masks) and prints one line per axis type."""

import glob
import os
import subprocess
import sys

import pytest

from spardl_jax import launch

ROOT = os.path.join(os.path.dirname(__file__), "..")
PROGRAMS = sorted(glob.glob(os.path.join(ROOT, "tests", "flax_user", "*.py")))


def test_there_are_programs():
  assert len(PROGRAMS) >= 3


@pytest.mark.parametrize("path", PROGRAMS, ids=[os.path.basename(p) for p in PROGRAMS])
def test_program_runs_on_every_axis_type(path):
  env = launch.child_environment()  # this tree's spardl_jax, whatever is installed
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.abspath(ROOT),
                                                    env.get("PYTHONPATH")]))
  proc = subprocess.run([sys.executable, path], cwd=ROOT, capture_output=True, text=True,
                        timeout=300, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert any(line.startswith("Explicit") for line in proc.stdout.splitlines()), proc.stdout
  assert any(line.startswith("Auto") for line in proc.stdout.splitlines()), proc.stdout
