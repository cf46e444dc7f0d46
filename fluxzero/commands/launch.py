"""`fluxzero launch`, `fluxzero doctor` and `fluxzero monitor`: start runs across hosts and see that they work."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import click

from fluxzero.cluster.launcher import LAUNCHERS

_BACKEND_TOOL = {"pdsh": "pdsh", "openmpi": "ompi_info", "mpich": "mpirun", "impi": "mpirun", "slurm": "srun"}


def _parse_env_pairs(pairs: tuple[str, ...]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE.", param_hint="--env")
        env[key] = value
    return env


def _deepspeed_exe() -> str:
    # The launcher from the same environment as this Python, so the ranks get the same packages.
    local = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    return local if os.path.exists(local) else "deepspeed"


@click.command(context_settings={"allow_interspersed_args": False})
@click.option(
    "--hostfile",
    type=click.Path(dir_okay=False),
    default=None,
    help="DeepSpeed hostfile ('host slots=N' lines). Without it: this machine's GPUs.",
)
@click.option(
    "--launcher",
    type=click.Choice(LAUNCHERS),
    default="pdsh",
    show_default=True,
    help="How ranks start on the hosts; no-ssh: run the same command on every node with --node-rank.",
)
@click.option("--include", default="", help="Hosts/GPUs to use, DeepSpeed syntax: 'host1:0,1@host2'.")
@click.option("--exclude", default="", help="Hosts/GPUs to leave out, same syntax (not with --include).")
@click.option("--num-nodes", type=click.IntRange(min=1), default=None, help="Use the first N hosts of the hostfile.")
@click.option("--num-gpus", type=click.IntRange(min=1), default=None, help="Use GPUs 0..N-1 on each host.")
@click.option("--master-addr", default="", help="Address of the rank-0 node (default: DeepSpeed asks the first host).")
@click.option(
    "--master-port",
    type=click.IntRange(1, 65535),
    default=29500,
    show_default=True,
    help="TCP port of the rendezvous on the rank-0 node.",
)
@click.option("--ssh-port", type=click.IntRange(1, 65535), default=None, help="ssh port of the hosts (pdsh).")
@click.option(
    "--node-rank", type=click.IntRange(min=0), default=None, help="This node's index in the hostfile (no-ssh)."
)
@click.option(
    "--nccl",
    "nccl_profile",
    default="default",
    show_default=True,
    help="NCCL profile: default, nvlink-single-node, infiniband, ethernet, debug, ring-simple; "
    "join with '+', e.g. ethernet+debug.",
)
@click.option(
    "--env",
    "env_pairs",
    multiple=True,
    metavar="KEY=VALUE",
    help="Extra environment for every rank (repeatable), e.g. --env NCCL_SOCKET_IFNAME==eth0.",
)
@click.option(
    "--env-file",
    default=".fluxzero/deepspeed_env",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="Where to write the environment remote ranks get (DeepSpeed's .deepspeed_env via DS_ENV_FILE).",
)
@click.option("--launcher-args", default="", help="Extra arguments for the backend (pdsh/mpirun/srun), one string.")
@click.option("--script", default="launch/train.py", show_default=True, help="Training entry point to launch.")
@click.option("--dry-run", is_flag=True, help="Print the command and environment; start nothing.")
@click.argument("train_args", nargs=-1, type=click.UNPROCESSED)
def launch(  # noqa: C901
    hostfile,
    launcher,
    include,
    exclude,
    num_nodes,
    num_gpus,
    master_addr,
    master_port,
    ssh_port,
    node_rank,
    nccl_profile,
    env_pairs,
    env_file,
    launcher_args,
    script,
    dry_run,
    train_args,
):
    """Start training through the `deepspeed` launcher on one node or a hostfile's nodes.

    Arguments after `--` go to the training script, e.g.
    `fluxzero launch --hostfile hosts --nccl infiniband -- --config run.yaml`.
    """
    from fluxzero.cluster.launcher import (
        LOCAL_HOSTS,
        LaunchError,
        LaunchSpec,
        build_command,
        merged_deepspeed_env,
        resolve_world,
        write_deepspeed_env,
    )
    from fluxzero.cluster.nccl import NcclError, check_user_env, profile_env

    spec = LaunchSpec(
        script=script,
        script_args=tuple(train_args),
        hostfile=hostfile,
        launcher=launcher,
        include=include,
        exclude=exclude,
        num_nodes=num_nodes or -1,
        num_gpus=num_gpus or -1,
        master_addr=master_addr,
        master_port=master_port,
        ssh_port=ssh_port,
        node_rank=node_rank,
        launcher_args=launcher_args,
        deepspeed=_deepspeed_exe(),
    )
    user_env = _parse_env_pairs(env_pairs)
    try:
        check_user_env(user_env)
        rank_env = {**profile_env(nccl_profile), **user_env}
        argv = build_command(spec)
        world = resolve_world(spec) if hostfile is not None else {}
    except (LaunchError, NcclError) as e:
        raise click.UsageError(str(e)) from None

    # Ranks started by this process (single node, no-ssh) inherit its environment; multi-node backends
    # read the file named by DS_ENV_FILE and export its lines on every node.
    env = {**os.environ, **rank_env}
    # A single local host is launched locally by DeepSpeed too: no backend, no env file.
    single_local = len(world) == 1 and next(iter(world)) in LOCAL_HOSTS
    multi_node = hostfile is not None and launcher != "no-ssh" and not single_local
    file_env = {}
    if multi_node:
        try:
            file_env = merged_deepspeed_env(rank_env)
            from fluxzero.cluster.launcher import deepspeed_env_text

            text = deepspeed_env_text(file_env, launcher)
        except LaunchError as e:
            raise click.UsageError(str(e)) from None

    preflight = []  # what would stop a real launch here; a dry run prints it, a real one stops on it
    if not os.path.exists(script):
        preflight.append(f"training script {script!r} not found; run from the fluxzero checkout or pass --script.")
    if shutil.which(argv[0]) is None and not os.path.exists(argv[0]):
        preflight.append("the `deepspeed` launcher is not on PATH; pip install deepspeed==0.19.8.")
    if multi_node and launcher in _BACKEND_TOOL and shutil.which(_BACKEND_TOOL[launcher]) is None:
        preflight.append(
            f"--launcher {launcher} needs `{_BACKEND_TOOL[launcher]}` on PATH; install it or pick another --launcher."
        )

    if dry_run:
        if world:
            click.echo(f"# world: {sum(len(s) for s in world.values())} ranks on {len(world)} host(s)")
        click.echo("# environment for every rank")
        for k, v in rank_env.items():
            click.echo(f"{k}={shlex.quote(v)}")
        if multi_node:
            click.echo(f"# {env_file} (DS_ENV_FILE for the deepspeed launcher)")
            click.echo(text, nl=False)
        click.echo("# command")
        click.echo(shlex.join(argv))
        for line in preflight:
            click.echo(f"warning: a real launch here would stop: {line}", err=True)
        return

    if preflight:
        raise click.UsageError(preflight[0])
    if multi_node:
        try:
            env.update(write_deepspeed_env(env_file, file_env, launcher))
        except OSError as e:
            raise click.UsageError(
                f"cannot write the launcher's environment file {env_file} ({e.strerror}); "
                "pass --env-file with a writable path."
            ) from None
    click.echo(shlex.join(argv), err=True)
    proc = subprocess.Popen(argv, env=env)
    try:
        sys.exit(proc.wait())
    except KeyboardInterrupt:  # Ctrl-C reached the launcher and the local ranks too: let them stop, never kill
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pass
        click.echo(
            "interrupted: training stopped; `latest` in the run's checkpoints folder names the last "
            "complete checkpoint, and the same command resumes from it",
            err=True,
        )
        sys.exit(130)


@click.command()
@click.option(
    "--hostfile", type=click.Path(dir_okay=False), default=None, help="Also check every host of this hostfile over ssh."
)
@click.option(
    "--checkpoint-dir",
    default=None,
    type=click.Path(file_okay=False),
    help="Where checkpoints will go (a run's output_dir): free disk is checked there. Without it the free "
    "disk here is shown, not checked.",
)
@click.option(
    "--min-free-gb",
    type=click.FloatRange(min=0),
    default=170.0,
    show_default=True,
    help="Free disk needed at --checkpoint-dir (one flux-dev ZeRO checkpoint is ~167 GB).",
)
@click.option("--ssh-port", type=click.IntRange(1, 65535), default=None, help="ssh port of the hosts.")
@click.option(
    "--ssh-timeout",
    type=click.IntRange(1, 120),
    default=5,
    show_default=True,
    help="Seconds to wait for each ssh connection.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def doctor(hostfile, checkpoint_dir, min_free_gb, ssh_port, ssh_timeout, as_json):
    """Check this machine (and a hostfile's hosts) for everything a run needs; a fix for every failure."""
    from fluxzero.cluster.doctor import format_table, run_doctor

    report = run_doctor(
        hostfile,
        checkpoint_dir=checkpoint_dir,
        min_free_gb=min_free_gb,
        ssh_port=ssh_port,
        connect_timeout=ssh_timeout,
        host_timeout=ssh_timeout + 90,
    )
    click.echo(json.dumps(report, indent=2) if as_json else format_table(report))
    sys.exit(0 if report["ok"] else 1)


def format_gpu_table(samples: list[dict], mean_util: dict[int, float] | None = None) -> str:
    """One line per GPU, plus a warning when the GPUs are used unevenly (one rank waits on another)."""
    lines = [f"{'gpu':>3}  {'util':>5}  {'mem used / total':>18}  {'power':>7}  {'temp':>5}  name"]
    for s in samples:
        lines.append(
            f"{s['index']:>3}  {s['util']:>4}%  {s['mem_used'] / 2**30:>7.1f} / {s['mem_total'] / 2**30:>6.1f} GiB  "
            f"{s['power_w']:>6.0f}W  {s['temp_c']:>4}C  {s['name']}"
        )
    util = mean_util or {s["index"]: s["util"] for s in samples}
    if len(util) > 1:
        spread = max(util.values()) - min(util.values())
        if spread > 20:
            lo = min(util, key=util.get)
            lines.append(
                f"uneven: mean utilisation differs by {spread:.0f} points (GPU {lo} lowest) - check data loading "
                "and bucket sizes on that rank, or a slow host/link"
            )
    return "\n".join(lines)


@click.command()
@click.option(
    "--interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True, help="Seconds between samples."
)
@click.option(
    "--count", type=click.IntRange(min=0), default=0, show_default=True, help="Samples to take (0: until Ctrl-C)."
)
def monitor(interval, count):
    """Show live per-GPU utilisation and memory of this node (NVML), flagging uneven GPUs."""
    try:
        import pynvml
    except ImportError:
        raise click.ClickException(
            "nvidia-ml-py is not installed: pip install nvidia-ml-py (or watch `nvidia-smi dmon -s um`)."
        ) from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise click.ClickException(
            f"cannot read GPU statistics ({e}): this machine has no NVIDIA driver; run fluxzero monitor on a GPU node."
        ) from None
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        totals: dict[int, float] = {}
        n = 0
        while count == 0 or n < count:
            samples = []
            for i, h in enumerate(handles):
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                name = pynvml.nvmlDeviceGetName(h)
                samples.append(
                    {
                        "index": i,
                        "name": name.decode() if isinstance(name, bytes) else name,
                        "util": pynvml.nvmlDeviceGetUtilizationRates(h).gpu,
                        "mem_used": mem.used,
                        "mem_total": mem.total,
                        "power_w": pynvml.nvmlDeviceGetPowerUsage(h) / 1000,
                        "temp_c": pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
                    }
                )
                totals[i] = totals.get(i, 0.0) + samples[-1]["util"]
            n += 1
            click.echo(time.strftime("%H:%M:%S"))
            click.echo(format_gpu_table(samples, {i: t / n for i, t in totals.items()}))
            if count == 0 or n < count:
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
    finally:
        pynvml.nvmlShutdown()
