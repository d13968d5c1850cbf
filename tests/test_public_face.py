"""What `import spardl_jax` gives: the library, not its tools (the HLO reader loads when
`sj.traffic` is first asked for)."""

import subprocess
import sys


def test_importing_the_library_loads_no_tool():
  code = ("import sys, spardl_jax as sj; "
          "assert not [m for m in sys.modules if m.startswith('spardl_jax.tools')]; "
          "assert sj.traffic.parse_hlo; assert 'spardl_jax.tools.traffic' in sys.modules; "
          "assert sj.checkpoint.refold")
  subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
