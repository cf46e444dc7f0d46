"""Every registered command: `--help` works, and every option is documented in docs/cli.md, the command reference.

New commands are covered as soon as they are added to fluxzero.cli.COMMANDS.
"""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from fluxzero.cli import COMMANDS, main

CLI_DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def _commands():
    """(path, click command) for every registered command and, for groups, every subcommand."""
    ctx = click.Context(main)
    out = []

    def walk(path, cmd):
        out.append((path, cmd))
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(ctx):
                walk(path + [name], cmd.get_command(ctx, name))

    for name in sorted(COMMANDS):
        walk([name], main.get_command(ctx, name))
    return out


def _reference_sections() -> dict[str, str]:
    """'## fluxzero <cmd ...>' heading of docs/cli.md -> its text (up to the next '## ' heading)."""
    text = CLI_DOC.read_text()
    assert text.startswith("# Command reference"), "docs/cli.md must start with '# Command reference'"
    sections = {}
    for part in re.split(r"^(?=## )", text, flags=re.M):
        head = re.match(r"## fluxzero ([\w-]+(?: [\w-]+)*)", part)
        if head:
            sections[head.group(1)] = part
    return sections


COMMAND_PATHS = [" ".join(path) for path, _ in _commands()]


def test_commands_are_registered():
    assert {"gen-config", "check-config"} <= set(COMMANDS)
    r = CliRunner().invoke(main, ["--help"])
    assert r.exit_code == 0
    for name in COMMANDS:
        assert name in r.output


@pytest.mark.parametrize("path", COMMAND_PATHS)
def test_help_works(path):
    r = CliRunner().invoke(main, path.split() + ["--help"])
    assert r.exit_code == 0, r.output
    assert r.output.startswith("Usage:") and "--help" in r.output


@pytest.mark.parametrize("path", COMMAND_PATHS)
def test_every_option_is_in_the_cli_doc(path):
    cmd = dict((" ".join(p), c) for p, c in _commands())[path]
    sections = _reference_sections()
    words = path.split()
    # options of `cache build` may be documented under '## fluxzero cache build' or '## fluxzero cache'
    text = "\n".join(t for head, t in sections.items() if head.split() == words[: len(head.split())])
    assert text, f"docs/cli.md has no '## fluxzero {path}' section"
    missing = []
    for param in cmd.params:
        if not isinstance(param, click.Option) or param.hidden:
            continue
        for opt in param.opts + param.secondary_opts:
            if opt in ("-h", "--help"):
                continue
            if not re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", text):
                missing.append(opt)
    assert not missing, f"document these options of `fluxzero {path}` in docs/cli.md: {', '.join(missing)}"


def test_the_cli_doc_check_can_fail():
    """The option search must not be fooled by prefixes (--lr inside --lr-warmup) or by other sections."""
    sections = _reference_sections()
    text = sections["gen-config"]
    assert re.search(r"(?<![\w-])--lr(?![\w-])", text)
    assert not re.search(r"(?<![\w-])--lr(?![\w-])", "use --lr-warmup here")
    assert "--ssh-timeout" not in text  # a doctor option: sections do not leak into each other


@pytest.mark.parametrize("command", ["sample", "encode-prompts"])
def test_sampling_without_the_cache_extra_names_it(command, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "diffusers", None)  # find_spec and import then fail as if not installed
    monkeypatch.setitem(sys.modules, "transformers", None)
    (tmp_path / "w.safetensors").write_bytes(b"")
    args = {
        "sample": ["sample", str(tmp_path / "w.safetensors"), "--out", str(tmp_path / "o")],
        "encode-prompts": ["encode-prompts", str(tmp_path / "p.safetensors")],
    }[command]
    r = CliRunner().invoke(main, [*args, "--prompt", "a dog", "--flux-dir", str(tmp_path)])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert (
        f"fluxzero {command} needs transformers, diffusers, which are not installed; install them with pip "
        "install -e '.[cache]'." in r.output
    ), r.output
    assert not (tmp_path / "o").exists()


def test_commands_that_only_import_deepspeed_do_not_print_its_accelerator_note():
    """DeepSpeed's import logs "Setting accelerator to CPU" on a machine without a GPU; check-config uses none."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run(
        [sys.executable, "-m", "fluxzero.cli", "check-config", "launch/tiny-zero2.json"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and ": OK" in r.stdout, r.stderr
    assert "Setting accelerator" not in r.stderr, r.stderr
