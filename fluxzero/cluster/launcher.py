"""Pure Python: build the `deepspeed` launcher's argument list and its `.deepspeed_env` file.

Everything here returns argument lists (for `subprocess.run(argv)` with no shell) and never a shell
string. Two places in DeepSpeed 0.19.8 do go through a shell, and this module guards both:

* `--launcher pdsh` runs `export K=V; cd <cwd>; python -u -m deepspeed.launcher.launch ... <script> <args>`
  through a shell on every node. DeepSpeed only wraps arguments that contain a space in double quotes,
  so `$`, backticks, `;`, `*`, `~` ... in a training argument, the working directory or an exported value
  would be interpreted there. Such values are refused with a message (put them in the YAML config).
* `.deepspeed_env` values are exported the same way (`runner.add_export`), and passed verbatim (with any
  quotes DeepSpeed added) to `mpirun -x`, `-genv` and `srun --export`. Only characters DeepSpeed leaves
  unquoted are accepted (letters, digits and `_@%+=:,./-`); with slurm, commas are refused too, since
  `srun --export=ALL,K=V,...` splits on them.

Host names come from `fluxzero.cluster.hostfile`, which already refuses anything but letters, digits, '.', '-', '_'.

How DeepSpeed 0.19.8 reads `.deepspeed_env` (deepspeed/launcher/runner.py): the file name is
`$DS_ENV_FILE` or `.deepspeed_env`, looked up in `~` and then in the launching directory (both are read,
later wins). Every line must be `KEY=VALUE` (split at the first '='; a blank line or a line without '='
crashes the launcher; there are no comments). It is read only for multi-node launches (pdsh, openmpi,
mpich, impi, slurm); single-node and `--no_ssh` launches pass the launcher's own environment to the ranks
instead. `write_deepspeed_env` therefore writes a fluxzero-owned file (merging the user's existing ones)
and the launcher is pointed at it through `DS_ENV_FILE` with an absolute path.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from fluxzero.cluster.hostfile import HostfileError, check_host_name, filter_hosts, limit_hosts, parse_hostfile

__all__ = [
    "LAUNCHERS",
    "LaunchError",
    "LaunchSpec",
    "build_command",
    "resolve_world",
    "deepspeed_env_text",
    "read_deepspeed_env",
    "merged_deepspeed_env",
    "write_deepspeed_env",
    "LOCAL_HOSTS",
]

LAUNCHERS = ("pdsh", "openmpi", "mpich", "impi", "slurm", "no-ssh")
LOCAL_HOSTS = ("localhost", "127.0.0.1")
DEFAULT_MASTER_PORT = 29500

# Characters DeepSpeed's MultiNodeRunner.add_export leaves unquoted (runner regex: [^\w@%+=:,./-]).
_PLAIN = re.compile(r"[\w@%+=:,./-]+")
# pdsh: DeepSpeed wraps an argument that has a space in "..."; nothing else is protected.
_PDSH_ARG = re.compile(r"[\w@%+=:,./ -]+")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class LaunchError(ValueError):
    """A launch request that cannot work as given; the message says what to change."""


@dataclass
class LaunchSpec:
    """What `fluxzero launch` was asked for. Defaults follow the `deepspeed` launcher's."""

    script: str
    script_args: Sequence[str] = ()
    hostfile: str | None = None
    launcher: str = "pdsh"
    include: str = ""
    exclude: str = ""
    num_nodes: int = -1
    num_gpus: int = -1
    master_addr: str = ""
    master_port: int = DEFAULT_MASTER_PORT
    ssh_port: int | None = None
    node_rank: int | None = None
    launcher_args: str = ""
    deepspeed: str = "deepspeed"  # argv[0]; tests point it at the venv's launcher
    cwd: str = field(default_factory=os.getcwd)


def _bad_chars(text: str, allowed: re.Pattern) -> str:
    return "".join(sorted({c for c in text if not allowed.fullmatch(c)}))


def resolve_world(spec: LaunchSpec, hosts: Mapping[str, int] | None = None) -> dict[str, list[int]]:
    """Hosts and slot ids that will run ranks, after include/exclude and --num-nodes/--num-gpus."""
    if hosts is None:
        if spec.hostfile is None:
            raise LaunchError("a hostfile is needed to resolve hosts; pass --hostfile.")
        hosts = parse_hostfile(spec.hostfile)
    for h in hosts:
        reason = check_host_name(h)
        if reason:
            raise LaunchError(f"refusing to launch on {reason}.")
    if (spec.include or spec.exclude) and (spec.num_nodes > 0 or spec.num_gpus > 0):
        raise LaunchError("--num-nodes/--num-gpus cannot be combined with --include/--exclude; use one or the other.")
    try:
        world = filter_hosts(hosts, spec.include, spec.exclude)
        return limit_hosts(world, spec.num_nodes, spec.num_gpus)
    except HostfileError as e:
        raise LaunchError(str(e)) from None


