"""`deepspeed` launcher command lines (fluxzero.cluster.launcher) checked against deepspeed 0.19.8's own parser."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from fluxzero.cluster.hostfile import filter_hosts
from fluxzero.cluster.launcher import (
    LAUNCHERS,
    LaunchError,
    LaunchSpec,
    build_command,
    deepspeed_env_text,
    merged_deepspeed_env,
    read_deepspeed_env,
    write_deepspeed_env,
)
from fluxzero.cluster.nccl import PROFILES, NcclError, check_user_env, profile_env, profiles_markdown

HOSTS = {"node-a": 2, "node-b": 2}
HOSTILE_ARGS = ["$(touch pwned)", "`id`", "; rm -rf ~", "a b", "it's", '"q"', "*", "--x=${HOME}", "", "\n"]


def ds_args(argv):
    """What DeepSpeed 0.19.8's runner makes of our argv."""
    from deepspeed.launcher.runner import parse_args

    assert argv[0] == "deepspeed"
    return parse_args(argv[1:])


def spec(**kw):
    kw.setdefault("script", "launch/train.py")
    kw.setdefault("hostfile", "hosts")
    kw.setdefault("cwd", "/work/run")
    return LaunchSpec(**kw)


@pytest.mark.parametrize("launcher", [name for name in LAUNCHERS if name != "no-ssh"])
def test_each_backend_argv_is_what_deepspeed_parses(launcher):
    argv = build_command(
        spec(launcher=launcher, master_addr="10.0.0.1", master_port=29600, script_args=("--config", "run.yaml")), HOSTS
    )
    assert argv == [
        "deepspeed",
        "--hostfile=hosts",
        f"--launcher={launcher}",
        "--master_addr=10.0.0.1",
        "--master_port=29600",
        "launch/train.py",
        "--config",
        "run.yaml",
    ]
    a = ds_args(argv)
    assert (a.hostfile, a.launcher, a.master_addr, a.master_port) == ("hosts", launcher, "10.0.0.1", 29600)
    assert (a.user_script, a.user_args, a.no_ssh) == ("launch/train.py", ["--config", "run.yaml"], False)


def test_no_ssh_needs_rank_and_address():
    argv = build_command(spec(launcher="no-ssh", node_rank=1, master_addr="node-a"), HOSTS)
    a = ds_args(argv)
    assert a.no_ssh and a.node_rank == 1 and a.master_addr == "node-a" and "--launcher=no-ssh" not in argv
    with pytest.raises(LaunchError, match="--node-rank between 0 and 1"):
        build_command(spec(launcher="no-ssh", master_addr="node-a"), HOSTS)
    with pytest.raises(LaunchError, match="--node-rank between 0 and 1"):
        build_command(spec(launcher="no-ssh", node_rank=2, master_addr="node-a"), HOSTS)
    with pytest.raises(LaunchError, match="needs --master-addr"):
        build_command(spec(launcher="no-ssh", node_rank=0), HOSTS)
    with pytest.raises(LaunchError, match="only applies to --launcher no-ssh"):
        build_command(spec(node_rank=0), HOSTS)


def test_filters_ports_and_limits_reach_deepspeed():
    argv = build_command(spec(include="node-b:1@node-a", ssh_port=2222, launcher_args="-R ssh"), HOSTS)
    a = ds_args(argv)
    assert (a.include, a.exclude, a.ssh_port, a.launcher_args) == ("node-b:1@node-a", "", 2222, "-R ssh")
    a = ds_args(build_command(spec(exclude="node-a:0"), HOSTS))
    assert a.exclude == "node-a:0"
    a = ds_args(build_command(spec(num_nodes=1, num_gpus=2), HOSTS))
    assert (a.num_nodes, a.num_gpus) == (1, 2)
    with pytest.raises(LaunchError, match="not in the hostfile"):
        build_command(spec(include="node-c"), HOSTS)
    with pytest.raises(LaunchError, match="mutually exclusive"):
        build_command(spec(include="node-a", exclude="node-b"), HOSTS)
    with pytest.raises(LaunchError, match="cannot be combined"):
        build_command(spec(include="node-a", num_gpus=1), HOSTS)
    with pytest.raises(LaunchError, match="--num-gpus 3"):
        build_command(spec(num_gpus=3), HOSTS)


def test_backend_limits_match_deepspeed():
    from deepspeed.launcher.multinode_runner import SlurmRunner

    for name in ("openmpi", "mpich", "impi"):
        with pytest.raises(LaunchError, match=f"--launcher {name} cannot filter"):
            build_command(spec(launcher=name, exclude="node-a:1"), HOSTS)
        with pytest.raises(LaunchError, match=f"--launcher {name} cannot limit"):
            build_command(spec(launcher=name, num_nodes=1), HOSTS)
    for name in ("mpich", "impi"):
        with pytest.raises(LaunchError, match="same slots on every host"):
            build_command(spec(launcher=name), {"node-a": 2, "node-b": 1})
    build_command(spec(launcher="openmpi"), {"node-a": 2, "node-b": 1})  # uneven is fine for OpenMPI
    # slurm places tasks by count: what we refuse, DeepSpeed's own check refuses too, and vice versa.
    for include, ok in [
        ("node-a:1", False),
        ("node-a:0@node-b", False),
        ("node-a@node-b:0,1", True),
        ("node-b:0", True),
    ]:
        try:
            build_command(spec(launcher="slurm", include=include), HOSTS)
            ours = True
        except LaunchError:
            ours = False
        world = filter_hosts(HOSTS, include=include)
        try:
            SlurmRunner.validate_active_resources(world)
            theirs = True
        except ValueError:
            theirs = False
        assert ours == theirs == ok, include


