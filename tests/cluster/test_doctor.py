"""`fluxzero doctor` on this machine, against unreachable hosts, and through ssh to a "remote" host."""

from __future__ import annotations

import json
import os
import stat
import time

from click.testing import CliRunner

from fluxzero.cluster.doctor import format_table, run_doctor
from fluxzero.commands.launch import doctor


def rows(report, host="local"):
    return {c["name"]: c for c in report["checks"] if c["host"] == host}


def test_local_checks_on_this_machine(tmp_path):
    report = run_doctor(checkpoint_dir=str(tmp_path / "ck" / "new"), min_free_gb=0)
    r = rows(report)
    for name in ("python", "torch", "deepspeed", "/dev/shm", "checkpoint disk", "op fused_adam", "op cpu_adam"):
        assert name in r, name
    assert r["python"]["status"] == r["torch"]["status"] == r["deepspeed"]["status"] == "pass"
    assert r["checkpoint disk"]["status"] == "pass" and str(tmp_path) in r["checkpoint disk"]["detail"]
    for c in report["checks"]:
        assert c["status"] in ("pass", "warn", "fail", "skip")
        assert c["status"] == "pass" or c["status"] == "skip" or c["fix"], c  # every problem has a fix
    import torch

    if not torch.cuda.is_available():
        assert report["cpu_only"] and "CPU-only machine" in r["cuda"]["detail"]
        assert "CPU-only machine" in format_table(report)


def test_too_little_disk_is_a_failure_with_a_fix(tmp_path):
    report = run_doctor(checkpoint_dir=str(tmp_path), min_free_gb=1e9)
    c = rows(report)["checkpoint disk"]
    assert c["status"] == "fail" and "--checkpoint-dir" in c["fix"]
    assert not report["ok"]


def test_without_a_checkpoint_dir_the_disk_is_shown_not_checked(tmp_path, monkeypatch):
    """A fresh machine has no run yet: doctor shows the free disk here and fails no row for it."""
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(doctor, ["--json", "--min-free-gb", "1e9"])
    report = json.loads(r.output)
    (disk,) = [c for c in report["checks"] if c["name"] in ("disk", "checkpoint disk")]
    assert disk["name"] == "disk" and disk["status"] == "pass" and "not checked" in disk["detail"], disk
    assert str(tmp_path) in disk["detail"] and "--checkpoint-dir" in disk["detail"]
    assert r.exit_code == (0 if report["ok"] else 1) and report["ok"] == all(
        c["status"] != "fail" for c in report["checks"]
    )
    assert not (tmp_path / "checkpoints").exists()


def test_unreachable_hosts_fail_fast_without_hanging(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("no-such-node-1.invalid slots=8\nno-such-node-2.invalid slots=8\n")
    t0 = time.monotonic()
    r = CliRunner().invoke(doctor, ["--hostfile", str(hf), "--ssh-timeout", "2", "--min-free-gb", "0", "--json"])
    assert time.monotonic() - t0 < 60
    assert r.exit_code == 1, r.output
    report = json.loads(r.output)
    for host in ("no-such-node-1.invalid", "no-such-node-2.invalid"):
        ssh = rows(report, host)["ssh"]
        assert ssh["status"] == "fail" and "BatchMode" in ssh["fix"]


def test_bad_hostfile_is_a_failed_row(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("a slots=0\n")
    report = run_doctor(str(hf), min_free_gb=0)
    c = rows(report)["hostfile"]
    assert c["status"] == "fail" and f"{hf}:1:" in c["detail"]


def test_remote_host_checked_through_ssh(tmp_path, monkeypatch):
    """A stand-in `ssh` runs the remote command with a local shell: quoting, remote JSON and version comparison
    are all exercised for real."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "ssh"
    fake.write_text(
        '#!/bin/sh\nwhile [ "$1" != "--" ]; do shift; done\nshift; echo "$1" >> "$SSH_LOG"; shift\nexec sh -c "$1"\n'
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SSH_LOG", str(tmp_path / "ssh.log"))
    hf = tmp_path / "hosts"
    hf.write_text("node-a slots=2\nnode-b slots=2\n")
    report = run_doctor(str(hf), checkpoint_dir=str(tmp_path), min_free_gb=0, connect_timeout=2)
    assert sorted((tmp_path / "ssh.log").read_text().split()) == ["node-a", "node-b"]
    for host in ("node-a", "node-b"):
        r = rows(report, host)
        assert r["ssh"]["status"] == "pass"
        assert r["python"]["status"] == "pass" and r["deepspeed"]["status"] == "pass"
        assert not any(name.endswith("matches") for name in r)  # same versions as here


def test_hostfile_slots_against_the_gpus_a_host_has():
    from fluxzero.cluster.doctor import slot_checks

    gpu_host = {"cpu_only": False, "gpus": 4}
    (c,) = slot_checks(8, gpu_host, "node-a")
    assert c.status == "fail" and c.fix == "set slots=4 for this host in the hostfile"
    assert slot_checks(2, gpu_host)[0].status == "warn"
    assert slot_checks(4, gpu_host)[0].status == "pass"
    assert slot_checks(2, {"cpu_only": True, "gpus": 0}) == []  # CPU ranks (gloo) have no GPU count to match
