"""Exact block-wise top-k against a stable argsort, including ties and the two-stage path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spardl_jax import topk
from tests import reference


@pytest.mark.parametrize("m,kb", [(1, 1), (7, 7), (100, 1), (1000, 10), (4096, 41), (5000, 3)])
def test_block_topk_matches_stable_argsort(m, kb):
  rng = np.random.default_rng(m + kb)
  c = topk.chunk_size(m, kb)
  mc = -(-m // c) * c
  q = 3
  buf = np.zeros((q, mc), np.float32)
  buf[:, :m] = rng.standard_normal((q, m)).astype(np.float32)
  buf[1, :m] = np.round(buf[1, :m])          # many ties
  buf[2, :m] = 0                             # all zero
  offsets, values = jax.jit(topk.block_topk, static_argnums=(2, 3))(
      jnp.asarray(buf), jnp.arange(q, dtype=jnp.int32), kb, c)
  for r in range(q):
    want = reference.topk_offsets(buf[r, :m], kb)
    np.testing.assert_array_equal(np.asarray(offsets[r]), want)
    np.testing.assert_array_equal(np.asarray(values[r]), buf[r, want])


def test_chunk_size_prefers_divisors_and_one_stage_for_dense():
  assert topk.chunk_size(1_837_500, 18_375) == 10
  assert topk.chunk_size(1000, 500) == 1
  assert topk.chunk_size(1237, 13) >= 4   # prime m: padded chunks


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.data())
def test_select_property(n, data):
  k = data.draw(st.integers(1, n))
  levels = data.draw(st.sampled_from([2, 5, 1000]))  # few levels: heavy ties
  rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
  row = (rng.integers(-levels, levels, n) / 3).astype(np.float32)
  got = np.asarray(topk.select(topk.keys(jnp.asarray(row))[None], k))[0]
  np.testing.assert_array_equal(got, reference.topk_offsets(row, k))


def test_keys_order_like_magnitudes():
  v = jnp.array([0.0, -0.0, 1.0, -2.0, jnp.inf, 1e-30], jnp.float32)
  k = np.asarray(topk.keys(v))
  assert k[0] == k[1] and k[5] > k[0] and k[3] > k[2] and k[4] > k[3]