def test_single_local_host_skips_ssh():
    a = ds_args(build_command(spec(), {"localhost": 2}))
    assert a.no_ssh_check and a.master_addr == "127.0.0.1"
    a = ds_args(build_command(spec(launcher="no-ssh", node_rank=0), {"localhost": 1}))
    assert a.no_ssh and a.master_addr == "127.0.0.1"


def test_no_hostfile_means_local_gpus():
    argv = build_command(LaunchSpec(script="launch/train.py", num_gpus=2, script_args=("-c", "x.yaml")))
    assert argv == ["deepspeed", "--num_gpus=2", "--master_port=29500", "launch/train.py", "-c", "x.yaml"]
    with pytest.raises(LaunchError, match="need --hostfile"):
        build_command(LaunchSpec(script="launch/train.py", launcher="slurm"))


def test_reads_the_hostfile(tmp_path):
    p = tmp_path / "hosts"
    p.write_text("node-a slots=1\n")
    assert ds_args(build_command(spec(hostfile=str(p)))).hostfile == str(p)
    p.write_text("node-a slots=1\nnode-a slots=2\n")
    with pytest.raises(LaunchError, match=rf"{p}:2: .*twice"):
        build_command(spec(hostfile=str(p)))


# ------------------------------------------------------------------------------------------------ hostile input


@pytest.mark.parametrize("name", ["a;reboot", "$(id)", "-oProxyCommand=sh", "a b", "node`id`", "n|x", "h\nx", ""])
def test_hostile_host_names_are_refused(tmp_path, name):
    with pytest.raises(LaunchError, match="refusing to launch on"):
        build_command(spec(), {name: 1})
    with pytest.raises(LaunchError, match="--master-addr"):
        build_command(spec(master_addr=name or " "), HOSTS)
    p = tmp_path / "hosts"
    p.write_text(f"node-a slots=1\n{name} slots=1\n")
    with pytest.raises(LaunchError, match=rf"{p}:2: "):
        build_command(spec(hostfile=str(p)))


@pytest.mark.parametrize("launcher", ["openmpi", "mpich", "impi", "slurm", "no-ssh"])
def test_hostile_arguments_stay_single_list_elements(launcher):
    """Backends that exec the script directly get every argument, and odd paths, unchanged."""
    hostfile = "my hosts; rm -rf ~"
    kw = dict(node_rank=0, master_addr="node-a") if launcher == "no-ssh" else {}
    argv = build_command(
        spec(launcher=launcher, hostfile=hostfile, script="train $(x).py", script_args=tuple(HOSTILE_ARGS), **kw), HOSTS
    )
    assert argv[-len(HOSTILE_ARGS) :] == HOSTILE_ARGS
    a = ds_args(argv)
    assert (a.hostfile, a.user_script, a.user_args) == (hostfile, "train $(x).py", HOSTILE_ARGS)


@pytest.mark.parametrize("arg", [a for a in HOSTILE_ARGS if a != "a b"])
def test_pdsh_refuses_arguments_its_remote_shell_would_interpret(arg):
    with pytest.raises(LaunchError, match="through a shell on every node"):
        build_command(spec(script_args=("--config", arg)), HOSTS)


def test_pdsh_remote_command_round_trips_through_a_shell():
    """Build DeepSpeed's real pdsh command from our argv and env file; a POSIX shell must see our values."""
    from deepspeed.launcher.multinode_runner import PDSHRunner

    args = ("--config", "my run.yaml", "--lr=1e-4", "a@b:c,d/e")
    argv = build_command(spec(script_args=args, master_addr="node-a"), HOSTS)
    runner = PDSHRunner(ds_args(argv), "d29ybGQ=")
    for line in deepspeed_env_text(profile_env("ethernet+debug")).splitlines(keepends=True):
        key, val = line.split("=", maxsplit=1)  # exactly how runner.main() reads .deepspeed_env
        runner.add_export(key, val)
    cmd, _, _ = runner.get_cmd({}, {"node-a": [0, 1], "node-b": [0, 1]})
    assert cmd[:6] == ["pdsh", "-S", "-f", "1024", "-w", "node-a,node-b"]
    words = shlex.split(" ".join(cmd[6:]))  # what the shell on each node splits the remote line into
    assert words[-len(args) :] == list(args)
    exports = dict(w.rstrip(";").split("=", 1) for w in words if w.startswith("NCCL_"))
    assert exports == profile_env("ethernet+debug")


def test_pdsh_refuses_a_working_directory_the_remote_shell_would_split():
    with pytest.raises(LaunchError, match="working directory"):
        build_command(spec(cwd="/home/me/my runs"), HOSTS)


