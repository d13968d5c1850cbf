"""Data-parallel Flax trainer for spardl_jax (``python -m train``)."""
