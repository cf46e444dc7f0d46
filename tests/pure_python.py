"""Run code in a fresh interpreter where importing torch or deepspeed fails.

The pure commands (gen-config, check-config --no-deepspeed, estimate, gen-config --fit) and pure modules
(hostfile, ds_config, memory) must work there: that is what keeps them instant.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BLOCKER = textwrap.dedent("""
    import sys
    class _Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "deepspeed"):
                raise ImportError(f"import of {name} blocked by the test")
            return None
    sys.meta_path.insert(0, _Block())
""")


def run_without_torch(code: str, *args: str) -> subprocess.CompletedProcess:
    """`python -c BLOCKER + code args...` from the repository root; returns the finished process."""
    return subprocess.run(
        [sys.executable, "-c", BLOCKER + textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
