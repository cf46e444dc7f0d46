"""Thin entry for the `deepspeed` launcher, torchrun or plain python; see fluxzero/train.py.

    torchrun --nproc_per_node 2 launch/train.py --config launch/tiny.yaml
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from fluxzero.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
