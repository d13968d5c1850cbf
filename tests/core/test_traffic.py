"""Traffic measured from the compiled HLO against the DESIGN.md cost formula."""

import jax.numpy as jnp
import pytest

import spardl_jax as sj
from spardl_jax import traffic
from tests import harness


@pytest.mark.parametrize("p", [2, 3, 5, 6, 7, 8, 12, 16])
@pytest.mark.parametrize("density", [0.01, 0.3])
def test_hlo_bytes_and_rounds_match_formula(p, density):
  n = 20_011
  config = sj.SparDLConfig(density=density)
  t = traffic.parse_hlo(harness.hlo_text(p, n, config))
  kb = sj.BlockLayout.make(n, p, density).kb
  want = traffic.spardl_formula(p, kb)
  assert t.rounds == want["rounds"] == 2 * (p - 1).bit_length()
  for device in range(p):
    assert t.bytes_sent(device) == want["bytes"]
    assert t.bytes_received(device) == want["bytes"]
    assert t.elements_sent(device) == want["elements"] == 4 * kb * (p - 1)
  # No dense collective of any size hides in the program (the only collectives are permutes).
  assert t.others == ()


def test_bf16_values_halve_the_value_bytes():
  p, n = 4, 10_000
  config = sj.SparDLConfig(density=0.01)
  t = traffic.parse_hlo(harness.hlo_text(p, n, config, dtype=jnp.bfloat16))
  kb = sj.BlockLayout.make(n, p, 0.01).kb
  assert t.bytes_sent(0) == traffic.spardl_formula(p, kb, value_bytes=2)["bytes"]


def test_parse_hlo_reads_async_permutes_and_dense_collectives():
  text = """HloModule m
ENTRY %main (p0: f32[8,4]) -> f32[8,4] {
  %p0 = f32[8,4]{1,0} parameter(0)
  %cp = (f32[8,4]{1,0}, f32[8,4]{1,0}, u32[], u32[]) collective-permute-start(%p0), channel_id=1, source_target_pairs={{0,1},{1,0}}
  %done = f32[8,4]{1,0} collective-permute-done(%cp)
  ROOT %ar = f32[8,4]{1,0} all-reduce(%done), replica_groups={{0,1}}, to_apply=%add
}
"""
  t = traffic.parse_hlo(text)
  assert t.rounds == 1 and t.permutes[0].pairs == ((0, 1), (1, 0))
  assert t.bytes_sent(0) == 128 and t.bytes_sent(2) == 0
  assert [c.op for c in t.others] == ["all-reduce"] and t.largest_other() == 32
