"""A DeepSpeed JSON file on disk: read it (one sentence for each way it can be unreadable), and what the trainer
starts from (the checked config and its view). Pure Python; `view` reads dicts, this module reads files.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from fluxzero.config.deepspeed.check import check
from fluxzero.config.deepspeed.view import FLUXZERO_SECTION, DSConfigError, DSView, view
from fluxzero.config.user_files import ParseError, parse_json, read_text


def read_json(path: str | Path) -> dict:
    """A DeepSpeed JSON file as a dict; DSConfigError with one sentence when it cannot be read."""
    text = read_text(
        path,
        "DeepSpeed config",
        "point deepspeed at the JSON file from `fluxzero gen-config`",
        DSConfigError,
        missing="write one with `fluxzero gen-config`",
    )

    def no_duplicates(pairs):  # plain JSON keeps the last of two equal keys silently
        seen = {}
        for key, value in pairs:
            if key in seen:
                raise DSConfigError(
                    f"DeepSpeed config {path} sets {key!r} twice in one object (the last would win silently); keep one"
                )
            seen[key] = value
        return seen

    try:
        ds = parse_json(text, object_pairs_hook=no_duplicates)
    except ParseError as e:
        raise DSConfigError(f"DeepSpeed config {path} is not valid JSON ({e})") from None
    if not isinstance(ds, dict):
        raise DSConfigError(
            f"DeepSpeed config {path} must be a JSON object ({{...}}), got {type(ds).__name__}; "
            f"write one with `fluxzero gen-config`"
        )
    return ds


def load_for_training(path: str | Path, world_size: int) -> tuple[dict, DSView]:
    """What the trainer starts from: (the dict DeepSpeed gets, without the "fluxzero" section; its view).

    Refuses, with the first finding of `fluxzero check-config` in one sentence, a config that check-config
    reports (DeepSpeed accepts some mistakes silently, e.g. a misspelled zero_optimisation trains at ZeRO-0),
    one without gradient_clipping (0.19.8 clips at 1.0 silently) or an optimizer, and batch sizes that do not
    divide for this world size. The batch keys are completed (micro batch, accumulation, global batch), so
    DeepSpeed and the trainer agree on them.
    """
    ds = read_json(path)
    problems = check(ds, world_size)
    if problems:
        more = f" ({len(problems) - 1} more; run `fluxzero check-config {path}`)" if len(problems) > 1 else ""
        raise DSConfigError(f"DeepSpeed config {path}: {problems[0]}{more}")
    v = view(ds)
    if v.optimizer is None:
        raise DSConfigError(
            f"DeepSpeed config {path} has no optimizer section; add one (e.g. from `fluxzero gen-config`)"
        )
    try:
        micro, accum, train = v.batch_for(world_size)
    except DSConfigError as e:
        raise DSConfigError(f"DeepSpeed config {path}: {e}") from None
    ds = {k: val for k, val in ds.items() if k != FLUXZERO_SECTION}
    ds.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accum, train_batch_size=train)
    return ds, dataclasses.replace(v, micro_batch=micro, grad_accum=accum, global_batch=train)