@pytest.mark.parametrize("hosts", [None, {"localhost": 2}])
def test_single_node_launches_take_any_path_and_argument(hosts):
    """No hostfile, or one local host: DeepSpeed starts the ranks from an argument list, no remote shell."""
    hostfile = None if hosts is None else "hosts"
    argv = build_command(
        spec(hostfile=hostfile, cwd="/home/me/my dir (2)", script="train $(x).py", script_args=tuple(HOSTILE_ARGS)),
        hosts,
    )
    a = ds_args(argv)
    assert (a.user_script, a.user_args) == ("train $(x).py", HOSTILE_ARGS)


# ------------------------------------------------------------------------------------------------ .deepspeed_env


def test_deepspeed_env_file_format_and_merge(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("A=1\nB=home\n")
    (cwd / ".deepspeed_env").write_text("B=cwd\nC=x=y\n")
    merged = merged_deepspeed_env({"C": "ours", "NCCL_NVLS_ENABLE": "0"}, home=str(home), cwd=str(cwd))
    assert merged == {"A": "1", "B": "cwd", "C": "ours", "NCCL_NVLS_ENABLE": "0"}
    extra = write_deepspeed_env(tmp_path / "out" / "env", merged)
    assert extra == {"DS_ENV_FILE": str(tmp_path / "out" / "env")}
    text = (tmp_path / "out" / "env").read_text()
    assert text == "A=1\nB=cwd\nC=ours\nNCCL_NVLS_ENABLE=0\n"  # no comments or blank lines: DeepSpeed would crash
    assert read_deepspeed_env(tmp_path / "out" / "env") == merged
    (cwd / ".deepspeed_env").write_text("A=1\n\n")
    with pytest.raises(LaunchError, match=r"\.deepspeed_env:2: DeepSpeed needs KEY=VALUE"):
        merged_deepspeed_env({}, home=str(tmp_path / "nohome"), cwd=str(cwd))


def test_deepspeed_env_values_must_survive_every_backend():
    assert deepspeed_env_text({"NCCL_IB_HCA": "=mlx5_0,mlx5_1"}) == "NCCL_IB_HCA==mlx5_0,mlx5_1\n"
    with pytest.raises(LaunchError, match="srun|slurm"):
        deepspeed_env_text({"NCCL_IB_HCA": "mlx5_0,mlx5_1"}, launcher="slurm")
    for bad in ["$(id)", "a b", "^docker", 'x"y', "a;b"]:
        with pytest.raises(LaunchError, match="every node's own environment"):
            deepspeed_env_text({"X": bad})
    with pytest.raises(LaunchError, match="not a valid environment variable name"):
        deepspeed_env_text({"A B": "1"})


# ------------------------------------------------------------------------------------------------ NCCL profiles


def test_nccl_profiles_keep_nvls_off():
    for name in PROFILES:
        env = profile_env(name)
        assert env["NCCL_NVLS_ENABLE"] == "0"
        for v in PROFILES[name].vars:
            assert v.why and v.name.startswith("NCCL_")
    assert profile_env("") == {"NCCL_NVLS_ENABLE": "0"}
    combo = profile_env("ethernet+debug")
    assert combo["NCCL_DEBUG"] == "INFO" and combo["NCCL_SOCKET_NTHREADS"] == "4"
    assert int(combo["NCCL_SOCKET_NTHREADS"]) * int(combo["NCCL_NSOCKS_PERTHREAD"]) <= 64  # NCCL's cap
    assert "NCCL_ALGO" not in combo and "NCCL_PROTO" not in combo  # forcing them is for diagnosis only
    assert PROFILES["ring-simple"].diagnostic
    with pytest.raises(NcclError, match="unknown NCCL profile 'fast'"):
        profile_env("ethernet+fast")
    with pytest.raises(NcclError, match="'infiniband' and 'ethernet' contradict each other .NCCL_IB_DISABLE=0 vs 1"):
        profile_env("infiniband+ethernet")
    with pytest.raises(NcclError, match="NCCL_NVLS_ENABLE must stay 0"):
        check_user_env({"NCCL_NVLS_ENABLE": "1"})


def test_multi_node_doc_nccl_table_is_the_code():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "multi-node.md").read_text()
    assert profiles_markdown() in doc


@pytest.mark.slow
def test_nccl_benchmark_script_runs_on_cpu(tmp_path):
    """benchmarks/nccl_profiles.py end to end with gloo (fresh torchrun, JSON under $OUT, table)."""
    import json
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(repo)}
    out = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "nccl_profiles.py"), "--cpu-smoke", "--configs", "default"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    (result,) = tmp_path.glob("nccl_profiles_*.json")
    run = json.loads(result.read_text())["runs"][0]
    assert run["env"] == {"NCCL_NVLS_ENABLE": "0"}
    assert {r["op"] for r in run["results"]} == {"all_reduce", "reduce_scatter", "all_gather"}
    assert all(r["busbw_gbs"] > 0 for r in run["results"])
    assert "busbw GB/s" in out.stdout
