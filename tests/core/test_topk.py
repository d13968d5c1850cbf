"""Exact block-wise top-k against a stable argsort, including ties and the two-stage path."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spardl_jax._src.core import topk
from tests import reference


METHODS = list(topk.METHODS)  # the CPU's default, the GPU's and top_k's (forced on the CPU)


# (300000, 3000): both stages see over 2**14 keys, the grouped compaction's path.
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("m,kb", [(1, 1), (7, 7), (100, 1), (1000, 10), (4096, 41), (5000, 3),
                                  (300_000, 3000)])
def test_block_topk_matches_stable_argsort(m, kb, method):
  rng = np.random.default_rng(m + kb)
  c = topk.chunk_size(m, kb, method=method)  # the stages each method really runs
  mc = -(-m // c) * c
  q = 3
  buf = np.zeros((q, mc), np.float32)
  buf[:, :m] = rng.standard_normal((q, m)).astype(np.float32)
  buf[1, :m] = np.round(buf[1, :m])          # many ties
  buf[2, :m] = 0                             # all zero
  offsets, values = jax.jit(functools.partial(topk.block_topk, method=method),
                            static_argnums=(2, 3))(jnp.asarray(buf),
                                                   jnp.arange(q, dtype=jnp.int32), kb, c)
  for r in range(q):
    want = reference.topk_offsets(buf[r, :m], kb)
    np.testing.assert_array_equal(np.asarray(offsets[r]), want)
    np.testing.assert_array_equal(np.asarray(values[r]), buf[r, want])


def test_chunk_size_prefers_divisors_and_one_stage_for_dense():
  assert topk.chunk_size(1_837_500, 18_375, method="count") == 10
  assert topk.chunk_size(1000, 500, method="count") == 1
  assert topk.chunk_size(1237, 13, method="count") >= 4   # prime m: padded chunks
  # lax.top_k's cost grows with k: keeping 1 % or more, the GPU's method takes one stage.
  assert topk.chunk_size(1_837_500, 18_375, method="sort") == 1
  assert topk.chunk_size(1_837_500, 1_838, method="sort") == 30  # 0.1 %: two stages


@functools.partial(jax.jit, static_argnums=(1, 2))
def _select(rows, k, method):
  return topk.select(topk.keys(rows), k, method=method)


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 300), st.data())
def test_select_property(n, data):
  """Random lengths, k and method; 16 rows per draw (one compilation), each with 2, 5 or
  1000 value levels (few levels: heavy ties), against the stable argsort."""
  k = data.draw(st.integers(1, n))
  method = data.draw(st.sampled_from(METHODS))
  rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
  levels = np.array([2, 5, 1000])[rng.integers(0, 3, 16)][:, None]
  rows = (rng.integers(-levels, levels, (16, n)) / 3).astype(np.float32)
  got = np.asarray(_select(jnp.asarray(rows), k, method))
  for row, positions in zip(rows, got):
    np.testing.assert_array_equal(positions, reference.topk_offsets(row, k))


@pytest.mark.parametrize("backend,method,short", [("cpu", "count", "sort"),
                                                  ("gpu", "radix", "radix"),
                                                  ("tpu", "count", "sort")])
def test_the_gpu_counts_by_radix_and_other_backends_by_bisection(monkeypatch, backend, method,
                                                                 short):
  """Rows of at most 4,096 keys off the GPU take lax.top_k (25 operations to compile
  against about 400, as fast there); longer rows the backend's own."""
  monkeypatch.setattr(jax, "default_backend", lambda: backend)
  assert topk.default_method() == method
  assert topk.default_method(4097) == method
  assert topk.default_method(4096) == short


def test_the_default_selection_of_short_rows_is_the_reference():
  """What the default picks by row length gives the reference's positions either side of
  the bound (ties included)."""
  rng = np.random.default_rng(3)
  for n in (topk.SORTED_UPTO, topk.SORTED_UPTO + 1):
    rows = (rng.integers(-4, 4, (3, n)) / 3).astype(np.float32)
    got = np.asarray(topk.select(topk.keys(jnp.asarray(rows)), 41))
    for row, positions in zip(rows, got):
      np.testing.assert_array_equal(positions, reference.topk_offsets(row, 41))


def test_keys_order_like_magnitudes():
  v = jnp.array([0.0, -0.0, 1.0, -2.0, jnp.inf, 1e-30], jnp.float32)
  k = np.asarray(topk.keys(v))
  assert k[0] == k[1] and k[5] > k[0] and k[3] > k[2] and k[4] > k[3]


