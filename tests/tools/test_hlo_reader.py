"""The HLO reader: collectives, their operands and device pairs, read from program text."""

from spardl_jax.tools import traffic


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
