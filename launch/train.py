"""Thin entry for the `deepspeed` launcher, torchrun or plain python; see fluxzero/train/loop.py.

torchrun --nproc_per_node 2 launch/train.py --config launch/tiny.yaml
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from fluxzero.train.loop import main  # noqa: E402

if __name__ == "__main__":
    code = main()  # checkpoints, export and logs are written and closed, the process group torn down
    # Leave without interpreter teardown: C++ objects of the distributed stack freed after Python is gone
    # have aborted finished ranks (SIGABRT, "terminate called without an active exception") in a few
    # percent of 2-rank CPU runs, turning a finished run into a launcher failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
