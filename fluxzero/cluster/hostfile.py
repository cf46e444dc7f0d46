"""Pure-Python hostfiles: parse DeepSpeed's `host slots=N` format, apply include/exclude filters, count ranks.

One parser shared by `fluxzero gen-config` (world size for batch arithmetic), `fluxzero launch` and
`fluxzero doctor`. It is stricter than DeepSpeed's own (deepspeed/launcher/runner.py `_parse_hostfile`),
never looser: every file accepted here is accepted by DeepSpeed with the same meaning.

    # comment lines and blank lines are ignored
    worker-0 slots=8
    worker-1 slots=8   # a trailing comment is fine too

Filters use DeepSpeed's syntax, `NODE_SPEC[@NODE_SPEC ...]` with `NODE_SPEC = NAME[:SLOT[,SLOT ...]]`,
and follow deepspeed 0.19.8's `parse_inclusion_exclusion` / `parse_resource_filter` exactly (a test
compares them), except that a filter which leaves nothing to run on is an error here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence

__all__ = [
    "HostfileError",
    "parse_hostfile",
    "parse_hostfile_text",
    "filter_hosts",
    "limit_hosts",
    "world_size",
    "check_host_name",
]

# Letters, digits, '.', '-', '_', not starting with '-' or '.'. Anything else is refused at the door:
# ':' '@' ',' collide with the include/exclude syntax and pdsh host lists, a leading '-' would be read as
# an option by ssh/pdsh/mpirun, and shell metacharacters have no business in a host name.
_HOST_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_SLOTS_RE = re.compile(r"slots=(\S*)")


class HostfileError(ValueError):
    """A hostfile or an include/exclude filter the user has to fix; the message says where and what."""


def check_host_name(name: str) -> str | None:
    """Return None when `name` is an acceptable host name, else the reason it is not."""
    if not name:
        return "an empty host name"
    if len(name) > 253:
        return f"a host name longer than 253 characters ({len(name)})"
    if not _HOST_RE.fullmatch(name):
        return (
            f"host name {name!r} has characters a host name cannot have "
            "(use letters, digits, '.', '-', '_', not starting with '-' or '.'; "
            "IPv6 addresses clash with DeepSpeed's host:slot syntax, use a host name)"
        )
    return None


def parse_hostfile_text(text: str, source: str = "<text>") -> dict[str, int]:
    """Parse hostfile text into an ordered {host: slots}; errors name `source` and the line number."""
    hosts: dict[str, int] = {}
    first_seen: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{lineno}"
        fields = line.split()
        host = fields[0]
        if fields[0].startswith("slots="):
            raise HostfileError(f"{where}: the line starts with {fields[0]!r}; write 'HOST slots=N'.")
        reason = check_host_name(host)
        if reason:
            raise HostfileError(f"{where}: {reason}.")
        if len(fields) == 1:
            raise HostfileError(f"{where}: host {host!r} has no slot count; write '{host} slots=N'.")
        m = _SLOTS_RE.fullmatch(fields[1])
        if not m:
            raise HostfileError(f"{where}: expected 'slots=N' after {host!r}, found {fields[1]!r}.")
        if len(fields) > 2:
            raise HostfileError(
                f"{where}: unexpected {' '.join(fields[2:])!r} after {fields[1]!r}; "
                f"each line is exactly 'HOST slots=N'."
            )
        try:
            slots = int(m.group(1))
        except ValueError:
            raise HostfileError(
                f"{where}: slots must be a whole number, got {m.group(1)!r} for host {host!r}."
            ) from None
        if slots < 1:
            raise HostfileError(
                f"{where}: host {host!r} has slots={slots}; give it at least 1 slot or remove the line."
            )
        if host in hosts:
            raise HostfileError(
                f"{where}: host {host!r} is listed twice (first on line {first_seen[host]}); keep one line per host."
            )
        hosts[host] = slots
        first_seen[host] = lineno
    if not hosts:
        raise HostfileError(f"{source}: no hosts found; add lines like 'worker-0 slots=8'.")
    return hosts


def parse_hostfile(path: str | os.PathLike) -> dict[str, int]:
    """Read and parse a hostfile: ordered {host: slots}."""
    from fluxzero.config.user_files import read_text

    path = os.fspath(path)
    text = read_text(
        path,
        "hostfile",
        "pass the hostfile itself (UTF-8 text, one `host slots=N` line per node)",
        HostfileError,
        missing="check the --hostfile path",
    )
    return parse_hostfile_text(text, source=path)


def _as_slot_lists(hosts: Mapping[str, int | Sequence[int]]) -> dict[str, list[int]]:
    return {h: (list(range(s)) if isinstance(s, int) else list(s)) for h, s in hosts.items()}


def _parse_filter(spec: str, flag: str) -> dict[str, list[int]]:
    """`a:0,1@b` -> {"a": [0, 1], "b": []}; a bare host adds no slots (as DeepSpeed's parse_node_config_list)."""
    out: dict[str, list[int]] = {}
    for node in spec.split("@"):
        if ":" in node:
            if node.count(":") > 1:
                raise HostfileError(f"{flag} {spec!r}: {node!r} has more than one ':'; write HOST:SLOT[,SLOT...].")
            host, slot_text = node.split(":")
            try:
                slots = [int(x) for x in slot_text.split(",")]
            except ValueError:
                raise HostfileError(
                    f"{flag} {spec!r}: slots of {host!r} must be comma-separated whole numbers, got {slot_text!r}."
                ) from None
        else:
            host, slots = node, []
        out[host] = sorted(set(out.get(host, []) + slots))
    return out


def filter_hosts(
    hosts: Mapping[str, int | Sequence[int]], include: str = "", exclude: str = ""
) -> dict[str, list[int]]:
    """Apply a DeepSpeed include or exclude filter: ordered {host: [slot ids]} of the ranks that run.

    `hosts` is what `parse_hostfile` returns (slot counts) or already-resolved slot lists.
    Semantics follow deepspeed 0.19.8 `parse_resource_filter`: include and exclude are mutually
    exclusive; `host` means all its slots; `host:0,2` means those slot ids; a host named twice merges
    its slots (and `a:0@a` is the same as `a:0`); hostfile order is kept.
    """
    pool = _as_slot_lists(hosts)
    if include and exclude:
        raise HostfileError("--include and --exclude are mutually exclusive; use one of them.")
    if not include and not exclude:
        return pool
    flag, spec = ("--include", include) if include else ("--exclude", exclude)
    chosen: dict[str, list[int]] = {} if include else {h: list(s) for h, s in pool.items()}
    known = ", ".join(pool) or "none"
    for host, slots in _parse_filter(spec, flag).items():
        if host not in pool:
            raise HostfileError(f"{flag} {spec!r}: host {host!r} is not in the hostfile (hosts: {known}).")
        for slot in slots:
            if slot not in pool[host]:
                raise HostfileError(f"{flag} {spec!r}: host {host!r} has no slot {slot} (its slots: {pool[host]}).")
        if include:
            chosen[host] = slots if slots else list(pool[host])
        elif slots:
            chosen[host] = [s for s in chosen[host] if s not in slots]
        else:
            chosen[host] = []
    result = {h: chosen[h] for h in pool if chosen.get(h)}
    if not result:
        raise HostfileError(f"{flag} {spec!r} leaves no slot to run on; exclude fewer hosts or slots.")
    return result


def limit_hosts(filtered: Mapping[str, Sequence[int]], num_nodes: int = -1, num_gpus: int = -1) -> dict[str, list[int]]:
    """Keep the first `num_nodes` hosts and slots [0, num_gpus) on each (DeepSpeed's --num_nodes/--num_gpus).

    Unlike DeepSpeed, asking for more nodes or GPUs than the hostfile offers is an error.
    """
    out = {h: list(s) for h, s in filtered.items()}
    if num_nodes > 0:
        if num_nodes > len(out):
            raise HostfileError(f"--num-nodes {num_nodes} is more than the {len(out)} host(s) in the hostfile.")
        out = dict(list(out.items())[:num_nodes])
    if num_gpus > 0:
        short = [h for h, s in out.items() if len(s) < num_gpus]
        if short:
            raise HostfileError(
                f"--num-gpus {num_gpus} is more than the slots of {', '.join(short)}; lower it or fix the hostfile."
            )
        out = {h: list(range(num_gpus)) for h in out}
    return out


def world_size(hosts_or_filtered: Mapping[str, int | Sequence[int]]) -> int:
    """Number of ranks: sum of slot counts, or of slot-list lengths for a filtered mapping."""
    return sum(s if isinstance(s, int) else len(s) for s in hosts_or_filtered.values())
