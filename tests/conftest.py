"""Test setup: 16 simulated CPU devices, set once before JAX starts its backend."""

import jax

jax.config.update("jax_num_cpu_devices", 16)
