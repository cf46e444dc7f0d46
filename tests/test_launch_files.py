"""The run files a user copies (launch/*.yaml): each loads with the trainer's own run-file reader, the FLUX.1-dev
ones name the gen-config command that writes the DeepSpeed JSON they point to, and tiny-lora.yaml trains."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fluxzero.config.deepspeed.file import load_for_training
from fluxzero.config.runfile import load_config
from tests.pure_python import BLOCKER

ROOT = Path(__file__).resolve().parents[1]
RUN_FILES = sorted((ROOT / "launch").glob("*.yaml"))
FLUX_DEV = [ROOT / "launch" / "flux-dev-lora.yaml", ROOT / "launch" / "flux-dev-full.yaml"]


def _gen_config_line(path: Path) -> list[str]:
    """The argv of the one `fluxzero gen-config ...` command in the file's leading comment."""
    comment = "\n".join(line.lstrip("# ") for line in path.read_text().splitlines() if line.startswith("#"))
    lines = [c.strip() for c in comment.replace("\\\n", " ").splitlines() if c.startswith("fluxzero gen-config ")]
    assert len(lines) == 1, f"{path.name} must name one `fluxzero gen-config` command in its comment, found {lines}"
    return shlex.split(lines[0])[1:]


def test_the_example_run_files_exist():
    assert {p.name for p in RUN_FILES} >= {"tiny.yaml", "tiny-lora.yaml", "flux-dev-lora.yaml", "flux-dev-full.yaml"}


@pytest.mark.parametrize("path", RUN_FILES, ids=lambda p: p.name)
def test_every_run_file_loads_with_the_trainers_reader(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # paths in run files are relative to the launch folder, the repository root
    cfg = load_config(str(path.relative_to(ROOT)))
    assert cfg.deepspeed and cfg.data and cfg.output_dir
    if path.name in ("tiny-lora.yaml", "flux-dev-lora.yaml"):
        assert cfg.lora is not None and cfg.lora.rank > 0
    if path.name.startswith("flux-dev"):
        assert cfg.model == "flux-dev" and "EDIT" in path.read_text()  # the lines a user changes are marked


@pytest.mark.parametrize("path", FLUX_DEV, ids=lambda p: p.name)
def test_flux_dev_run_files_gen_config_line_writes_their_json_without_torch(path, tmp_path):
    cfg = load_config(str(path))
    argv = _gen_config_line(path)
    assert argv[argv.index("-o") + 1] == cfg.deepspeed, f"{path.name}'s gen-config line must write its deepspeed: file"
    (tmp_path / Path(cfg.deepspeed).parent).mkdir(parents=True, exist_ok=True)
    code = BLOCKER + "import sys\nfrom fluxzero.cli import main\nmain(sys.argv[1:])\n"
    p = subprocess.run(
        [sys.executable, "-c", code, *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert p.returncode == 0, p.stdout + p.stderr
    world = int(argv[argv.index("--world-size") + 1]) if "--world-size" in argv else 1
    _, view = load_for_training(tmp_path / cfg.deepspeed, world)  # the trainer's own checks of the JSON
    assert view.precision == "bf16"


def test_the_lora_run_file_points_a_smaller_gpu_to_fit():
    header = (ROOT / "launch" / "flux-dev-lora.yaml").read_text().split("\ndeepspeed:")[0]
    assert "gen-config --fit --gpu rtx4090 --lora-rank 16" in header and "--offload-param" not in header


def test_tiny_lora_uses_the_quick_starts_deepspeed_config():
    tiny, lora = (load_config(str(ROOT / "launch" / n)) for n in ("tiny.yaml", "tiny-lora.yaml"))
    assert lora.deepspeed == tiny.deepspeed and lora.model == tiny.model == "flux-tiny"
    assert _gen_config_line(ROOT / "launch" / "tiny-lora.yaml") == _gen_config_line(ROOT / "launch" / "tiny.yaml")


@pytest.mark.slow
def test_tiny_lora_trains_on_two_ranks_and_exports_a_lora(tmp_path):
    from fluxzero.model.lora_formats import read_lora

    out = tmp_path / "tiny-lora"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "launch/train.py",
        "--config",
        "launch/tiny-lora.yaml",
        "steps=2",
        "checkpoint.every=0",
        "log_every=1",
        f"output_dir={out}",
    ]
    p = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "done: step 2/2" in p.stderr
    _, info = read_lora(out / "lora.safetensors")
    assert (info.layout, info.rank, info.alpha, info.targets, info.base_model) == (
        "kohya",
        4,
        4.0,
        "attention+mlp",
        "flux-tiny",
    )  # export.format comfyui writes the kohya layout
    assert not (out / "export.safetensors").exists()  # a LoRA run exports the LoRA, not the whole model

    # docs/training.md's check of the tiny LoRA in diffusers, run as written (a flux-tiny base stands in for
    # runs/tiny/export.safetensors)
    from tests.helpers import tiny_weights

    text = (ROOT / "docs" / "training.md").read_text()
    block = text[text.index("to check the tiny LoRA in") :].split("```bash\n")[1].split("```")[0]
    tiny_weights(tmp_path / "base.safetensors")
    block = block.replace("runs/tiny-lora/", f"{out}/").replace(
        "runs/tiny/export.safetensors", str(tmp_path / "base.safetensors")
    )
    for line in block.replace("\\\n", "").strip().splitlines():
        argv = shlex.split(line)
        argv = (
            [sys.executable, "-m", "fluxzero.cli", *argv[1:]] if argv[0] == "fluxzero" else [sys.executable, *argv[1:]]
        )
        p = subprocess.run(
            argv, cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)}
        )
        assert p.returncode == 0, f"{line}: {p.stderr[-3000:]}"
    assert "default_0" in p.stdout  # the adapter diffusers loaded
