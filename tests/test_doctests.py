"""The examples in the library's docstrings run, with the outputs they show (on the suite's
simulated CPU devices; each example that needs devices takes the first 8)."""

import doctest
import importlib
import pkgutil

import pytest

import spardl_jax

MODULES = sorted(m.name for m in pkgutil.walk_packages(spardl_jax.__path__, "spardl_jax."))


def test_every_example_is_a_doctest():
  """No docstring shows code as a literal block (``::``) that a reader cannot trust to run."""
  literal = [name for name in MODULES
             if "Example::" in (importlib.import_module(name).__doc__ or "")
             or any("Example::" in (getattr(obj, "__doc__", "") or "")
                    for obj in vars(importlib.import_module(name)).values() if callable(obj))]
  assert not literal


def _examples(name: str) -> int:
  """How many ``>>>`` examples the module's own docstrings hold (not those it imports)."""
  module = importlib.import_module(name)
  return sum(len(test.examples) for test in doctest.DocTestFinder().find(module)
             if test.filename and test.filename.startswith(module.__file__.rsplit(".", 1)[0]))


EXAMPLES = [name for name in MODULES if _examples(name)]


def test_the_public_doors_show_examples():
  """The optax factories, the outer loop, the NNX door and the raw all-reduce each show one
  (a module without examples is not parametrized below, so it cannot pass by running
  nothing)."""
  assert {"spardl_jax._src.sync.transform", "spardl_jax._src.recipes.outer",
          "spardl_jax._src.recipes.nnx_door", "spardl_jax._src.core.allreduce",
          "spardl_jax.tools.progress"} <= set(EXAMPLES), EXAMPLES


@pytest.mark.parametrize("name", EXAMPLES)
def test_module_examples(name):
  result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0 and result.failed == 0
