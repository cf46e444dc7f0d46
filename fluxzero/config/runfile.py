"""The run file on disk: YAML plus `key=value` overrides -> TrainConfig, and back to YAML for checkpoints.

Pure Python (pyyaml imported inside the calls): the config package stays import-light.
"""

from __future__ import annotations

from pathlib import Path

from fluxzero.config.run import TrainConfig
from fluxzero.config.sections import MOVED_TO_SECTIONS, nest_moved_keys
from fluxzero.config.user_files import ParseError, excerpt, parse_yaml, read_text


def _parse_value(item: str, text: str):
    """The VALUE of override `item` (KEY=VALUE) as YAML reads it ("" when empty)."""
    try:
        return parse_yaml(text) if text.strip() else ""
    except ParseError as e:
        raise ConfigError(f"override {excerpt(item)}: the value is not valid YAML ({e})") from None


class ConfigError(ValueError):
    """The run file or its overrides are invalid; the message names the key and the fix."""


def load_config(path: str | None, overrides: list[str] = ()) -> TrainConfig:
    """YAML run file + `key=value` overrides (dotted keys for sections, e.g. flow.shift=none)."""
    try:
        return _load_config(path, overrides)
    except ConfigError:
        raise
    except ValueError as e:  # TrainConfig / FlowConfig validation
        raise ConfigError(str(e)) from None


def _load_config(path, overrides) -> TrainConfig:
    data = {}
    if path:
        text = read_text(path, "run file", "pass a YAML run file such as launch/tiny.yaml", ConfigError)
        try:
            data = parse_yaml(text, unique_keys=True) or {}
        except ParseError as e:
            raise ConfigError(f"run file {path} is not valid YAML ({e})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"run file {path} must be a mapping of settings")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} must look like key=value")
        *parents, leaf = key.strip().split(".")
        node = data
        for i, p in enumerate(parents):
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(
                    f"override {item!r}: {'.'.join(parents[: i + 1])} is a value, not a section; "
                    f"write {'.'.join(parents[: i + 1])}=VALUE"
                )
        node[leaf] = _parse_value(item, value)
    return TrainConfig.from_dict(data)


def config_text(cfg: TrainConfig) -> str:
    import yaml

    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def read_saved_run(path, fix: str, error: type[Exception]) -> dict:
    """The run.yaml saved beside a checkpoint as a dict, {} when there is none: the one reader for resume and export.

    The flat keys of an older run.yaml (checkpoint_every, sample_vae, export_format, ...) come back in their
    sections (config.sections.nest_moved_keys), so a checkpoint saved before the sections resumes and exports
    as one saved after. Unreadable, not YAML or not a mapping is `error(sentence)`, the sentence ending in `fix`
    (what to do instead).
    """
    try:
        saved = parse_yaml(Path(path).read_text())
    except FileNotFoundError:
        return {}
    except ParseError as e:
        raise error(f"{path} is not valid YAML ({e}); {fix}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"cannot read {path} ({getattr(e, 'strerror', None) or e}); {fix}") from None
    if not isinstance(saved, dict):
        raise error(f"{path} is not a mapping of settings; {fix}")
    return nest_moved_keys(saved)


def override_key(flag: str) -> str:
    """The KEY of KEY=VALUE that a command-line flag such as `--steps` or `--export-format` stands for (a key
    that moved into a section by its new name: export.format)."""
    name = flag.lstrip("-").split("=")[0].replace("-", "_")
    return MOVED_TO_SECTIONS.get(name, name)


def split_allow(overrides: list[str]) -> tuple[list[str], bool]:
    """allow_config_change=true|false is a switch for this one start, not a run-file setting: it is never
    saved with a checkpoint, so the next resume checks against the new values again."""
    rest, allow = [], False
    for item in overrides:
        key, sep, value = item.partition("=")
        if key.strip() != "allow_config_change" or not sep:
            rest.append(item)
            continue
        allow = _parse_value(item, value)
        if not isinstance(allow, bool):
            raise ConfigError(f"allow_config_change must be true or false, got {excerpt(value)}")
    return rest, allow
