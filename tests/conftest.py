"""Test setup: 16 simulated CPU devices, one compilation cache for the whole session, and
compiled programs freed after each module."""

import atexit
import gc
import os
import shutil
import subprocess
import sys
import tempfile

# One persistent compilation cache for the session, shared by the xdist workers and the
# processes the multi-process tests start (they inherit the environment): a program that
# several tests (or both ranks of a job) compile, taking over a second, is compiled once.
# Set before JAX starts.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="spardl-jax-tests-")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)

# Tiny test programs spend their time in the compiler, not in the code it makes: compile with
# LLVM's lowest optimization level (about 30 % less suite time) and XLA:CPU's classic loop
# emitter instead of its MLIR fusion emitters (eight SparDL programs: 9 s against 15 s).
# Every process of the session uses both (the launcher passes XLA flags on), so programs
# compared bit for bit are built alike; tests/core/test_default_codegen.py checks that XLA's
# defaults give the same bits. The benchmarks and training runs keep XLA's defaults.
QUICK_BUILD = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def _xla_accepts(flags):
  """XLA aborts the process on a flag it does not know (jaxlib 0.11 dropped the emitter
  flag), so each set is tried in a throwaway process first."""
  probe = [sys.executable, "-c", "import jax; jax.devices('cpu')"]
  env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
  return subprocess.run(probe, env=env, capture_output=True, timeout=120).returncode == 0


# Only the first process probes: pytest-xdist's workers inherit its flags and the mark.
if "SPARDL_JAX_TESTS_XLA_PROBED" not in os.environ:
  _missing = [f for f in QUICK_BUILD if f.split("=")[0] not in os.environ.get("XLA_FLAGS", "")]
  if _missing and not _xla_accepts(_missing):
    _missing = [f for f in _missing if _xla_accepts([f])]
  os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *_missing]).strip()
  os.environ["SPARDL_JAX_TESTS_XLA_PROBED"] = "1"

import jax  # noqa: E402
import pytest  # noqa: E402

# Simulated CPU devices for every test, set once before the backend starts: the CPU backend
# reads the count only when it starts. It is started here, so that code under test that asks
# for another count (the trainer's --devices, in process) cannot change it for later tests.
jax.config.update("jax_num_cpu_devices", 16)
jax.devices()


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
  """Drop each module's compiled programs when it ends. Every XLA:CPU executable keeps
  memory mappings; one process compiling the whole suite's ~1000 programs reached the
  kernel's vm.max_map_count (65530) and crashed inside the compiler."""
  yield
  from tests import harness
  harness.clear()
  jax.clear_caches()
  gc.collect()


# The longest tests start first, so that the two xdist workers end together instead of one
# waiting while the other runs a 30-second test last (longest-first scheduling). The files
# are the slowest of `pytest --durations=0` (docs/testing.md); the order of the rest is kept.
SLOW_FIRST = ("tests/parallel/test_multiprocess.py", "tests/benchmarks/test_pages.py",
              "tests/test_flax_user.py", "tests/test_readme.py",
              "tests/core/test_default_codegen.py", "tests/benchmarks/test_time_to_accuracy.py",
              "tests/parallel/test_dispatch.py", "tests/test_nnx_door.py",
              "tests/trainer/test_train.py", "tests/benchmarks/test_drivers.py",
              "tests/core/test_properties.py")


def pytest_collection_modifyitems(config, items):
  del config

  def rank(item):
    path = item.nodeid.split("::")[0]
    return SLOW_FIRST.index(path) if path in SLOW_FIRST else len(SLOW_FIRST)

  items.sort(key=rank)  # stable: each file keeps its order
