"""Argument types the benchmarks' command lines share (the trainer's own, such as
``POSITIVE_INT``, are in :mod:`train.config`): argparse calls them on the flag's text and
turns their ``ArgumentTypeError`` into one line naming the flag, before any work is done."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

__all__ = ['fraction', 'comma_list', 'SEEDS', 'FRACTIONS', 'add_progress']


def fraction(text: str) -> float:
  """A fraction in (0, 1], e.g. of dense's final metric."""
  try:
    value = float(text)
  except ValueError:
    value = float("nan")
  if not 0 < value <= 1:  # also refuses NaN
    raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1], got {text}")
  return value


def comma_list(item: Callable[[str], Any], what: str) -> Callable[[str], list]:
  """An argparse type: a comma-separated list of ``item`` values, duplicates dropped in
  order; ``what`` names the list in the error."""
  def parse(text: str) -> list:
    try:
      values = [item(part) for part in text.split(",")]
    except (ValueError, argparse.ArgumentTypeError):
      raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    return list(dict.fromkeys(values))
  parse.__name__ = what
  return parse


SEEDS = comma_list(int, "a comma list of integer seeds")
FRACTIONS = comma_list(fraction, "a comma list of fractions in (0, 1]")


def add_progress(parser: argparse.ArgumentParser) -> None:
  """Every driver's ``--no-progress``: its bars (:mod:`spardl_jax.tools.progress`, drawn on
  a terminal only) off."""
  parser.add_argument("--no-progress", action="store_true",
                      help="no progress bars (drawn only on a terminal: units done of the "
                           "total, their rate, time left; SPARDL_PROGRESS=0 for every command)")
