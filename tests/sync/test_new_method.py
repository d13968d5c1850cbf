"""Adding a method is one file (docs/new-method.md): the smallest possible method,
registered from this module, is usable by name in the optax sync, in a trainer spec and in
the benchmark, with nothing else changed."""

import dataclasses
from typing import ClassVar, Literal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spardl_jax as sj
from spardl_jax._src.core import protocol
from spardl_jax.tools import bench
from tests import harness


@dataclasses.dataclass(frozen=True, kw_only=True)
class HalfConfig:
  """The example's one option: the fraction of the mean it returns."""

  scale: float = 0.5


@dataclasses.dataclass(frozen=True)
class ScaledMean(sj.methods.FlatVector):
  """``scale`` times the mean over the axis: one XLA all-reduce, no state."""

  name: ClassVar[str] = "example_scaled_mean"
  summary: ClassVar[str] = "the contributing guide's example"
  Config: ClassVar[type] = HalfConfig
  nonfinite_reaches_result: ClassVar[bool] = True  # a sum with a NaN is not finite
  sparse: ClassVar[bool] = False
  config: HalfConfig

  def init(self, *, n, dtype, p):
    return ()

  def apply(self, x, state, *, axis_name):
    return self.config.scale * jax.lax.pmean(x, axis_name), state

  def formula(self, *, p, n, itemsize):
    return sj.methods.Cost(rounds=2 * (p - 1), bytes=2 * (p - 1) * n * itemsize // p)  # a ring

  def stats(self, *, n, p, itemsize, state, rank):
    return self.formula(p=p, n=n, itemsize=itemsize).bytes, 0


@pytest.fixture
def registered():
  """Registered for one test, then removed: other modules' parametrizations read the
  registry when they are collected."""
  sj.methods.register(ScaledMean)
  yield
  protocol._REGISTRY.pop(ScaledMean.name)


def test_usable_by_name_everywhere(registered, tmp_path):
  assert ScaledMean.name in sj.methods.names()
  # A spec, as the trainer's --compare and the benchmark parse it.
  assert sj.options.parse("example_scaled_mean:scale=0.25", density=0.01) == (
      "example_scaled_mean", {"scale": 0.25})
  from train.config import parse_variant
  variant = parse_variant("example_scaled_mean:scale=0.25:lr=0.1", density=0.01, teams=1,
                          sag="auto", residuals="global")
  assert (variant.options, variant.tuning.given()) == ({"scale": 0.25}, {"lr": 0.1})
  # The optax sync: a quarter of the mean gradient, on every device.
  p, params = 4, {"w": jnp.zeros((6,))}
  tx = sj.sync_gradients("example_scaled_mean", scale=0.25)
  grads = np.random.default_rng(0).standard_normal((p, 6)).astype(np.float32)
  updates, state = harness.update_fn(tx, p, params)(
      harness.put_rows(p, {"w": grads}), sj.init_opt_state(tx, params, harness.mesh(p)))
  np.testing.assert_allclose(np.asarray(updates["w"]), 0.25 * grads.mean(0), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(sj.sync_stats(state).bytes_sent),
                                [2 * 3 * 6 * 4 // 4] * p)
  # The benchmark: its HLO traffic against its own formula.
  rows = bench.run(bench._parse_args(["--devices", "4", "--n", "1000", "--methods",
                                      "example_scaled_mean", "--max-memory-gb", "0"]))
  assert [(r["method"], r["hlo_bytes_per_device"]) for r in rows] == [
      ("example_scaled_mean", rows[0]["formula_bytes"])]
  assert "example_scaled_mean" not in bench.format_table1(rows)  # not in the paper


def test_a_class_missing_a_piece_of_the_protocol_is_refused():
  @dataclasses.dataclass(frozen=True)
  class Incomplete(sj.methods.FlatVector):
    name: ClassVar[str] = "example_incomplete"

  with pytest.raises(TypeError, match="Incomplete lacks 'summary' of the AllReduce protocol"):
    sj.methods.register(Incomplete)
  with pytest.raises(ValueError, match="the method name 'spardl' is taken"):
    sj.methods.register(dataclasses.make_dataclass("Other", [], bases=(ScaledMean,), frozen=True,
                                           namespace={"name": "spardl"}))


def test_a_specs_text_is_read_by_each_options_annotation():
  """``key=value`` text becomes what each field's annotation says, for any method's Config:
  the number types, a Literal as its text, ``none`` for an optional one, a literal beside a
  number kept as text; a value of neither is refused naming what it allows."""
  cases = [(int, "3", 3), (float, "0.25", 0.25), (Literal["a", "b"], "b", "b"),
           (int | None, "none", None), (int | None, "4", 4),
           (int | Literal["auto"], "auto", "auto"), (int | Literal["auto"], "2", 2)]
  for hint, text, want in cases:
    got = sj.options.option_parser(hint)(text)
    assert got == want and type(got) is type(want), (hint, text, got)
  parse = sj.options.option_parser(int | Literal["auto"])
  with pytest.raises(ValueError):
    parse("many")
  assert parse.__name__ == "int or 'auto'"
