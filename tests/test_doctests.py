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


@pytest.mark.parametrize("name", MODULES)
def test_module_examples(name):
  result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
  assert result.failed == 0
