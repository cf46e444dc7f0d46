"""Run DeepSpeed's own config parser on a config dict, with no GPU, no process group and no engine.

deepspeed is imported inside the functions: importing it costs seconds, and `fluxzero gen-config` must not.
"""

from __future__ import annotations

import contextlib
import copy
import logging


@contextlib.contextmanager
def _world(world_size: int):
    """Make deepspeed.comm answer rank 0 of `world_size` while DeepSpeedConfig reads them.

    DeepSpeedConfig asks deepspeed.comm.get_rank()/get_world_size() for the batch arithmetic and falls back
    to world size 1 when no process group exists; patching the two module attributes lets us check
    train_batch_size = micro x accumulation x N for any N without starting N processes.
    """
    import deepspeed.comm as dist

    saved = dist.get_rank, dist.get_world_size
    dist.get_rank = lambda *args, **kwargs: 0
    dist.get_world_size = lambda *args, **kwargs: world_size
    try:
        yield
    finally:
        dist.get_rank, dist.get_world_size = saved


def parse(cfg: dict, world_size: int = 1):
    """deepspeed.runtime.config.DeepSpeedConfig for `cfg` at `world_size` (raises what DeepSpeed raises)."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils import logger

    level = logger.level
    logger.setLevel(logging.WARNING)  # the parser logs its whole input at INFO
    try:
        with _world(world_size):
            return DeepSpeedConfig(copy.deepcopy(cfg))
    finally:
        logger.setLevel(level)


def deepspeed_problems(cfg: dict, world_size: int = 1) -> list[str]:
    """[] when DeepSpeed's parser accepts `cfg`, else its complaint as one-line problems ("deepspeed: ...")."""
    try:
        parse(cfg, world_size)
    except Exception as e:  # noqa: BLE001 - the parser raises AssertionError, ValueError, pydantic errors, ...
        return [f"deepspeed: {line}" for line in _lines(e)]
    return []


# pydantic model name -> the config section it parses
_SECTIONS = {
    "DeepSpeedZeroConfig": "zero_optimization",
    "DeepSpeedBF16Config": "bf16",
    "DeepSpeedFP16Config": "fp16",
    "TensorBoardConfig": "tensorboard",
}


def _lines(e: Exception) -> list[str]:
    errors = getattr(e, "errors", None)
    if callable(errors):  # pydantic ValidationError: one line per field
        try:
            out = []
            for err in errors():
                loc = ".".join(str(x) for x in err.get("loc", ()))
                title = getattr(e, "title", "")
                where = ".".join(x for x in (_SECTIONS.get(title, title), loc) if x)
                out.append(f"{where}: {err.get('msg')}")
            if out:
                return out
        except Exception:  # noqa: BLE001
            pass
    text = " ".join(str(e).split()) or type(e).__name__
    return [text]
