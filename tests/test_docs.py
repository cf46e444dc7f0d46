"""README.md and docs/*.md: every relative link names a file of the repository, and every #anchor a heading of it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces to '-' (code blocks skipped)."""
    out, fence = set(), False
    for line in text.splitlines():
        fence ^= line.startswith("```")
        if not fence and line.startswith("#"):
            out.add(re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-"))
    return out


def _broken(doc: Path) -> list[str]:
    broken = []
    for link in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if link.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = link.partition("#")
        target = (doc.parent / path).resolve() if path else doc
        if not target.exists():
            broken.append(f"{link} (no such file)")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target.read_text()):
            broken.append(f"{link} (no such heading)")
    return broken


def test_the_reference_docs_exist():
    assert {p.name for p in DOCS} >= {
        "README.md",
        "cli.md",
        "memory.md",
        "multi-node.md",
        "lora.md",
        "training.md",
        "optimizer-modes.md",
        "troubleshooting.md",
        "data.md",
        "benchmarks.md",
    }


BENCHMARK_DOCS = [
    ROOT / "benchmarks" / "README.md",
    ROOT / "benchmarks" / "RESULTS.md",
    ROOT / "benchmarks" / "archive" / "README.md",
]


@pytest.mark.parametrize("doc", DOCS + BENCHMARK_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(doc):
    assert not _broken(doc), f"{doc.relative_to(ROOT)}: broken links {_broken(doc)}"


def test_the_link_check_can_fail(tmp_path):
    (tmp_path / "a.md").write_text("# Title here\n[ok](#title-here) [x](missing.md) [y](a.md#nowhere)\n")
    assert _broken(tmp_path / "a.md") == ["missing.md (no such file)", "a.md#nowhere (no such heading)"]


def test_the_readme_is_a_first_screen():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def _undocumented(cls, text: str, prefix: str = "") -> list[str]:
    import dataclasses

    return [
        f.name for f in dataclasses.fields(cls) if not re.search(rf"`{re.escape(prefix + f.name)}[`.]", text)
    ]  # `flow.shift` documents `flow`


def test_every_run_file_key_is_documented():
    """A run-file key users cannot find is a key they cannot use: training.md's table, lora.md's for `lora:`."""
    from fluxzero.config import TrainConfig
    from fluxzero.config.ema import EmaConfig
    from fluxzero.config.lora import LoraConfig
    from fluxzero.config.run import FlowConfig
    from fluxzero.config.sections import SECTIONS

    training = (ROOT / "docs" / "training.md").read_text()
    assert not _undocumented(TrainConfig, training), "document these run-file keys in docs/training.md"
    assert not _undocumented(FlowConfig, training, "flow."), "document these flow keys in docs/training.md"
    assert not _undocumented(EmaConfig, training, "ema."), "document these ema keys in docs/training.md"
    for name, cls in SECTIONS.items():
        assert not _undocumented(cls, training, f"{name}."), f"document these {name} keys in docs/training.md"
    assert not _undocumented(LoraConfig, (ROOT / "docs" / "lora.md").read_text()), "document these in docs/lora.md"
    assert _undocumented(TrainConfig, "`deepspeed` `data`") != []  # the check can fail


def test_the_readme_s_skipped_image_size_is_the_cache_s_rule():
    """The README's "(N px here)" for the `fluxzero cache ... --resolution R` it shows is what the cache skips."""
    from fluxzero.data.buckets import make_buckets
    from fluxzero.data.cache import default_min_image_side

    text = (ROOT / "README.md").read_text()
    resolution = int(re.search(r"fluxzero cache \S+ \S+ .*--resolution (\d+)", text).group(1))
    said = int(re.search(r"smallest bucket side \((\d+) px here\)", text).group(1))
    assert said == default_min_image_side(make_buckets(resolution)), "README.md: the skipped image size is wrong"


def test_install_hints_name_the_extras_one_way():
    """`pip install -e '.[X]'` works from a clone; fluxzero is not on PyPI, so `fluxzero[X]` would not."""
    texts = {
        p: p.read_text()
        for p in [*DOCS, *(ROOT / "fluxzero").rglob("*.py"), *(ROOT / "launch").glob("*")]
        if p.is_file()
    }
    extras = re.compile(r"pip install (?:-U )?(?:-e )?['\"]?([\w.]*)\[")
    wrong = sorted(
        {
            f"{p.relative_to(ROOT)}: {m.group(0)}"
            for p, t in texts.items()
            for m in extras.finditer(t)
            if m.group(1) != "." or "-e" not in m.group(0)
        }
    )
    assert not wrong, wrong


def test_the_tiny_paths_say_what_they_need():
    """The quick start's LoRA names its extra; the no-weights walkthrough names the run file for its shards and the
    sample flags that suit flux-tiny on a CPU (sample's defaults are FLUX.1's)."""
    text = " ".join((ROOT / "README.md").read_text().split())
    lora = text[text.index("`launch/tiny-lora.yaml` does the same for a LoRA") :][:200]
    assert "pip install -e '.[lora]'" in lora, lora
    tiny = text[text.index("`fluxzero tiny-encoders tiny/`") :][:900]
    assert "launch/tiny-lora.yaml data=shards/" in tiny and "--width 256 --height 256 --steps 4" in tiny, tiny