@pytest.mark.parametrize("method", METHODS)
def test_nan_inf_and_signed_zeros_rank_by_their_key_bits(method):
  """NaN above inf above every finite value, -0.0 tied with 0.0 (their |value| bits), ties to
  the lower index: against NumPy's stable argsort of the bits, and lax.top_k's set."""
  rng = np.random.default_rng(7)
  rows = np.round(rng.standard_normal((6, 257)) * 2).astype(np.float32)  # many ties
  rows[0, [3, 50, 200]] = np.nan
  rows[1, [0, 9]] = [np.inf, -np.inf]
  rows[2, :] = 0.0
  rows[2, ::3] = -0.0
  rows[3, [5, 6]] = [np.nan, np.inf]
  rows[4, :] = np.float32(3.0e38) * np.sign(rows[4])  # float32's largest magnitudes
  rows[5, 100:] = np.nan
  bits = np.abs(rows).view(np.int32)
  for k in (1, 3, 40, 257):
    got = np.asarray(_select(jnp.asarray(rows), k, method))
    keys = topk.keys(jnp.asarray(rows))
    top_k = np.sort(np.asarray(jax.lax.top_k(
        jax.lax.bitcast_convert_type(keys, jnp.float32), k)[1]), axis=-1)
    for r in range(rows.shape[0]):
      want = np.sort(np.argsort(-bits[r], kind="stable")[:k])
      np.testing.assert_array_equal(got[r], want)
      np.testing.assert_array_equal(got[r], top_k[r])


@pytest.mark.parametrize("method", METHODS)
def test_kth_largest_is_the_kth_key(method):
  rng = np.random.default_rng(3)
  keys = np.abs(rng.standard_normal((5, 1000)).astype(np.float32)).view(np.int32)
  keys[1] = np.abs(np.round(rng.standard_normal(1000))).astype(np.float32).view(np.int32)
  keys[2] = 0
  for k in (1, 17, 1000):
    got = np.asarray(jax.jit(functools.partial(topk.kth_largest, method=method),
                             static_argnums=1)(jnp.asarray(keys), k))
    np.testing.assert_array_equal(got, -np.sort(-keys, axis=1)[:, k - 1])


@pytest.mark.parametrize("method", METHODS)
def test_kth_largest_in_chunks_is_the_kth_key(method):
  """Two stages give NumPy's k-th largest key: rows of distinct keys, of few values (ties
  across chunks), of zeros, with fewer non-zeros than k, a length no chunk divides, and k
  above the number of chunks."""
  rng = np.random.default_rng(4)
  n = 10_007
  keys = np.abs(rng.standard_normal((5, n)).astype(np.float32)).view(np.int32)
  keys[1] = np.abs(np.round(rng.standard_normal(n))).astype(np.float32).view(np.int32)
  keys[2] = 0
  keys[3] = 0
  keys[3, rng.choice(n, 20, replace=False)] = rng.integers(1, 1 << 30, 20)
  for k in (1, 17, 100, 3_000, n):
    got = np.asarray(jax.jit(functools.partial(topk.kth_largest_in_chunks, method=method),
                             static_argnums=1)(jnp.asarray(keys), k))
    np.testing.assert_array_equal(got, -np.sort(-keys, axis=1)[:, k - 1], err_msg=f"k={k}")


@pytest.mark.parametrize("method,teams", [("count", 1), ("radix", 1), ("radix", 2)])
def test_the_compiled_sync_sorts_nothing(monkeypatch, method, teams):
  """With the CPU's selection of long rows (count) and the GPU's (radix), forced here for
  every row, SparDL's whole
  compiled sync, R-SAG across two teams included, holds no sort and no ``lax.top_k`` (XLA's
  TopK, which XLA:GPU turns into a sort of the whole row for a large ``k``): with
  ``method="sort"`` this check finds a TopK per selection. (B-SAG alone orders its ``kb``
  pairs by magnitude.)"""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from spardl_jax._src.sync import registry as methods
  from tests import harness

  monkeypatch.setattr(topk, "default_method", lambda keys_per_row=None: method)
  p, n = 4, 40_000
  spardl = methods.make("spardl", density=0.01, teams=teams, sag="recursive")
  sharding = NamedSharding(harness.mesh(p), P(harness.AXIS))
  text = methods.sharded(spardl, harness.mesh(p), harness.AXIS).lower(
      jax.ShapeDtypeStruct((p, n), jnp.float32, sharding=sharding),
      methods.abstract_rows(spardl, p, n, sharding)).compile().as_text()
  assert " sort(" not in text and 'custom_call_target="TopK"' not in text
