"""Two "nodes" on one machine: `fluxzero launch --launcher no-ssh` once per node rank, the real deepspeed
launcher and the real trainer, rendezvous over loopback. Same losses as one node with the same world size.

Both runs have 2 ranks (1 per node vs 2 on one node), the same run file and seed, so every rank sees the same
data and noise and the gloo reductions add the same two numbers: the losses must be bit-identical.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_run(tmp: Path, name: str) -> Path:
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 4,
        "gradient_clipping": 0.0,  # explicit: DeepSpeed 0.19.8 would default it to 1.0
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": 3},
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
    }
    (tmp / "ds.json").write_text(json.dumps(ds))
    run = tmp / f"{name}.yaml"
    run.write_text(
        f"deepspeed: {tmp / 'ds.json'}\n"
        "data: synthetic:n=8,hw=8x8,txt=4,ctx=64,vec=32\n"
        f"output_dir: {tmp / name}\n"
        "model: flux-tiny\nsteps: 3\nseed: 7\nexport:\n  format: null\n"
    )
    return run


def launch_cmd(hostfile: Path, run: Path, port: int, extra: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "fluxzero.cli",
        "launch",
        "--hostfile",
        str(hostfile),
        "--master-port",
        str(port),
        *extra,
        "--script",
        str(REPO / "launch" / "train.py"),
        "--",
        "--config",
        str(run),
    ]


def losses(out_dir: Path) -> list[float]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if "loss" in json.loads(line)]


def run_all(cmds: list[list[str]], cwd: Path) -> None:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "FLUXZERO_NO_PROGRESS": "1",
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    procs = [
        subprocess.Popen(c, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in cmds
    ]
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]


def test_two_nodes_no_ssh_match_one_node(tmp_path):
    two_hosts = tmp_path / "hosts2"
    two_hosts.write_text("node-0 slots=1\nnode-1 slots=1\n")  # never resolved: no-ssh starts ranks locally
    one_host = tmp_path / "hosts1"
    one_host.write_text("localhost slots=2\n")

    multi, single = write_run(tmp_path, "two_nodes"), write_run(tmp_path, "one_node")
    port = free_port()
    run_all(
        [
            launch_cmd(
                two_hosts, multi, port, ["--launcher", "no-ssh", "--node-rank", str(rank), "--master-addr", "127.0.0.1"]
            )
            for rank in (0, 1)
        ],
        tmp_path,
    )
    run_all([launch_cmd(one_host, single, free_port(), [])], tmp_path)

    got, ref = losses(tmp_path / "two_nodes"), losses(tmp_path / "one_node")
    assert len(got) == len(ref) == 3
    # the one-node run is also the trainer's test under the deepspeed launcher (it passes --local_rank=N and the
    # rank variables; launch/train.py accepts both): a checkpoint at the end and every rank's step time
    assert (tmp_path / "one_node" / "checkpoints" / "latest").read_text() == "step_00000003"
    rows = [json.loads(line) for line in (tmp_path / "one_node" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows[-1]["step_time_s_per_rank"]) == 2
    assert got == ref  # bit-identical: same data, noise and two-rank gloo reductions, only the node layout differs
    assert got[0] != got[-1]  # it trained
