"""Every Python block of the README, and every block of the guides and the reference that is
a whole program (its first line imports jax), runs as a new user would run it: in a fresh
process, from the repository root, with nothing but the block."""

import glob
import os
import re
import subprocess
import sys
import textwrap

import pytest

from spardl_jax import launch

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _blocks(path):
  # A block inside a list item is indented with it.
  return [textwrap.dedent(b) for b in re.findall(r"```python\n(.*?)```", open(path).read(), re.S)]


README = _blocks(os.path.join(ROOT, "README.md"))
PROGRAMS = [(os.path.basename(path), block)
            for path in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
            for block in _blocks(path) if block.startswith("import jax")]
BLOCKS = [("README.md", block) for block in README] + PROGRAMS


def test_the_readme_has_python_blocks_that_check_their_outcome():
  assert README and PROGRAMS
  assert [where for where, block in BLOCKS if not re.search(r"^\s*assert ", block, re.M)] == []


@pytest.mark.parametrize("where,block", BLOCKS,
                         ids=[f"{where}-{i}" for i, (where, _) in enumerate(BLOCKS)])
def test_block_runs(where, block):
  proc = subprocess.run([sys.executable, "-c", block], cwd=ROOT, capture_output=True,
                        text=True, timeout=300, env=launch.child_environment())
  # Each program asserts what it claims (a loss below a bound dense also meets, bits equal on
  # every device, mass conserved): its exit code is the check.
  assert proc.returncode == 0, (where, proc.stderr[-3000:])
