"""Named NCCL environment profiles, each variable with the reason it is set (pure Python).

The default is to set almost nothing: NCCL reads the topology (NVLink, NVSwitch, PCIe, NICs) and picks
algorithm (Ring/Tree/...), protocol (LL/LL128/Simple), channels and transports per collective and per
message size. A profile only sets what NCCL cannot know (which NIC is the right one, that there is no
InfiniBand) or what helps a class of networks it does not tune for (plain TCP sockets).

NCCL_NVLS_ENABLE=0 is in every profile and cannot be overridden: NVLink SHARP / multicast is kept off.

Forcing NCCL_ALGO / NCCL_PROTO is a diagnostic, never a tuning: `Ring`+`Simple` everywhere gives up the
low-latency LL/LL128 protocols for small and medium messages (ZeRO-3's per-layer all-gathers) and Tree's
log-depth latency across many nodes. `benchmarks/nccl_profiles.py` measures this; results are recorded in
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["NcclVar", "NcclProfile", "PROFILES", "PROFILE_NAMES", "profile_env", "profiles_markdown", "NcclError"]

ALWAYS = {"NCCL_NVLS_ENABLE": "0"}


class NcclError(ValueError):
    """An unknown profile name or a forbidden NCCL setting."""


@dataclass(frozen=True)
class NcclVar:
    name: str
    value: str
    why: str


@dataclass(frozen=True)
class NcclProfile:
    name: str
    summary: str
    vars: tuple[NcclVar, ...]
    site_vars: tuple[str, ...] = ()  # set these yourself with `--env NAME=VALUE` (values depend on the cluster)
    diagnostic: bool = False  # for measurements and bug hunts, not for production runs

    def env(self) -> dict[str, str]:
        return {v.name: v.value for v in self.vars}


_NVLS = NcclVar(
    "NCCL_NVLS_ENABLE",
    "0",
    "NVLink SHARP / multicast stays off (project rule): it reserves extra GPU memory and has caused hangs "
    "and init failures on some driver/fabric-manager combinations.",
)

PROFILES: dict[str, NcclProfile] = {
    p.name: p
    for p in (
        NcclProfile(
            "default",
            "NCCL's own choices everywhere; only NVLS is turned off. Right for most clusters.",
            (_NVLS,),
        ),
        NcclProfile(
            "nvlink-single-node",
            "One node with NVLink/NVSwitch (e.g. 8x H100/H200 HGX). NCCL already picks NVLink P2P and the "
            "best algorithm/protocol per size, so nothing else is set on purpose.",
            (_NVLS,),
        ),
        NcclProfile(
            "infiniband",
            "Several nodes on InfiniBand or RoCE with GPUDirect RDMA.",
            (
                _NVLS,
                NcclVar(
                    "NCCL_IB_DISABLE",
                    "0",
                    "Use the IB/RoCE transport even if a base image exported NCCL_IB_DISABLE=1; "
                    "falling back to TCP sockets costs most of the inter-node bandwidth.",
                ),
            ),
            site_vars=(
                "NCCL_IB_HCA (only the compute-rail HCAs, e.g. =mlx5_0,mlx5_1, when storage or management "
                "NICs are also IB devices)",
                "NCCL_SOCKET_IFNAME (interface for NCCL's bootstrap sockets, e.g. =eth0, when several "
                "IP interfaces exist)",
                "NCCL_TOPO_FILE (the cloud's topology XML on VMs whose PCI tree is virtualised, e.g. Azure ND)",
                "NCCL_IB_GID_INDEX (RoCE only: the RoCE v2 GID index, often 3)",
            ),
        ),
        NcclProfile(
            "ethernet",
            "Several nodes on plain TCP/Ethernet (no IB, no RoCE, no EFA plugin).",
            (
                _NVLS,
                NcclVar(
                    "NCCL_IB_DISABLE",
                    "1",
                    "Skip the IB/RoCE probe so a half-configured RDMA device is never picked.",
                ),
                NcclVar(
                    "NCCL_SOCKET_NTHREADS",
                    "4",
                    "CPU helper threads per network connection (default 1). NCCL's documentation suggests 4 "
                    "for generic 100G networks; one thread cannot fill a fast NIC.",
                ),
                NcclVar(
                    "NCCL_NSOCKS_PERTHREAD",
                    "4",
                    "Sockets per helper thread (default 1); 4x4 = 16 parallel streams per connection "
                    "(NCCL caps threads x sockets at 64). More streams ride out per-flow limits of TCP.",
                ),
            ),
            site_vars=(
                "NCCL_SOCKET_IFNAME (the data interface, e.g. =eth0 or =ens5; without it NCCL picks the "
                "first non-loopback, non-docker interface, which may be a slow management NIC)",
            ),
        ),
        NcclProfile(
            "debug",
            "Add to any profile (e.g. ethernet+debug) to see why NCCL hangs or picks a slow path.",
            (
                _NVLS,
                NcclVar("NCCL_DEBUG", "INFO", "Log version, transports, rings/trees and errors at init."),
                NcclVar(
                    "NCCL_DEBUG_SUBSYS",
                    "INIT,NET,ENV",
                    "Limit logging to init, network selection and the NCCL_* variables NCCL actually read.",
                ),
            ),
        ),
        NcclProfile(
            "ring-simple",
            "Diagnostic only: force Ring + Simple, overriding NCCL's per-size choice (no gain measured on one "
            "NVLink node); use it to rule out an algorithm/protocol bug, then remove it.",
            (
                _NVLS,
                NcclVar("NCCL_ALGO", "Ring", "Force the ring algorithm (NCCL would choose per size and scale)."),
                NcclVar(
                    "NCCL_PROTO",
                    "Simple",
                    "Force the Simple protocol (NCCL uses LL/LL128 for lower latency on small messages).",
                ),
            ),
            diagnostic=True,
        ),
    )
}
PROFILE_NAMES = tuple(PROFILES)

_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def profile_env(spec: str = "default") -> dict[str, str]:
    """Environment of a profile, or of several joined with '+', e.g. "ethernet+debug".

    NCCL_NVLS_ENABLE=0 is always present. Profiles that set one variable to different values contradict
    each other (infiniband+ethernet) and are refused.
    """
    env: dict[str, str] = {}
    source: dict[str, str] = {}
    for name in (spec or "default").split("+"):
        name = name.strip()
        if name not in PROFILES:
            raise NcclError(
                f"unknown NCCL profile {name!r}; choose from {', '.join(PROFILE_NAMES)} (join several with '+')."
            )
        for key, value in PROFILES[name].env().items():
            if key in env and env[key] != value:
                raise NcclError(
                    f"NCCL profiles {source[key]!r} and {name!r} contradict each other ({key}="
                    f"{env[key]} vs {value}); pick one of them."
                )
            env[key], source[key] = value, name
    env.update(ALWAYS)
    return env


def check_user_env(env: dict[str, str]) -> None:
    """Refuse user settings that break the project's NCCL rules (NVLS stays off)."""
    for key, value in env.items():
        if not _NAME_RE.fullmatch(key):
            raise NcclError(f"{key!r} is not a valid environment variable name.")
        if key == "NCCL_NVLS_ENABLE" and value != "0":
            raise NcclError("NCCL_NVLS_ENABLE must stay 0 (NVLink SHARP / multicast is not used by fluxzero).")


def profiles_markdown() -> str:
    """docs/multi-node.md's NCCL profile table (a test keeps that file and the code identical)."""
    rows = ["| profile | for | sets | add yourself with `--env` |", "| --- | --- | --- | --- |"]
    for p in PROFILES.values():
        sets = "<br>".join(f"`{v.name}={v.value}`: {v.why}" for v in p.vars)
        site = "<br>".join(p.site_vars) or "-"
        rows.append(f"| `{p.name}` | {p.summary} | {sets} | {site} |")
    return "\n".join(rows) + "\n"