def _check_launcher_limits(spec: LaunchSpec, hosts: Mapping[str, int], world: Mapping[str, list[int]]) -> None:
    """The limits each DeepSpeed backend enforces (multinode_runner.py), checked before anything starts."""
    name = spec.launcher
    if name in ("openmpi", "mpich", "impi"):
        if spec.include or spec.exclude:
            raise LaunchError(
                f"--launcher {name} cannot filter hosts; remove --include/--exclude or edit the hostfile."
            )
        if spec.num_nodes > 0 or spec.num_gpus > 0:
            raise LaunchError(f"--launcher {name} cannot limit nodes or GPUs; remove --num-nodes/--num-gpus.")
    if name in ("mpich", "impi") and len(set(hosts.values())) > 1:
        raise LaunchError(f"--launcher {name} needs the same slots on every host; the hostfile has {dict(hosts)}.")
    if name == "slurm":
        for h, slots in world.items():
            if list(slots) != list(range(len(slots))):
                raise LaunchError(
                    f"--launcher slurm cannot pick GPU ids ({slots} on {h}); filter whole hosts or keep the "
                    "first N slots of every host."
                )
        if len({len(s) for s in world.values()}) > 1:
            raise LaunchError(
                f"--launcher slurm needs the same number of GPUs on every host, got "
                f"{ {h: len(s) for h, s in world.items()} }."
            )


def _check_script(spec: LaunchSpec) -> None:
    if not spec.script or spec.script.startswith("-"):
        raise LaunchError(f"training script {spec.script!r} must be a path that does not start with '-'.")


def _check_pdsh_shell(spec: LaunchSpec) -> None:
    """Multi-node pdsh only: the remote command line goes through a shell (see the module docstring).

    Single-node launches (no hostfile, or one local host) start the ranks from an argument list instead.
    """
    for what, text in [("the working directory", spec.cwd), ("the training script", spec.script)]:
        bad = _bad_chars(text, _PLAIN)
        if bad:
            raise LaunchError(
                f"--launcher pdsh runs {what} {text!r} through a shell on every node and it contains {bad!r}; "
                "use a path of letters, digits and _@%+=:,./- only."
            )
    for arg in spec.script_args:
        bad = _bad_chars(arg, _PDSH_ARG) if arg else "(empty argument)"
        if bad:
            raise LaunchError(
                f"--launcher pdsh passes training arguments through a shell on every node; {arg!r} contains "
                f"{bad!r} which that shell would interpret. Put the value in the YAML config instead."
            )


