"""Test setup: 16 simulated CPU devices, and compiled programs freed after each module."""

import gc

import jax
import pytest

# Simulated CPU devices for every test; set once, before the backend starts (JAX_NOTES.md).
jax.config.update("jax_num_cpu_devices", 16)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
  """Drop each module's compiled programs when it ends. Every XLA:CPU executable keeps
  memory mappings; one process compiling the whole suite's ~1000 programs reached the
  kernel's vm.max_map_count (65530) and crashed inside the compiler."""
  yield
  from tests import harness
  harness.compiled.cache_clear()
  harness._executable.cache_clear()
  harness.compiled_method.cache_clear()
  jax.clear_caches()
  gc.collect()
