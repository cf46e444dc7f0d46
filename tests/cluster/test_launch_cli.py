"""`fluxzero launch` and `fluxzero monitor` as users run them."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fluxzero.cluster.nccl import profile_env
from fluxzero.commands.launch import format_gpu_table, launch, monitor


@pytest.fixture
def hosts(tmp_path):
    p = tmp_path / "hosts"
    p.write_text("node-a slots=2\nnode-b slots=2\n")
    return str(p)


def test_dry_run_prints_env_file_and_command(hosts, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(
        launch,
        [
            "--hostfile",
            hosts,
            "--nccl",
            "infiniband",
            "--env",
            "NCCL_IB_HCA==mlx5_0",
            "--exclude",
            "node-b:1",
            "--master-addr",
            "10.1.2.3",
            "--dry-run",
            "--",
            "--config",
            "my run.yaml",
        ],
    )
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    cmd = shlex.split(lines[-1])
    assert cmd[0].endswith("deepspeed")
    assert cmd[1:] == [
        "--hostfile=" + hosts,
        "--exclude=node-b:1",
        "--launcher=pdsh",
        "--master_addr=10.1.2.3",
        "--master_port=29500",
        "launch/train.py",
        "--config",
        "my run.yaml",
    ]
    assert "NCCL_IB_DISABLE=0" in lines and "NCCL_NVLS_ENABLE=0" in lines and "NCCL_IB_HCA==mlx5_0" in lines
    assert "# .fluxzero/deepspeed_env" in r.output and "NCCL_IB_HCA==mlx5_0" in r.output.split("# command")[0]
    assert not (tmp_path / ".fluxzero").exists()  # a dry run writes nothing
    assert lines[0] == "# world: 3 ranks on 2 host(s)"
    # what would stop the real launch from here is said, not hidden behind exit 0
    assert "training script 'launch/train.py' not found" in r.stderr


def test_unwritable_env_file_is_one_sentence(hosts, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    for tool in ("pdsh", "deepspeed"):  # present, never reached
        (tmp_path / tool).write_text("#!/bin/sh\nexit 9\n")
        (tmp_path / tool).chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    (tmp_path / "blocker").write_text("a file where a folder should be")
    r = CliRunner().invoke(
        launch,
        [
            "--hostfile",
            hosts,
            "--master-addr",
            "node-a",
            "--script",
            "train.py",
            "--env-file",
            str(tmp_path / "blocker" / "env"),
        ],
    )
    assert r.exit_code == 2 and "--env-file with a writable path" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize(
    "args, words",
    [
        (["--launcher", "no-ssh", "--node-rank", "0"], ["--master-addr"]),
        (["--nccl", "turbo"], ["unknown NCCL profile 'turbo'"]),
        (["--env", "NCCL_NVLS_ENABLE=1"], ["NCCL_NVLS_ENABLE must stay 0"]),
        (["--env", "NOEQUALS"], ["KEY=VALUE"]),
        (["--env", "X=$(id)"], ["every node's own environment"]),
        (["--include", "node-z"], ["'node-z' is not in the hostfile"]),
        (["--launcher", "openmpi", "--include", "node-a"], ["cannot filter hosts"]),
        (["--master-addr", "a;b"], ["--master-addr"]),
    ],
)
def test_user_mistakes_are_one_line_usage_errors(hosts, args, words):
    r = CliRunner().invoke(launch, ["--hostfile", hosts, *args, "--dry-run", "--", "--config", "x.yaml"])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    for w in words:
        assert w in r.output


def test_hostile_hostfile_is_refused_with_its_line(tmp_path):
    p = tmp_path / "hosts"
    p.write_text("node-a slots=1\n$(reboot) slots=1\n")
    r = CliRunner().invoke(launch, ["--hostfile", str(p), "--dry-run"])
    assert r.exit_code == 2 and f"{p}:2:" in r.output


def test_missing_backend_is_named(hosts, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    monkeypatch.setenv("PATH", str(tmp_path))  # no pdsh, ompi_info, srun here
    r = CliRunner().invoke(
        launch, ["--hostfile", hosts, "--launcher", "slurm", "--master-addr", "node-a", "--script", "train.py"]
    )
    assert r.exit_code == 2 and "needs `srun` on PATH" in r.output
    assert not (tmp_path / ".fluxzero").exists()


@pytest.mark.slow
def test_real_deepspeed_launcher_passes_hostile_arguments_unchanged(tmp_path):
    """The real `deepspeed` launcher (no-ssh, one local node) starts a script that records what it got."""
    (tmp_path / "rec.py").write_text(
        "import json, os, sys\n"
        "json.dump({'argv': sys.argv[1:], 'env': {k: v for k, v in os.environ.items() if k.startswith('NCCL_')},"
        " 'foo': os.environ.get('FOO')}, open('out.json', 'w'))\n"
    )
    (tmp_path / "hosts").write_text("localhost slots=1\n")
    hostile = ["$(touch pwned)", "`touch pwned2`", "; touch pwned3", "a b", "it's", '"q"', "*", ""]
    cmd = [
        sys.executable,
        "-m",
        "fluxzero.cli",
        "launch",
        "--hostfile",
        "hosts",
        "--launcher",
        "no-ssh",
        "--node-rank",
        "0",
        "--master-port",
        "29613",
        "--nccl",
        "debug",
        "--env",
        "FOO=a b $HOME",
        "--script",
        "rec.py",
        "--",
        *hostile,
    ]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["argv"] == ["--local_rank=0", *hostile]
    assert got["env"] == profile_env("debug")
    assert got["foo"] == "a b $HOME"
    assert sorted(os.listdir(tmp_path)) == ["hosts", "out.json", "rec.py"]  # nothing was touched by a shell


def test_ctrl_c_waits_for_the_ranks_and_says_how_to_resume(tmp_path):
    """Ctrl-C reaches every process of the terminal's group: launch lets the ranks stop (never kills them) and
    ends with one line and exit status 130 instead of Click's bare 'Aborted!'."""
    import signal
    import time

    # stops as launch/train.py's loop does: the terminal's SIGINT and the launcher's SIGTERM arrive together, the
    # first interrupts, the second only asks for the stop already under way (it must not cut the cleanup short)
    (tmp_path / "rank.py").write_text(
        "import pathlib, signal, time\n"
        "stopping = []\n"
        "def stop(*_):\n"
        "    if not stopping:\n        stopping.append(1); raise KeyboardInterrupt\n"
        "signal.signal(signal.SIGTERM, stop); signal.signal(signal.SIGINT, stop)\n"
        "try:\n    pathlib.Path('started').touch()\n    time.sleep(120)\n"  # SIGINT only after this point
        "except KeyboardInterrupt:\n"
        "    time.sleep(1); pathlib.Path('stopped').touch(); raise SystemExit(130)\n"
    )
    p = subprocess.Popen(
        [sys.executable, "-m", "fluxzero.cli", "launch", "--master-port", "29614", "--script", "rank.py"],
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.time() + 60
    while not (tmp_path / "started").exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    os.killpg(p.pid, signal.SIGINT)
    err = p.communicate(timeout=120)[1]
    assert p.returncode == 130, err[-2000:]
    assert (tmp_path / "stopped").exists()  # the rank finished its own cleanup
    assert "Aborted!" not in err and err.rstrip().splitlines()[-1].startswith("interrupted: training stopped;")


def test_monitor_without_gpus_says_so():
    r = CliRunner().invoke(monitor, ["--count", "1"])
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        has_gpu = True
    except Exception:
        has_gpu = False
    if has_gpu:
        assert r.exit_code == 0 and "GiB" in r.output
    else:
        assert r.exit_code == 1 and "Traceback" not in r.output
        assert "nvidia-ml-py is not installed" in r.output or "no NVIDIA driver" in r.output


def test_gpu_table_flags_uneven_use():
    gpu = dict(mem_used=40 * 2**30, mem_total=141 * 2**30, power_w=500.0, temp_c=60, name="H200")
    even = format_gpu_table([{**gpu, "index": 0, "util": 97}, {**gpu, "index": 1, "util": 95}])
    assert "H200" in even and "40.0 /  141.0 GiB" in even and "uneven" not in even
    uneven = format_gpu_table([{**gpu, "index": 0, "util": 98}, {**gpu, "index": 1, "util": 41}])
    assert "uneven" in uneven and "GPU 1 lowest" in uneven


def test_slurm_script_starts_one_launcher_per_node(tmp_path):
    """launch/slurm.sbatch with stand-ins for scontrol/srun (two nodes) and --dry-run launches."""
    repo = Path(__file__).resolve().parents[2]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'gpu-node-7\\ngpu-node-9\\n'\n")
    (bin_dir / "srun").write_text(
        "#!/bin/sh\n"
        'while [ "${1#--}" != "$1" ]; do shift; done\n'  # drop srun's own --options
        'for id in 0 1; do SLURM_NODEID=$id "$@" || exit 1; done\n'
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "gpu-node-[7,9]",
        "SLURM_GPUS_ON_NODE": "4",
        "NCCL_PROFILE": "ethernet",
        "NCCL_ENV": "NCCL_SOCKET_IFNAME==eth0",
        "FLUXZERO_DRY_RUN": "1",
    }
    out = subprocess.run(
        ["bash", str(repo / "launch" / "slurm.sbatch"), "--config", "run file.yaml", "steps=10"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / ".fluxzero" / "hostfile-42").read_text() == "gpu-node-7 slots=4\ngpu-node-9 slots=4\n"
    commands = [shlex.split(line) for line in out.stdout.splitlines() if "deepspeed" in line and "--hostfile" in line]
    assert len(commands) == 2
    for rank, cmd in enumerate(commands):
        assert f"--node_rank={rank}" in cmd and "--no_ssh" in cmd and "--master_addr=gpu-node-7" in cmd
        assert cmd[-4:] == ["launch/train.py", "--config", "run file.yaml", "steps=10"]
    assert out.stdout.count("NCCL_SOCKET_NTHREADS=4") == 2 and out.stdout.count("NCCL_SOCKET_IFNAME==eth0") == 2