def build_command(spec: LaunchSpec, hosts: Mapping[str, int] | None = None) -> list[str]:  # noqa: C901
    """The `deepspeed` launcher argv for `spec` (an argument list: run it with no shell).

    `hosts` is the parsed hostfile; it is read from `spec.hostfile` when not given.
    """
    if spec.launcher not in LAUNCHERS:
        raise LaunchError(f"unknown launcher {spec.launcher!r}; choose from {', '.join(LAUNCHERS)}.")
    if spec.master_addr:
        reason = check_host_name(spec.master_addr)
        if reason:
            raise LaunchError(f"--master-addr: {reason}.")
    if not 0 < spec.master_port < 65536:
        raise LaunchError(f"--master-port {spec.master_port} is not a TCP port (1-65535).")
    if spec.node_rank is not None and spec.launcher != "no-ssh":
        raise LaunchError("--node-rank only applies to --launcher no-ssh.")
    if spec.launcher_args:
        try:
            shlex.split(spec.launcher_args)
        except ValueError as e:
            raise LaunchError(f"--launcher-args {spec.launcher_args!r} cannot be split into arguments: {e}.") from None
    _check_script(spec)

    argv = [spec.deepspeed]
    if spec.hostfile is None and hosts is None:
        # Single node, the local GPUs: no hostfile, no ssh, no backend.
        if spec.launcher not in ("pdsh",) or spec.include or spec.exclude or spec.num_nodes > 0:
            raise LaunchError(
                "--launcher, --include, --exclude and --num-nodes need --hostfile; without one, "
                "fluxzero launch runs on this machine's GPUs (limit them with --num-gpus)."
            )
        if spec.num_gpus > 0:
            argv.append(f"--num_gpus={spec.num_gpus}")
        argv.append(f"--master_port={spec.master_port}")
        return argv + [spec.script, *spec.script_args]

    if hosts is None:
        try:
            hosts = parse_hostfile(spec.hostfile)
        except HostfileError as e:
            raise LaunchError(str(e)) from None
    world = resolve_world(spec, hosts)
    _check_launcher_limits(spec, hosts, world)
    single_local = len(world) == 1 and next(iter(world)) in LOCAL_HOSTS
    if spec.launcher == "pdsh" and not single_local:
        _check_pdsh_shell(spec)

    if spec.hostfile is not None:
        argv.append(f"--hostfile={os.fspath(spec.hostfile)}")
    if spec.include:
        argv.append(f"--include={spec.include}")
    if spec.exclude:
        argv.append(f"--exclude={spec.exclude}")
    if spec.num_nodes > 0:
        argv.append(f"--num_nodes={spec.num_nodes}")
    if spec.num_gpus > 0:
        argv.append(f"--num_gpus={spec.num_gpus}")

    master_addr = spec.master_addr
    if spec.launcher == "no-ssh":
        if spec.node_rank is None or not 0 <= spec.node_rank < len(world):
            raise LaunchError(
                f"--launcher no-ssh needs --node-rank between 0 and {len(world) - 1} "
                "(run the same command on every node, each with its own rank)."
            )
        if not master_addr:
            if not single_local:
                raise LaunchError("--launcher no-ssh needs --master-addr (the address of the node with rank 0).")
            master_addr = "127.0.0.1"
        argv += ["--no_ssh", f"--node_rank={spec.node_rank}"]
    else:
        argv.append(f"--launcher={spec.launcher}")
        if single_local:
            # One local host: DeepSpeed launches locally, but would still ssh to it first.
            argv.append("--no_ssh_check")
            master_addr = master_addr or "127.0.0.1"
    if master_addr:
        argv.append(f"--master_addr={master_addr}")
    argv.append(f"--master_port={spec.master_port}")
    if spec.ssh_port is not None:
        if not 0 < spec.ssh_port < 65536:
            raise LaunchError(f"--ssh-port {spec.ssh_port} is not a TCP port (1-65535).")
        argv.append(f"--ssh_port={spec.ssh_port}")
    if spec.launcher_args:
        argv.append(f"--launcher_args={spec.launcher_args}")
    return argv + [spec.script, *spec.script_args]


# ---------------------------------------------------------------------------------------------- .deepspeed_env


def _check_env(env: Mapping[str, str], launcher: str) -> None:
    for key, value in env.items():
        if not _ENV_NAME.fullmatch(key):
            raise LaunchError(f"--env {key}=...: {key!r} is not a valid environment variable name.")
        value = str(value)
        bad = _bad_chars(value, _PLAIN) if value else ""
        if launcher == "slurm" and "," in value:
            bad += ","
        if bad:
            raise LaunchError(
                f"--env {key}={value}: {bad!r} cannot be passed to remote ranks through DeepSpeed's "
                f"{launcher} launcher unchanged; set {key} in every node's own environment instead."
            )


def deepspeed_env_text(env: Mapping[str, str], launcher: str = "pdsh") -> str:
    """`KEY=VALUE` lines in the format DeepSpeed's runner reads (no comments, no blank lines)."""
    _check_env(env, launcher)
    return "".join(f"{k}={v}\n" for k, v in env.items())


def read_deepspeed_env(path: str | os.PathLike) -> dict[str, str]:
    """Read a `.deepspeed_env` the way DeepSpeed 0.19.8 does, refusing lines that would crash it."""
    out: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if "=" not in line:
                raise LaunchError(
                    f"{os.fspath(path)}:{lineno}: DeepSpeed needs KEY=VALUE on every line of .deepspeed_env "
                    "(no blank lines or comments); fix or remove that line."
                )
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip()
    return out


def merged_deepspeed_env(ours: Mapping[str, str], home: str | None = None, cwd: str | None = None) -> dict[str, str]:
    """The user's `~/.deepspeed_env` and `./.deepspeed_env` (DeepSpeed's order), then ours on top."""
    merged: dict[str, str] = {}
    for base in (home if home is not None else os.path.expanduser("~"), cwd if cwd is not None else os.getcwd()):
        path = os.path.join(base, ".deepspeed_env")
        if os.path.isfile(path):
            merged.update(read_deepspeed_env(path))
    merged.update(ours)
    return merged


def write_deepspeed_env(path: str | os.PathLike, env: Mapping[str, str], launcher: str = "pdsh") -> dict[str, str]:
    """Write `env` to `path`; return the variables that point DeepSpeed's launcher at it (`DS_ENV_FILE`)."""
    text = deepspeed_env_text(env, launcher)
    path = os.path.abspath(os.fspath(path))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return {"DS_ENV_FILE": path}
