"""Hostfile parsing and DeepSpeed include/exclude filters (fluxzero.cluster.hostfile is pure Python)."""

from __future__ import annotations

import pytest

from fluxzero.cluster.hostfile import (
    HostfileError,
    filter_hosts,
    limit_hosts,
    parse_hostfile,
    parse_hostfile_text,
    world_size,
)
from tests.pure_python import run_without_torch

GOOD = """\
# two nodes
worker-0 slots=4

worker-1\tslots=2   # trailing comment
   10.0.0.7 slots=1
"""


def test_parse_order_comments_blank_lines(tmp_path):
    p = tmp_path / "hosts"
    p.write_text(GOOD)
    hosts = parse_hostfile(p)
    assert list(hosts.items()) == [("worker-0", 4), ("worker-1", 2), ("10.0.0.7", 1)]
    assert world_size(hosts) == 7
    assert parse_hostfile(str(p)) == hosts


@pytest.mark.parametrize(
    "text, line, words",
    [
        ("a slots=1\nb slots=2\na slots=3\n", 3, ["'a'", "twice", "line 1"]),
        ("a slots=0\n", 1, ["slots=0", "at least 1"]),
        ("# c\na slots=-2\n", 2, ["slots=-2"]),
        ("a slots=x\n", 1, ["whole number", "'x'"]),
        ("a slots=\n", 1, ["whole number"]),
        ("a\n", 1, ["no slot count"]),
        ("a 4\n", 1, ["slots=N", "'4'"]),
        ("a slots=2 max_slots=4\n", 1, ["max_slots=4"]),
        ("slots=2\n", 1, ["HOST slots=N"]),
        ("a slots=1\n\nb;touch x slots=1\n", 3, ["characters"]),
        ("-oProxyCommand=x slots=1\n", 1, ["characters"]),
        ("fe80::1 slots=1\n", 1, ["IPv6"]),
        ("a@b slots=1\n", 1, ["characters"]),
    ],
)
def test_parse_errors_name_file_and_line(tmp_path, text, line, words):
    p = tmp_path / "myhosts"
    p.write_text(text)
    with pytest.raises(HostfileError) as ei:
        parse_hostfile(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}:{line}: "), msg
    for w in words:
        assert w in msg, (w, msg)


def test_parse_text_source_and_empty():
    with pytest.raises(HostfileError, match=r"^<text>:2: "):
        parse_hostfile_text("a slots=1\na slots=1")
    with pytest.raises(HostfileError, match=r"^cfg: no hosts"):
        parse_hostfile_text("# nothing\n\n", source="cfg")
    assert parse_hostfile_text("localhost slots=2", source="x") == {"localhost": 2}
    assert issubclass(HostfileError, ValueError)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(HostfileError, match="does not exist"):
        parse_hostfile(tmp_path / "nope")
    with pytest.raises(HostfileError, match="is a folder; pass the hostfile itself"):
        parse_hostfile(tmp_path)


def test_accepted_files_mean_the_same_to_deepspeed():
    from deepspeed.launcher.runner import _parse_hostfile

    assert dict(_parse_hostfile(GOOD.splitlines())) == parse_hostfile_text(GOOD)


POOL = {"a": 4, "b": 2, "c": 3}

# (include, exclude) pairs covering DeepSpeed's cases: bare hosts, slot lists, repeats, merges, order.
FILTERS = [
    ("", ""),
    ("a", ""),
    ("c@a", ""),
    ("a:0,2", ""),
    ("a:2,0@b", ""),
    ("a:1@a:3@a:1", ""),
    ("a@a:1", ""),  # a bare host merged with a slot list means just those slots
    ("b:1@c:0,1,2", ""),
    ("", "a"),
    ("", "b:0"),
    ("", "a:0,1@c"),
    ("", "a:0@a"),
    ("", "c:2@c:0"),
    # errors
    ("a", "b"),
    ("x", ""),
    ("", "x"),
    ("a:4", ""),
    ("", "b:2"),
    ("a:-1", ""),
    ("a:", ""),
    ("a:x", ""),
    ("a:1:2", ""),
    ("a@", ""),
    ("", "a@b@c"),
    ("", "a:0,1,2,3@b@c"),
]


@pytest.mark.parametrize("include, exclude", FILTERS)
def test_filter_matches_deepspeed(include, exclude):
    from deepspeed.launcher.runner import parse_inclusion_exclusion

    try:
        expected = dict(parse_inclusion_exclusion(dict(POOL), include, exclude))
    except ValueError:
        expected = ValueError
    if expected is ValueError or expected == {}:
        # DeepSpeed returns {} when everything is excluded; we refuse that with a message instead.
        with pytest.raises(HostfileError) as ei:
            filter_hosts(POOL, include, exclude)
        assert ("--include" in str(ei.value)) or ("--exclude" in str(ei.value))
    else:
        got = filter_hosts(POOL, include, exclude)
        assert got == expected
        assert list(got) == list(expected)  # order of ranks follows the hostfile


def test_filter_examples_and_world_size():
    assert filter_hosts(POOL, include="c@a:1,3") == {"a": [1, 3], "c": [0, 1, 2]}
    f = filter_hosts(POOL, exclude="a:0@c")
    assert f == {"a": [1, 2, 3], "b": [0, 1]}
    assert world_size(f) == 5
    assert world_size(POOL) == 9
    assert filter_hosts({"a": [0, 2]}, exclude="a:2") == {"a": [0]}
    with pytest.raises(HostfileError, match="not in the hostfile.*hosts: a, b, c"):
        filter_hosts(POOL, include="d")
    with pytest.raises(HostfileError, match="has no slot 7"):
        filter_hosts(POOL, exclude="b:7")
    with pytest.raises(HostfileError, match="leaves no slot"):
        filter_hosts(POOL, exclude="a@b@c")


def test_limit_hosts_matches_deepspeed_and_checks_bounds():
    from deepspeed.launcher.runner import apply_num_nodes_and_gpus

    full = filter_hosts(POOL)
    for n, g in [(-1, -1), (2, -1), (-1, 2), (1, 1), (3, 2)]:
        assert limit_hosts(full, n, g) == dict(apply_num_nodes_and_gpus(dict(full), n, g))
    with pytest.raises(HostfileError, match="--num-nodes 4"):
        limit_hosts(full, num_nodes=4)
    with pytest.raises(HostfileError, match="--num-gpus 3.*b"):
        limit_hosts(full, num_gpus=3)


def test_import_is_pure():
    """The module must load where torch and deepspeed cannot be imported (gen-config runs without them)."""
    out = run_without_torch("""
        from fluxzero.cluster.hostfile import parse_hostfile_text, filter_hosts, world_size
        print(world_size(filter_hosts(parse_hostfile_text('a slots=2'), include='a:1')))
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"
