"""`fluxzero doctor`: is this machine (and every host of a hostfile) ready to train?

Each check gives a row: name, status (pass / fail / warn / skip), what was found, and the fix when it is not
a pass. torch and deepspeed are imported inside the checks, so a broken install is a failed row, not a
traceback. Remote hosts are checked over ssh (non-interactive, with timeouts) by running this same module
there: `python -m fluxzero.cluster.doctor --json --local-only` with the same interpreter path and directory that
DeepSpeed's pdsh launcher will use.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import shlex
import shutil
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

GiB = 1024**3
# One full flux-dev ZeRO checkpoint: bf16 weights 2 B + fp32 master 4 B + Adam m, v 8 B per parameter,
# 11.9e9 parameters -> ~167 GB (155 GiB). Leave room for one.
DEFAULT_MIN_FREE_GB = 170.0
MIN_SHM_GIB = 1.0
# DeepSpeed ops fluxzero can use and why (the others are inference / MoE kernels).
OPS_USED = {
    "fused_adam": "AdamW on GPU without `torch_adam: true`",
    "cpu_adam": "ZeRO CPU offload of the optimizer",
    "async_io": "ZeRO-Infinity NVMe offload",
}
OP_FIXES = {
    "async_io": "install libaio (Debian/Ubuntu: apt-get install libaio-dev) - only needed for NVMe offload",
    "fused_adam": "install the CUDA toolkit matching torch (nvcc, CUDA_HOME) or set `torch_adam: true`",
    "cpu_adam": "install a C++ compiler (g++) and ninja, or set `torch_adam: true` for offload",
}
STATUSES = ("pass", "warn", "fail", "skip")


@dataclass
class Check:
    name: str
    status: str  # one of STATUSES
    detail: str
    fix: str = ""
    host: str = "local"


# ------------------------------------------------------------------------------------------------ local checks


def _check_python() -> Check:
    v = sys.version_info
    ok = v >= (3, 10)
    return Check(
        "python",
        "pass" if ok else "fail",
        f"{platform.python_version()} ({sys.executable})",
        "" if ok else "use Python 3.10 or newer",
    )


def _check_torch(checks: list[Check]) -> dict:
    """torch, CUDA, NCCL and GPU rows. Returns facts reused by other checks."""
    facts = {"torch": None, "cuda": None, "nccl": None, "gpus": 0, "cpu_only": True}
    try:
        import torch
    except Exception as e:  # a broken install is a row, not a traceback
        checks.append(
            Check("torch", "fail", f"cannot import torch: {e}", "pip install torch (the CUDA build on GPU nodes)")
        )
        return facts
    facts["torch"] = torch.__version__
    facts["cuda"] = torch.version.cuda
    checks.append(Check("torch", "pass", f"{torch.__version__} (CUDA build: {torch.version.cuda or 'no'})"))

    available = torch.cuda.is_available()
    if not available:
        has_driver = os.path.exists("/dev/nvidiactl")
        if torch.version.cuda and has_driver:
            checks.append(
                Check(
                    "cuda",
                    "fail",
                    f"torch is built for CUDA {torch.version.cuda} and an NVIDIA driver is present, but no GPU is visible",
                    "check `nvidia-smi`, CUDA_VISIBLE_DEVICES, and that the driver supports this CUDA version",
                )
            )
        else:
            checks.append(
                Check(
                    "cuda",
                    "warn",
                    "CPU-only machine: no CUDA GPU visible, so GPU, CUDA and NCCL checks are skipped; "
                    "training here runs on CPU with the gloo backend (tests only)",
                    "on a GPU node, install a CUDA build of torch and check `nvidia-smi`",
                )
            )
        for name in ("nccl", "gpus"):
            checks.append(Check(name, "skip", "CPU-only machine"))
        return facts

    facts["cpu_only"] = False
    driver = _nvml_driver()
    checks.append(Check("cuda", "pass", f"CUDA {torch.version.cuda} (driver {driver or 'unknown'})"))
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        facts["nccl"] = nccl
        checks.append(Check("nccl", "pass", f"NCCL {nccl} (bundled with torch)"))
    except Exception as e:
        checks.append(
            Check(
                "nccl",
                "fail",
                f"torch reports no NCCL: {e}",
                "install a torch build with NCCL (the default CUDA wheels)",
            )
        )
    n = torch.cuda.device_count()
    facts["gpus"] = n
    for i in range(n):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        detail = f"{props.name}, sm_{props.major}{props.minor}, {free / GiB:.1f} of {total / GiB:.1f} GiB free"
        if free < 0.9 * total:
            checks.append(
                Check(
                    f"gpu{i}",
                    "warn",
                    detail + f"; {(total - free) / GiB:.1f} GiB already in use",
                    "stop the other processes on this GPU (see `nvidia-smi`)",
                )
            )
        elif props.major < 8:
            checks.append(
                Check(f"gpu{i}", "warn", detail + "; no bf16 tensor cores", "use an Ampere or newer GPU for bf16")
            )
        else:
            checks.append(Check(f"gpu{i}", "pass", detail))
    return facts


def _nvml_driver() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else v
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


def _check_deepspeed(checks: list[Check], facts: dict) -> None:
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            import deepspeed
            from deepspeed.git_version_info import installed_ops
            from deepspeed.ops.op_builder.all_ops import ALL_OPS
            from deepspeed.ops.op_builder.builder import probe_is_compatible
    except Exception as e:
        checks.append(Check("deepspeed", "fail", f"cannot import deepspeed: {e}", "pip install deepspeed==0.19.8"))
        return
    facts["deepspeed"] = deepspeed.__version__
    ok = deepspeed.__version__ == "0.19.8"
    checks.append(
        Check(
            "deepspeed",
            "pass" if ok else "warn",
            deepspeed.__version__,
            "" if ok else "fluxzero is tested with deepspeed==0.19.8; pip install deepspeed==0.19.8",
        )
    )
    try:
        from torch.utils.cpp_extension import is_ninja_available

        ninja = is_ninja_available()
    except Exception:
        ninja = False
    # ds_report's op table, without building anything: prebuilt, or compatible for a JIT build.
    for op, use in OPS_USED.items():
        builder = ALL_OPS.get(op)
        if builder is None:
            checks.append(Check(f"op {op}", "skip", f"not offered by this accelerator ({use})"))
            continue
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            compatible = probe_is_compatible(builder, False)
        prebuilt = bool(installed_ops.get(op, False))
        if prebuilt:
            checks.append(Check(f"op {op}", "pass", f"prebuilt ({use})"))
        elif compatible and ninja:
            checks.append(Check(f"op {op}", "pass", f"compatible, JIT-compiled on first use, 1-2 min ({use})"))
        elif compatible:
            checks.append(Check(f"op {op}", "warn", f"compatible but ninja is missing ({use})", "pip install ninja"))
        else:
            checks.append(Check(f"op {op}", "warn", f"cannot be built here ({use})", OP_FIXES[op]))


def _check_shm() -> Check:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return Check("/dev/shm", "warn", "no /dev/shm", "NCCL and DataLoader workers need shared memory; use Linux")
    size = st.f_frsize * st.f_blocks
    detail = f"{size / GiB:.1f} GiB"
    if size < MIN_SHM_GIB * GiB:
        return Check(
            "/dev/shm",
            "fail",
            detail + f" (< {MIN_SHM_GIB:g} GiB: NCCL's shared-memory transport and DataLoader workers fail)",
            "in Docker run with --ipc=host or --shm-size=16g",
        )
    return Check("/dev/shm", "pass", detail)


def _check_disk(checkpoint_dir: str | None, min_free_gb: float) -> Check:
    """Free disk where the user says checkpoints go; without a folder, this folder's, as information only
    (a run's checkpoints go to its output_dir, and a LoRA's need a small part of a full fine-tune's)."""
    probe = os.path.abspath(checkpoint_dir or ".")
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    free = shutil.disk_usage(probe).free
    detail = f"{free / 1e9:.0f} GB free at {probe}"
    if checkpoint_dir is None:
        return Check(
            "disk",
            "pass",
            detail + " (not checked against a need: pass --checkpoint-dir with the run's "
            f"output_dir to check it has {min_free_gb:g} GB free; one flux-dev ZeRO checkpoint is ~167 GB)",
        )
    if free < min_free_gb * 1e9:
        return Check(
            "checkpoint disk",
            "fail",
            detail + f" (< {min_free_gb:g} GB; one flux-dev ZeRO checkpoint is ~167 GB)",
            "free space, pass another --checkpoint-dir, or lower --min-free-gb for smaller models",
        )
    return Check("checkpoint disk", "pass", detail)


def local_checks(
    checkpoint_dir: str | None = None, min_free_gb: float = DEFAULT_MIN_FREE_GB
) -> tuple[list[Check], dict]:
    checks = [_check_python()]
    facts = _check_torch(checks)
    _check_deepspeed(checks, facts)
    checks += [_check_shm(), _check_disk(checkpoint_dir, min_free_gb)]
    facts["python"] = platform.python_version()
    facts["hostname"] = socket.gethostname()
    return checks, facts


# ----------------------------------------------------------------------------------------------- remote checks


def ssh_argv(host: str, remote_command: str, ssh_port: int | None = None, connect_timeout: int = 5) -> list[str]:
    """ssh that never prompts (BatchMode) and gives up connecting after `connect_timeout` seconds."""
    argv = [
        "ssh",
        "-o",
        "BatchMode=yes",
        "-o",
        f"ConnectTimeout={connect_timeout}",
        "-o",
        "ServerAliveInterval=5",
        "-o",
        "ServerAliveCountMax=2",
    ]
    if ssh_port is not None:
        argv += ["-p", str(ssh_port)]
    return argv + ["--", host, remote_command]


def _remote_command(checkpoint_dir: str | None, min_free_gb: float) -> str:
    # The remote shell reads this line, so every piece is quoted.
    parts = [
        sys.executable,
        "-m",
        "fluxzero.cluster.doctor",
        "--json",
        "--local-only",
        "--min-free-gb",
        str(min_free_gb),
    ]
    parts += ["--checkpoint-dir", checkpoint_dir] if checkpoint_dir is not None else []
    return f"cd {shlex.quote(os.getcwd())} && " + " ".join(shlex.quote(p) for p in parts)


def check_host(
    host: str,
    local_facts: dict,
    *,
    checkpoint_dir: str | None,
    min_free_gb: float,
    ssh_port: int | None = None,
    connect_timeout: int = 5,
    timeout: float = 120.0,
    slots: int | None = None,
) -> list[Check]:
    argv = ssh_argv(host, _remote_command(checkpoint_dir, min_free_gb), ssh_port, connect_timeout)
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return [Check("ssh", "fail", "no ssh client on this machine", "install openssh-client", host)]
    except subprocess.TimeoutExpired:
        return [
            Check(
                "ssh",
                "fail",
                f"no answer within {timeout:g} s",
                "check the host is up and not overloaded; test with `ssh -o BatchMode=yes HOST true`",
                host,
            )
        ]
    err = (proc.stderr.strip().splitlines() or [""])[-1]
    if proc.returncode == 255:
        return [
            Check(
                "ssh",
                "fail",
                f"not reachable non-interactively: {err or 'ssh exit 255'}",
                "make the name resolve, set up key-based ssh (no password prompt) and accept the host key "
                "once; test with `ssh -o BatchMode=yes HOST true`",
                host,
            )
        ]
    rows = [Check("ssh", "pass", "reachable (BatchMode)", host=host)]
    try:
        report = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        rows.append(
            Check(
                "remote doctor",
                "fail",
                f"exit {proc.returncode}: {err or 'no output'}",
                f"DeepSpeed runs {sys.executable} in {os.getcwd()} on every node: install the same "
                "environment at the same path there",
                host,
            )
        )
        return rows
    for c in report["checks"]:
        rows.append(Check(c["name"], c["status"], c["detail"], c["fix"], host))
    remote = report.get("facts", {})
    rows += slot_checks(slots, remote, host)
    for key in ("python", "torch", "deepspeed", "nccl"):
        if remote.get(key) != local_facts.get(key):
            rows.append(
                Check(
                    f"{key} matches",
                    "fail",
                    f"{remote.get(key)} here, {local_facts.get(key)} on the launching node",
                    f"install the same {key} version on every node",
                    host,
                )
            )
    return rows


def slot_checks(slots: int | None, facts: dict, host: str = "") -> list[Check]:
    """The hostfile's slots=N against the GPUs the host really has (DeepSpeed starts one rank per slot)."""
    if slots is None or facts.get("cpu_only", True):
        return []
    gpus = facts.get("gpus", 0)
    if slots > gpus:
        return [
            Check(
                "slots",
                "fail",
                f"hostfile gives slots={slots} but the host has {gpus} GPU(s)",
                f"set slots={gpus} for this host in the hostfile",
                host,
            )
        ]
    if slots < gpus:
        return [
            Check(
                "slots",
                "warn",
                f"slots={slots} uses {slots} of the host's {gpus} GPUs",
                f"set slots={gpus} to use them all",
                host,
            )
        ]
    return [Check("slots", "pass", f"slots={slots} = GPUs", host=host)]


def run_doctor(
    hostfile: str | None = None,
    *,
    checkpoint_dir: str | None = None,
    min_free_gb: float = DEFAULT_MIN_FREE_GB,
    ssh_port: int | None = None,
    connect_timeout: int = 5,
    host_timeout: float = 120.0,
) -> dict:
    """All checks as a JSON-ready report: {"ok", "cpu_only", "facts", "checks": [Check as dict]}."""
    checks, facts = local_checks(checkpoint_dir, min_free_gb)
    if hostfile is not None:
        from fluxzero.cluster.hostfile import HostfileError, parse_hostfile
        from fluxzero.cluster.launcher import LOCAL_HOSTS

        try:
            hosts = parse_hostfile(hostfile)
        except HostfileError as e:
            checks.append(Check("hostfile", "fail", str(e), "fix the hostfile line named above"))
            hosts = {}
        if hosts:
            checks.append(Check("hostfile", "pass", f"{len(hosts)} host(s), {sum(hosts.values())} slot(s)"))
        if len(hosts) == 1 and next(iter(hosts)) in LOCAL_HOSTS:
            host = next(iter(hosts))
            checks.append(Check("ssh", "pass", "single local host: launched without ssh", host=host))
            checks += slot_checks(hosts[host], facts, host)
        elif hosts:
            if len(hosts) > 1 and not shutil.which("pdsh"):
                checks.append(
                    Check(
                        "pdsh",
                        "warn",
                        "pdsh not found (DeepSpeed's default multi-node launcher)",
                        "apt-get install pdsh, or use fluxzero launch --launcher openmpi|slurm|no-ssh",
                    )
                )
            with ThreadPoolExecutor(max_workers=min(16, len(hosts))) as pool:
                results = pool.map(
                    lambda h: check_host(
                        h,
                        facts,
                        checkpoint_dir=checkpoint_dir,
                        min_free_gb=min_free_gb,
                        ssh_port=ssh_port,
                        connect_timeout=connect_timeout,
                        timeout=host_timeout,
                        slots=hosts[h],
                    ),
                    hosts,
                )
                for rows in results:
                    checks += rows
    return {
        "ok": not any(c.status == "fail" for c in checks),
        "cpu_only": facts["cpu_only"],
        "facts": facts,
        "checks": [asdict(c) for c in checks],
    }


def format_table(report: dict) -> str:
    rows = [("host", "check", "status", "detail", "fix")]
    rows += [(c["host"], c["name"], c["status"].upper(), c["detail"], c["fix"]) for c in report["checks"]]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = []
    for k, r in enumerate(rows):
        fix = ("  (fix)" if k == 0 else f"  -> fix: {r[4]}") if r[4] else ""
        lines.append("  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3] + fix)
    n_fail = sum(c["status"] == "fail" for c in report["checks"])
    n_warn = sum(c["status"] == "warn" for c in report["checks"])
    lines.append("")
    lines.append(
        ("CPU-only machine. " if report["cpu_only"] else "")
        + (f"{n_fail} check(s) failed, {n_warn} warning(s)." if n_fail else f"All checks passed ({n_warn} warning(s)).")
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry for remote hosts: `python -m fluxzero.cluster.doctor --json --local-only`."""
    p = argparse.ArgumentParser(prog="python -m fluxzero.cluster.doctor")
    p.add_argument("--json", action="store_true")
    p.add_argument("--local-only", action="store_true")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--min-free-gb", type=float, default=DEFAULT_MIN_FREE_GB)
    a = p.parse_args(argv)
    report = run_doctor(None, checkpoint_dir=a.checkpoint_dir, min_free_gb=a.min_free_gb)
    print(json.dumps(report) if a.json else format_table(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
