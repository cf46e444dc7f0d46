"""What DeepSpeed's engine and ZeRO wrappers do with each client optimizer of fluxzero.train.optim.optimizers.

python benchmarks/archive/optim_modes_probe.py [mode ...] [--stages 0,1,2,3]   (one rank, CPU is fine)
Prints one JSON line per (mode, stage): accepted or the error, the wrapper, dtype and shape of the tensors
the client optimizer steps, whether they alias the model's weights, state types, and whether a checkpoint
save -> load into a fresh engine gives a bit-identical next step. The findings table in fluxzero/train/optim/optimizers.py came from it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _setup():
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / "fluxzero-inductor"))
    warnings.filterwarnings("ignore")
    import deepspeed

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # unused C++ op, ~60 s build
    import logging

    for name in ("deepspeed", "DeepSpeed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


def ds_config(mode: str, stage: int, allow_untested: bool) -> dict:
    from fluxzero.config.optim_modes import get_mode

    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    bf16 = get_mode(mode).ds_bf16_section(stage)
    if bf16:
        cfg["bf16"] = bf16
    if allow_untested:
        cfg["zero_allow_untested_optimizer"] = True
    return cfg


def make_engine(mode: str, stage: int, lr: float, allow_untested: bool = True, seed: int = 0):
    import deepspeed
    import torch

    from fluxzero.config.optim_modes import get_mode
    from fluxzero.train.optim.optimizers import build_optimizer

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    cfg = ds_config(mode, stage, allow_untested)
    if get_mode(mode).master_dtype == "bf16" and "bf16" not in cfg:
        model = model.bfloat16()  # ZeRO 0 with bf16 off: the model's own bf16 tensors are what gets stepped
    opt = build_optimizer(model.parameters(), mode, lr=lr, allow_comparison_only=True)
    eng, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return eng, opt


def batch(step: int):
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g)


def train_step(eng, step: int) -> float:
    x, y = batch(step)
    dtype = next(eng.module.parameters()).dtype
    out = eng(x.to(dtype))
    loss = (out.float() - y).pow(2).mean()
    eng.backward(loss)
    eng.step()
    return loss.item()


def flat_weights(eng):
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    if eng.zero_optimization_stage() == 3:
        return torch.cat([safe_get_full_fp32_param(p).flatten() for p in eng.module.parameters()])
    return torch.cat([p.detach().float().flatten() for p in eng.module.parameters()])


def probe(mode: str, stage: int) -> dict:
    import torch

    row = {"mode": mode, "stage": stage}
    try:
        make_engine(mode, stage, 1e-3, allow_untested=False)
        row["needs_allow_untested"] = False
    except BaseException as e:  # DeepSpeed asserts
        row["needs_allow_untested"] = "untested" in str(e)
        if not row["needs_allow_untested"]:
            row["error_without_allow"] = f"{type(e).__name__}: {e}"[:300]
    try:
        eng, opt = make_engine(mode, stage, 1e-3)
    except BaseException as e:
        row["error"] = f"{type(e).__name__}: {e}"[:400]
        return row
    row["wrapper"] = type(eng.optimizer).__name__
    row["same_client_object"] = eng.basic_optimizer is opt
    model_ptrs = {p.data_ptr() for p in eng.module.parameters() if p.numel()}
    seen = []  # what the optimizer steps, seen at step time (ZeRO-3 swaps its param_groups in only then)
    hook = opt.register_step_pre_hook(
        lambda o, a, k: seen.append(
            [
                [str(p.dtype).replace("torch.", ""), list(p.shape), p.data_ptr() in model_ptrs]
                for g in o.param_groups
                for p in g["params"]
            ]
        )
    )
    try:
        for s in range(3):
            train_step(eng, s)
        hook.remove()
        row["stepped"] = seen[0] if seen else "never stepped"
    except BaseException as e:
        row["step_error"] = f"{type(e).__name__}: {e}"[:400]
        return row
    row["states"] = sorted(
        {
            f"{k}:{type(v).__name__}:{str(getattr(v, 'dtype', '')).replace('torch.', '')}"
            for st in opt.state.values()
            for k, v in st.items()
        }
    )
    # exact resume: save after step 3, step 4 here; fresh engine loads, same RNG, step 4 there
    with tempfile.TemporaryDirectory() as ck:
        try:
            eng.save_checkpoint(ck, tag="s3")
        except BaseException as e:
            row["save_error"] = f"{type(e).__name__}: {e}"[:400]
            return row
        torch.manual_seed(7)
        l4 = train_step(eng, 3)
        w4 = flat_weights(eng)
        eng2, opt2 = make_engine(mode, stage, 1e-3, seed=1)
        try:
            eng2.load_checkpoint(ck, tag="s3")
        except BaseException as e:
            row["load_error"] = f"{type(e).__name__}: {e}"[:400]
            return row
        row["loaded_states"] = sorted({f"{k}:{type(v).__name__}" for st in opt2.state.values() for k, v in st.items()})
        torch.manual_seed(7)
        l4b = train_step(eng2, 3)
        w4b = flat_weights(eng2)
        row["resume_loss_equal"] = l4 == l4b
        row["resume_weights_max_diff"] = (w4 - w4b).abs().max().item()
    return row


def main():
    from fluxzero.config.optim_modes import MODES

    ap = argparse.ArgumentParser()
    ap.add_argument("modes", nargs="*", default=list(MODES))
    ap.add_argument("--stages", default="0,1,2,3")
    a = ap.parse_args()
    _setup()
    for mode in a.modes:
        for stage in map(int, a.stages.split(",")):
            print(json.dumps(probe(mode, stage)), flush=True)
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
