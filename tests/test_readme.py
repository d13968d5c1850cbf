"""Every Python block of the README is a whole program that runs as a new user would run it:
in a fresh process, from the repository root, with nothing but the block."""

import os
import re
import subprocess
import sys
import textwrap

import pytest

from spardl_jax.parallel import launch

ROOT = os.path.join(os.path.dirname(__file__), "..")
# A block inside a list item is indented with it.
BLOCKS = [textwrap.dedent(b) for b in re.findall(r"```python\n(.*?)```",
                                                 open(os.path.join(ROOT, "README.md")).read(),
                                                 re.S)]


def test_the_readme_has_python_blocks():
  assert BLOCKS


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_block_runs(block):
  proc = subprocess.run([sys.executable, "-c", block], cwd=ROOT, capture_output=True,
                        text=True, timeout=300, env=launch.child_environment())
  assert proc.returncode == 0, proc.stderr[-3000:]
  loss = re.search(r"loss after \d+ steps: ([0-9.]+)", proc.stdout)
  if loss:  # the training example fits its regression (the targets' variance is ~32)
    assert float(loss.group(1)) < 0.01, proc.stdout
