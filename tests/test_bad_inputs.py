"""Audit of bad inputs, each given the way a user gives it: `fluxzero ...` through Click's CliRunner, training through
fluxzero.train.loop.main (what launch/train.py calls) in one child process for all its cases.

The bar for every case: a non-zero exit, exactly one line starting with "error:" (Click's "Error:" for command-line
usage errors), no "Traceback", and no file of the inputs changed, added or removed (the input folders are hashed
before and after each case). `fluxzero check-config` is the one exception to "one line": listing every finding
is its job, so its bar is one line per finding, each naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
DATA = "synthetic:n=8,hw=8x8,txt=4,ctx=64,vec=32"
# JSON and YAML nested past what the readers follow, a YAML alias bomb, a tab where YAML wants spaces
DEEP_JSON = "[" * 5000 + "]" * 5000
DEEP_YAML = "steps: " + "[" * 5000 + "]" * 5000 + "\n"
# 600 bytes that expand to 9^6 strings when a value is printed or copied
ALIAS_BOMB = (
    "steps: ["
    + ", ".join(
        [f'&a0 ["{"lol"}"' + ', "lol"' * 8 + "]"]
        + [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 7)]
    )
    + "]\n"
)
TAB_YAML = "steps: 2\ndata: x\n\tdeepspeed: y\n"


def tree_hash(*paths) -> str:
    """One digest of every file under `paths` (names, bytes, modes): any change, addition or removal shows."""
    h = hashlib.sha256()
    for root in map(Path, paths):
        files = sorted(p for p in root.rglob("*") if p.is_file() or p.is_symlink()) if root.is_dir() else [root]
        for p in files:
            h.update(str(p).encode())
            if p.is_symlink():
                h.update(b"link:" + os.readlink(p).encode())
            elif p.exists():
                h.update(oct(p.stat().st_mode).encode() + hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def _ds(**kw):
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
    }
    ds.update(kw)
    return ds


# ---------------------------------------------------------------------------------------------------------
# Inputs: one folder of every bad file the cases use
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    import torch
    from safetensors.torch import save_file

    from fluxzero.data import ShardWriter
    from fluxzero.model import build_model
    from fluxzero.model.weights import save_weights

    d = tmp_path_factory.mktemp("bad_inputs") / "in"
    d.mkdir()
    w = lambda name, text: (d / name).write_text(text)  # noqa: E731
    # DeepSpeed configs
    w("ds.json", json.dumps(_ds()))
    w("ds_syntax.json", '{"train_micro_batch_size_per_gpu": 2,, }')
    w("ds_unknown.json", json.dumps({**_ds(), "zero_optimisation": {"stage": 3}}))
    w("ds_type.json", json.dumps(_ds(train_micro_batch_size_per_gpu="two")))
    w("ds_offload_param_z2.json", json.dumps(_ds(zero_optimization={"stage": 2, "offload_param": {"device": "cpu"}})))
    w("ds_batch.json", json.dumps(_ds(train_batch_size=3)))
    w("ds_batch6.json", json.dumps(_ds(train_batch_size=6)))  # 2 x 1 x world: right for 3 ranks only
    no_clip = _ds()
    del no_clip["gradient_clipping"]
    w("ds_noclip.json", json.dumps(no_clip))
    w("ds_fp16_bf16.json", json.dumps(_ds(fp16={"enabled": True}, bf16={"enabled": True})))
    w(
        "ds_dup.json",
        json.dumps(_ds()).replace('"gradient_clipping": 1.0', '"gradient_clipping": 1.0, "gradient_clipping": 0.0'),
    )
    w("ds_nan.json", json.dumps(_ds()).replace('"gradient_clipping": 1.0', '"gradient_clipping": NaN'))
    w("ds_stage9.json", json.dumps(_ds(zero_optimization={"stage": 9})))
    w("ds3.json", json.dumps(_ds(zero_optimization={"stage": 3})))
    w("ds_bf16.json", json.dumps(_ds(bf16={"enabled": True})))
    # hostfiles
    w("hosts_syntax", "worker-0 slots 8\n")
    w("hosts_slots0", "worker-0 slots=0\n")
    w("hosts_slots_text", "worker-0 slots=abc\n")
    w("hosts_badname", "worker;rm slots=2\n")
    w("hosts_dup", "worker-0 slots=2\nworker-0 slots=2\n")
    w("hosts_unknown", "no-such-host-fluxzero-audit slots=2\n")
    w("hosts_empty", "# nothing\n")
    # run files (the training cases start from run.yaml)
    base = {"deepspeed": str(d / "ds.json"), "data": DATA, "steps": 2, "export": {"format": None}}
    w("run.yaml", yaml.safe_dump(base))
    w("run_dup.yaml", yaml.safe_dump(base) + "steps: 3\n")
    w("run_syntax.yaml", "deepspeed: [unclosed\n")
    w("run_list.yaml", "- deepspeed\n- data\n")
    w("run_nan.yaml", yaml.safe_dump(base) + "flow:\n  guidance: .nan\n")
    w("run_inf.yaml", yaml.safe_dump({**base, "steps": 2}) + "checkpoint:\n  every: .inf\n")
    w("run_shift_inf.yaml", yaml.safe_dump(base) + "flow:\n  shift: .inf\n")
    w("run_deep.yaml", yaml.safe_dump(base) + DEEP_YAML.replace("steps:", "sample:"))
    w("run_alias_bomb.yaml", yaml.safe_dump(base) + ALIAS_BOMB.replace("steps:", "sample:"))
    w("run_tab.yaml", yaml.safe_dump(base) + "flow:\n\tshift: none\n")
    w("prompts.txt", "a cat\n")
    w("not_weights.safetensors", "this is text, not safetensors\n")
    # data
    (d / "empty_data").mkdir()
    with ShardWriter(d / "shards", samples_per_shard=2) as sw:
        for _ in range(4):
            sw.add(torch.randn(16, 8, 8), torch.randn(4, 64), torch.randn(32))
    for name in ("truncated", "flipped", "bad_manifest"):
        shutil.copytree(d / "shards", d / name)
    victim = sorted((d / "truncated").glob("shard-*.safetensors"))[0]
    victim.write_bytes(victim.read_bytes()[:100])
    victim = sorted((d / "flipped").glob("shard-*.safetensors"))[0]
    raw = bytearray(victim.read_bytes())
    header = 8 + int.from_bytes(raw[:8], "little")
    raw[header + 8000] ^= 0xFF  # one byte of sample 1's latents (bytes 256-8448 of the data), same file size
    victim.write_bytes(bytes(raw))
    (d / "bad_manifest" / "manifest.json").write_text("{not json")
    with ShardWriter(d / "channels8", samples_per_shard=2) as sw:  # latents of another VAE (8 channels)
        for _ in range(4):
            sw.add(torch.randn(8, 8, 8), torch.randn(4, 64), torch.randn(32))
    # weights
    save_weights(build_model("flux-tiny-schnell").state_dict(), d / "schnell.safetensors")
    save_weights(build_model("flux-tiny").state_dict(), d / "tiny.safetensors")
    save_file(
        {
            "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.zeros(4, 64),
            "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.zeros(192, 4),
            "lora_unet_double_blocks_0_img_attn_qkv.alpha": torch.tensor(4.0),
        },
        str(d / "lora.safetensors"),
    )
    lora = {
        "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.zeros(4, 64),
        "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.zeros(192, 4),
    }
    save_file(
        {**lora, "lora_unet_double_blocks_0_img_attn_qkv.alpha": torch.tensor(4.0)},
        str(d / "lora_rank_text.safetensors"),
        {"fluxzero.rank": "four", "fluxzero.alpha": "4.0"},
    )
    save_file(
        {**lora, "lora_unet_double_blocks_0_img_attn_qkv.alpha": torch.tensor([4.0, 4.0])},
        str(d / "lora_alpha2.safetensors"),
    )
    save_file(
        {
            **lora,
            "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.full((192, 4), float("nan")),
            "lora_unet_double_blocks_0_img_attn_qkv.alpha": torch.tensor(4.0),
        },
        str(d / "lora_nan.safetensors"),
    )
    (d / "a_file").write_text("")
    w("ds_micro0.json", json.dumps(_ds(train_micro_batch_size_per_gpu=0)))
    w("ds_bogus_optimizer.json", json.dumps(_ds(optimizer={"type": "Bogus", "params": {"lr": 1e-3}})))
    w("ds_stage_text.json", json.dumps(_ds(zero_optimization={"stage": "2"})))
    w("ds_bogus_scheduler.json", json.dumps(_ds(scheduler={"type": "Bogus", "params": {}})))
    w("ds_ckpt_negative.json", json.dumps(_ds(fluxzero={"activation_checkpointing": {"every_k_blocks": -1}})))
    w(
        "ds_fluxzero_unknown.json",
        json.dumps(_ds(fluxzero={"activation_checkpointing": {"every_k_blocks": 1}, "complie": True})),
    )
    w("ds_nvme_no_path.json", json.dumps(_ds(zero_optimization={"stage": 3, "offload_param": {"device": "nvme"}})))
    w(
        "ds_lr_nan.json",
        json.dumps(_ds(optimizer={"type": "AdamW", "params": {"lr": float("nan"), "torch_adam": True}})),
    )
    w("ds_accum0.json", json.dumps(_ds(gradient_accumulation_steps=0)))
    w("ds_empty.json", "")
    w("ds_clip_negative.json", json.dumps(_ds(gradient_clipping=-1.0)))
    w("ds_offload_opt_z0.json", json.dumps(_ds(zero_optimization={"stage": 0, "offload_optimizer": {"device": "cpu"}})))
    w("ds_micro_nan.json", json.dumps(_ds(train_micro_batch_size_per_gpu=float("nan"))))
    w(
        "ds_fp8_z3.json",
        json.dumps(
            _ds(zero_optimization={"stage": 3}, bf16={"enabled": True}, fluxzero={"fp8": {"recipe": "tensorwise"}})
        ),
    )
    w("run_empty.yaml", "")
    (d / "run_binary.yaml").write_bytes(b"\x00\xff\xfe binary")
    w("run_model_mapping.yaml", yaml.safe_dump({**base, "model": {"preset": "flux-tiny", "depth": -1}}))
    w("run_sample_size.yaml", yaml.safe_dump(base) + "sample:\n  size: 500x500\n")
    w("hosts_negative", "worker-0 slots=-2\n")
    w("hosts_ipv6", "fe80::1 slots=2\n")
    w("hosts_trailing", "worker-0 slots=2 gpus=8\n")
    w("hosts_good", "worker-0 slots=2\nworker-1 slots=2\n")
    from diffusers import AutoencoderKL

    from fluxzero.sampling.embeddings import PromptEmbeddings, save_embeddings

    AutoencoderKL(
        latent_channels=16,
        block_out_channels=(8,),
        norm_num_groups=8,
        layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
    ).save_pretrained(d / "vae")  # a VAE of seconds, for sample
    save_embeddings(d / "emb.safetensors", PromptEmbeddings(["a cat"], torch.randn(1, 4, 64), torch.randn(1, 32)))
    save_embeddings(
        d / "emb_wide.safetensors",  # T5 width 128: not flux-tiny's 64
        PromptEmbeddings(["a cat"], torch.randn(1, 4, 128), torch.randn(1, 32)),
    )
    from fluxzero.sampling.embeddings import FORMAT, VERSION

    save_file(
        {"t5": torch.full((1, 4, 64), float("nan")), "clip_pooled": torch.randn(1, 32)},  # written raw
        str(d / "emb_nan.safetensors"),
        {"format": FORMAT, "version": VERSION, "prompts": '["a cat"]'},
    )
    # data: a listed shard deleted, one of another size, a file given as the folder
    for name in ("shard_gone", "shard_resized"):
        shutil.copytree(d / "shards", d / name)
    sorted((d / "shard_gone").glob("shard-*.safetensors"))[1].unlink()
    victim = sorted((d / "shard_resized").glob("shard-*.safetensors"))[1]
    victim.write_bytes(victim.read_bytes() + b"\0" * 16)
    # weights: a truncated safetensors file, a folder holding none
    raw = (d / "tiny.safetensors").read_bytes()
    (d / "tiny_truncated.safetensors").write_bytes(raw[: len(raw) // 2])
    (d / "no_weights_dir").mkdir()
    (d / "no_weights_dir" / "readme.txt").write_text("nothing here")
    # convert: a pickle under a .safetensors name, weights beyond fp16's range, a diffusers part of another rank
    tiny_sd = build_model("flux-tiny").state_dict()
    torch.save(tiny_sd, d / "pickled.safetensors")
    save_weights({k: v * 1e6 for k, v in tiny_sd.items()}, d / "beyond_fp16.safetensors")
    save_weights(tiny_sd, d / "diffusers_scalar_part", layout="diffusers")
    from safetensors.torch import load_file

    part = d / "diffusers_scalar_part" / "diffusion_pytorch_model.safetensors"
    raw = load_file(str(part))
    raw["single_transformer_blocks.0.attn.to_k.bias"] = torch.zeros(())
    save_file(raw, str(part))
    # pipes and folders where a file is read (opening a FIFO waits for a writer forever)
    from PIL import Image

    for name in ("fifo_caption", "folder_caption"):
        (d / name).mkdir()
        Image.new("RGB", (32, 32)).save(d / name / "a.png")
    os.mkfifo(d / "fifo_caption" / "a.txt")
    (d / "folder_caption" / "a.txt").mkdir()
    os.mkfifo(d / "fifo.jsonl")
    os.mkfifo(d / "fifo_prompts.txt")
    os.mkfifo(d / "fifo_run.yaml")
    from fluxzero.data.tiny_encoders import write_tiny_encoders

    write_tiny_encoders(d / "tiny_enc")
    # LoKr files (qkv 192 x 64 = kron of 8 x 8 and 24 x 8): one of integer tensors, one good
    lokr = {
        "lora_unet_double_blocks_0_img_attn_qkv.lokr_w1": torch.ones(8, 8),
        "lora_unet_double_blocks_0_img_attn_qkv.lokr_w2": torch.randn(24, 8),
    }
    save_file(lokr, str(d / "lokr.safetensors"))
    save_file({k: v.to(torch.int32) for k, v in lokr.items()}, str(d / "lokr_int.safetensors"))
    save_file(
        {
            "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.randn(4, 64),  # a DoRA of ranks 4, 3
            "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.randn(192, 3),
            "lora_unet_double_blocks_0_img_attn_qkv.dora_scale": torch.ones(192, 1),
        },
        str(d / "dora_ranks_differ.safetensors"),
    )
    return d


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(("error:", "Error:"))]


def _meets_bar(code, text: str, same: bool, kind: str = "one") -> str | None:
    """None when the case meets the bar, else what it missed. kind "findings": check-config's one line per
    finding; "report": doctor's table, where the failed check is a FAIL row with its fix."""
    if code in (0, None):
        return f"accepted (exit {code}): {text[-600:]}"
    if "Traceback" in text:
        return f"traceback: {text[-1500:]}"
    if not same:
        return "an input file changed"
    lines = _error_lines(text)
    if kind == "findings" and not lines:
        lines = [line for line in text.splitlines() if line.strip()]
        return None if lines and all(": " in line for line in lines) else f"not one finding a line: {text}"
    if kind == "report" and not lines:
        rows = [line for line in text.splitlines() if " FAIL " in line]
        return None if rows and all("-> fix:" in row for row in rows) else f"no FAIL row with a fix: {text}"
    return None if len(lines) == 1 else f"{len(lines)} error lines: {text[-1500:]}"


# ---------------------------------------------------------------------------------------------------------
# Commands (CliRunner)
# ---------------------------------------------------------------------------------------------------------
def _cli_cases():
    """(name, argv with {in} for the inputs folder and {out} for a fresh output path, words the error must hold)."""
    I = "{in}"  # noqa: E741
    TINY_SAMPLE = ["--vae", f"{I}/vae", "--width", "16", "--height", "16", "--steps", "1"]  # noqa: N806
    return [
        # gen-config
        ("gen_stage_range", ["gen-config", "--zero-stage", "5"], "0<=x<=3"),
        ("gen_offload_param_z2", ["gen-config", "--zero-stage", "2", "--offload-param", "cpu"], "stage 3"),
        ("gen_unknown_preset", ["gen-config", "--preset", "zero9"], "zero9"),
        ("gen_global_batch", ["gen-config", "--global-batch", "7", "--world-size", "2", "--micro-batch", "2"], "7"),
        ("gen_nodes_alone", ["gen-config", "--nodes", "2"], "--gpus-per-node"),
        ("gen_bad_hostfile", ["gen-config", "--hostfile", f"{I}/hosts_syntax"], "slots=N"),
        ("gen_unwritable", ["gen-config", "-o", f"{I}/a_file/ds.json"], "cannot write"),
        ("gen_unknown_model", ["gen-config", "--model", "flux-huge"], "flux-huge"),
        (
            "gen_fit_nothing_fits_a_lora",
            ["gen-config", "--fit", "--gpu-memory", "1", "--host-memory", "8", "--lora-rank", "16", "-o", "{out}.json"],
            "--host-memory 38",
        ),
        ("gen_two_world_sizes", ["gen-config", "--world-size", "2", "--hostfile", f"{I}/hosts_good"], "one way only"),
        # check-config (one line per finding)
        ("check_syntax", ["check-config", "--no-deepspeed", f"{I}/ds_syntax.json"], "JSON"),
        ("check_unknown_key", ["check-config", "--no-deepspeed", f"{I}/ds_unknown.json"], "zero_optimization"),
        ("check_type", ["check-config", "--no-deepspeed", f"{I}/ds_type.json"], "train_micro_batch_size_per_gpu"),
        ("check_world_arith", ["check-config", "--no-deepspeed", "--world-size", "2", f"{I}/ds_batch6.json"], "6"),
        ("check_duplicate_key", ["check-config", "--no-deepspeed", f"{I}/ds_dup.json"], "gradient_clipping"),
        ("check_missing_file", ["check-config", f"{I}/nope.json"], "nope.json"),
        ("check_hostfile_slots0", ["check-config", "--hostfile", f"{I}/hosts_slots0", f"{I}/ds.json"], "slots"),
        (
            "check_offload_param_z2",
            ["check-config", "--no-deepspeed", f"{I}/ds_offload_param_z2.json"],
            "offload_param",
        ),
        ("check_nan", ["check-config", "--no-deepspeed", f"{I}/ds_nan.json"], "gradient_clipping"),
        ("check_stage9", ["check-config", "--no-deepspeed", f"{I}/ds_stage9.json"], "stage"),
        # estimate
        ("estimate_resolution", ["estimate", "--resolution", "500x7"], "resolution"),
        ("estimate_bad_config", ["estimate", "--ds-config", f"{I}/ds_syntax.json"], "ds_syntax.json"),
        ("estimate_unknown_model", ["estimate", "--model", "flux-huge"], "flux-huge"),
        ("estimate_negative_memory", ["estimate", "--gpu-memory", "-1"], "x>0"),
        ("estimate_bad_hostfile", ["estimate", "--hostfile", f"{I}/hosts_slots_text"], "slots"),
        # convert
        ("convert_missing", ["convert", f"{I}/nope.safetensors", "{out}.safetensors", "--to", "bfl"], "nope"),
        (
            "convert_not_safetensors",
            ["convert", f"{I}/not_weights.safetensors", "{out}.safetensors", "--to", "bfl"],
            "not_weights.safetensors",
        ),
        ("convert_lora_to_a_folder", ["convert", f"{I}/lora.safetensors", "{out}", "--to", "diffusers"], "LoRA"),
        (
            "convert_lora_alpha_two_values",
            ["convert", f"{I}/lora_alpha2.safetensors", "{out}.safetensors", "--to", "diffusers"],
            "an alpha is one number",
        ),
        (
            "convert_full_to_kohya",
            ["convert", f"{I}/tiny.safetensors", "{out}.safetensors", "--to", "kohya"],
            "kohya is a LoRA layout",
        ),
        (
            "convert_out_exists",
            ["convert", f"{I}/tiny.safetensors", f"{I}/schnell.safetensors", "--to", "bfl"],
            "--overwrite",
        ),
        (
            "convert_other_model",
            ["convert", f"{I}/tiny.safetensors", "{out}.safetensors", "--to", "bfl", "--model", "flux-dev"],
            "do not match the model",
        ),
        # export
        ("export_not_checkpoint", ["export", f"{I}/empty_data", "{out}.safetensors"], "not a fluxzero checkpoint"),
        ("export_out_exists", ["export", f"{I}/empty_data", f"{I}/tiny.safetensors"], "--overwrite"),
        ("export_out_suffix", ["export", f"{I}/empty_data", "{out}.bin"], ".safetensors"),
        # cache
        ("cache_missing_images", ["cache", f"{I}/nope", "{out}"], "nope"),
        ("cache_resolution", ["cache", f"{I}/empty_data", "{out}", "--resolution", "1000"], "16"),
        ("cache_no_models", ["cache", f"{I}/empty_data", "{out}"], "--vae"),
        # sample
        ("sample_missing_weights", ["sample", f"{I}/nope.safetensors", "--out", "{out}", "--prompt", "a"], "nope"),
        (
            "sample_width",
            ["sample", f"{I}/tiny.safetensors", "--out", "{out}", "--prompt", "a", "--width", "1000"],
            "16",
        ),
        ("sample_no_prompt", ["sample", f"{I}/tiny.safetensors", "--out", "{out}"], "prompt"),
        (
            "sample_not_safetensors",
            ["sample", f"{I}/not_weights.safetensors", "--out", "{out}", "--embeddings", f"{I}/prompts.txt"],
            "not a readable safetensors file",
        ),
        # launch and doctor
        ("launch_hostfile_syntax", ["launch", "--hostfile", f"{I}/hosts_syntax", "--dry-run"], "slots=N"),
        ("launch_host_name", ["launch", "--hostfile", f"{I}/hosts_badname", "--dry-run"], "host name"),
        ("launch_hostfile_empty", ["launch", "--hostfile", f"{I}/hosts_empty", "--dry-run"], "no hosts"),
        ("launch_nccl", ["launch", "--nccl", "warp-drive", "--dry-run"], "warp-drive"),
        (
            "launch_include_exclude",
            ["launch", "--hostfile", f"{I}/hosts_good", "--include", "worker-0", "--exclude", "worker-1", "--dry-run"],
            "--exclude",
        ),
        ("launch_dup_host", ["launch", "--hostfile", f"{I}/hosts_dup", "--dry-run"], "listed twice"),
        ("launch_env", ["launch", "--env", "NOEQUALS", "--dry-run"], "NOEQUALS"),
        (
            "launch_unknown_host",
            ["launch", "--hostfile", f"{I}/hosts_unknown", "--", "--config", f"{I}/run.yaml"],
            "pdsh",
        ),
        ("doctor_slots_text", ["doctor", "--hostfile", f"{I}/hosts_slots_text"], "slots"),
        ("doctor_ssh_timeout", ["doctor", "--ssh-timeout", "0"], "1<=x<=120"),
        (
            "doctor_unknown_host",
            ["doctor", "--hostfile", f"{I}/hosts_unknown", "--ssh-timeout", "1", "--min-free-gb", "0"],
            "no-such-host",
        ),
        ("gen_nvme_no_path", ["gen-config", "--zero-stage", "3", "--offload-param", "nvme"], "--nvme-path"),
        (
            "gen_nvme_optimizer_z2",
            ["gen-config", "--zero-stage", "2", "--offload-optimizer", "nvme", "--nvme-path", f"{I}"],
            "stage 3",
        ),
        ("gen_micro_zero", ["gen-config", "--micro-batch", "0"], "x>=1"),
        ("check_binary", ["check-config", "--no-deepspeed", f"{I}/run_binary.yaml"], "run_binary.yaml"),
        ("check_folder", ["check-config", f"{I}/empty_data"], "empty_data"),
        ("check_micro0", ["check-config", "--no-deepspeed", f"{I}/ds_micro0.json"], "train_micro_batch_size_per_gpu"),
        ("check_stage_text", ["check-config", "--no-deepspeed", f"{I}/ds_stage_text.json"], "stage"),
        ("check_accum0", ["check-config", "--no-deepspeed", f"{I}/ds_accum0.json"], "gradient_accumulation_steps"),
        ("check_fluxzero_unknown", ["check-config", "--no-deepspeed", f"{I}/ds_fluxzero_unknown.json"], "complie"),
        ("check_bogus_optimizer", ["check-config", f"{I}/ds_bogus_optimizer.json"], "Bogus"),
        ("check_nvme_no_path", ["check-config", "--no-deepspeed", f"{I}/ds_nvme_no_path.json"], "nvme_path"),
        ("check_hosts_negative", ["check-config", "--hostfile", f"{I}/hosts_negative", f"{I}/ds.json"], "slots"),
        ("check_hosts_ipv6", ["check-config", "--hostfile", f"{I}/hosts_ipv6", f"{I}/ds.json"], "IPv6"),
        ("check_hosts_trailing", ["check-config", "--hostfile", f"{I}/hosts_trailing", f"{I}/ds.json"], "gpus=8"),
        ("estimate_unknown_key", ["estimate", "--ds-config", f"{I}/ds_unknown.json"], "zero_optimization"),
        ("estimate_heads", ["estimate", "--hidden-size", "100", "--heads", "7"], "heads"),
        (
            "convert_diffusers_onto_file",
            ["convert", f"{I}/tiny.safetensors", f"{I}/a_file", "--to", "diffusers", "--overwrite"],
            "a_file",
        ),
        (
            "convert_shard_zero",
            ["convert", f"{I}/tiny.safetensors", "{out}", "--to", "diffusers", "--max-shard-gb", "0"],
            "x>0",
        ),
        (
            "convert_truncated",
            ["convert", f"{I}/tiny_truncated.safetensors", "{out}.safetensors", "--to", "bfl"],
            "tiny_truncated",
        ),
        (
            "convert_empty_folder",
            ["convert", f"{I}/no_weights_dir", "{out}.safetensors", "--to", "bfl"],
            "no_weights_dir",
        ),
        (
            "sample_bad_embeddings",
            ["sample", f"{I}/tiny.safetensors", "--out", "{out}", "--embeddings", f"{I}/prompts.txt"],
            "prompts.txt",
        ),
        (
            "sample_bad_lora",
            [
                "sample",
                f"{I}/tiny.safetensors",
                "--out",
                "{out}",
                *TINY_SAMPLE,
                "--embeddings",
                f"{I}/emb.safetensors",
                "--lora",
                f"{I}/not_weights.safetensors",
            ],
            "not_weights",
        ),
        (
            "sample_lora_rank_text",
            [
                "sample",
                f"{I}/tiny.safetensors",
                "--out",
                "{out}",
                *TINY_SAMPLE,
                "--embeddings",
                f"{I}/emb.safetensors",
                "--lora",
                f"{I}/lora_rank_text.safetensors",
            ],
            "header entry fluxzero.rank is 'four'",
        ),
        (
            "sample_lora_nan",
            [
                "sample",
                f"{I}/tiny.safetensors",
                "--out",
                "{out}",
                *TINY_SAMPLE,
                "--embeddings",
                f"{I}/emb.safetensors",
                "--lora",
                f"{I}/lora_nan.safetensors",
            ],
            "holds NaN or infinite values",
        ),
        (
            "sample_embeddings_nan",
            [
                "sample",
                f"{I}/tiny.safetensors",
                "--out",
                "{out}",
                *TINY_SAMPLE,
                "--embeddings",
                f"{I}/emb_nan.safetensors",
            ],
            "t5 holds NaN or infinite values",
        ),
        ("launch_master_port", ["launch", "--master-port", "0", "--dry-run"], "1<=x<=65535"),
        ("launch_num_nodes", ["launch", "--hostfile", f"{I}/hosts_good", "--num-nodes", "5", "--dry-run"], "5"),
        (
            "launch_include_unknown",
            ["launch", "--hostfile", f"{I}/hosts_unknown", "--include", "other-host", "--dry-run"],
            "other-host",
        ),
        ("launch_missing_hostfile", ["launch", "--hostfile", f"{I}/nope", "--dry-run"], "nope"),
        ("cache_bad_captions", ["cache", f"{I}/empty_data", "{out}", "--captions", f"{I}/nope.jsonl"], "nope.jsonl"),
        ("cache_min_side", ["cache", f"{I}/empty_data", "{out}", "--min-side", "24"], "16"),
        ("encode_prompts_no_t5", ["encode-prompts", "--prompt", "a", "{out}.safetensors"], "T5"),
        ("encode_prompts_none", ["encode-prompts", "{out}.safetensors"], "prompt"),
        (
            "encode_prompts_over_a_file",
            ["encode-prompts", "--prompt", "a", f"{I}/tiny.safetensors"],
            "tiny.safetensors exists; pass --overwrite",
        ),
        (
            "convert_diffusers_over_a_folder_of_other_files",
            ["convert", f"{I}/tiny.safetensors", I, "--to", "diffusers", "--overwrite"],
            "not part of a diffusers transformer folder",
        ),
        (
            "sample_embeddings_other_model",
            [
                "sample",
                f"{I}/tiny.safetensors",
                "--out",
                "{out}",
                *TINY_SAMPLE,
                "--embeddings",
                f"{I}/emb_wide.safetensors",
            ],
            "128",
        ),
        (
            "sample_other_model",
            [
                "sample",
                f"{I}/tiny.safetensors",
                "--out",
                "{out}",
                *TINY_SAMPLE,
                "--embeddings",
                f"{I}/emb.safetensors",
                "--model",
                "flux-dev",
            ],
            "do not match",
        ),
        (
            "sample_reference_not_an_image",
            [
                "sample",
                f"{I}/tiny.safetensors",
                "--out",
                "{out}",
                *TINY_SAMPLE,
                "--embeddings",
                f"{I}/emb.safetensors",
                "--reference",
                f"{I}/prompts.txt",
            ],
            "cannot be read",
        ),
        ("doctor_hosts_ipv6", ["doctor", "--hostfile", f"{I}/hosts_ipv6", "--min-free-gb", "0"], "IPv6"),
        # train (the command)
        ("train_missing_config", ["train", "--config", f"{I}/nope.yaml"], "nope.yaml"),
        ("train_flag_override", ["train", "--config", f"{I}/run.yaml", "--steps", "5"], "steps=VALUE"),
        # numbers without a bound, each refused naming the setting and its range
        ("estimate_hidden_size_huge", ["estimate", "--hidden-size", "10000000000", "--heads", "1"], "1 to 65536"),
        ("estimate_depth_huge", ["estimate", "--depth", "10000000000"], "0 to 1024"),
        (
            "estimate_lora_rank_huge",
            ["estimate", "--model", "flux-tiny", "--lora-rank", "100000000000"],
            "lora.rank must be from 1 to",
        ),
        ("estimate_theta_zero", ["estimate", "--model", "flux-tiny:theta=0"], "theta"),
        ("estimate_mlp_width_zero", ["estimate", "--model", "flux-tiny:mlp_ratio=0.001"], "mlp_ratio"),
        (
            "estimate_micro_batch_nan",
            ["estimate", "--ds-config", f"{I}/ds_micro_nan.json"],
            "train_micro_batch_size_per_gpu",
        ),
        ("gen_lora_rank_huge", ["gen-config", "--model", "flux-tiny", "--lora-rank", "100000"], "lora.rank"),
        (
            "gen_lora_matches_nothing",
            ["gen-config", "--model", "flux-tiny", "--lora-rank", "4", "--lora-targets", "nope.*"],
            "matches no linear layer",
        ),
        ("gen_fp8_zero3", ["gen-config", "--zero-stage", "3", "--fp8", "tensorwise"], "ZeRO-3"),
        ("check_fp8_zero3", ["check-config", "--no-deepspeed", f"{I}/ds_fp8_z3.json"], "fluxzero.fp8"),
        (
            "encode_prompts_t5_length",
            ["encode-prompts", "--prompt", "a", "--t5-max-length", "1000000000", "{out}.safetensors"],
            "1<=x<=4096",
        ),
        ("cache_seed_huge", ["cache", f"{I}/empty_data", "{out}", "--seed", str(2**70)], "--seed"),
        (
            "sample_seed_huge",
            ["sample", f"{I}/tiny.safetensors", "--out", "{out}", "--prompt", "a", "--seed", str(2**70)],
            "--seed",
        ),
        # convert: what IN is, fp16's range, parts that cannot be fused
        (
            "convert_pickled_to_kohya",
            ["convert", f"{I}/pickled.safetensors", "{out}.safetensors", "--to", "kohya"],
            "not a readable safetensors file",
        ),
        (
            "convert_fp16_overflow",
            ["convert", f"{I}/beyond_fp16.safetensors", "{out}.safetensors", "--to", "bfl", "--dtype", "fp16"],
            "68 of 84 tensors",
        ),
        (
            "convert_diffusers_scalar_part",
            ["convert", f"{I}/diffusers_scalar_part", "{out}.safetensors", "--to", "bfl"],
            "wrong shape",
        ),
        # a pipe or a folder where a file is read
        (
            "cache_fifo_captions",
            ["cache", f"{I}/fifo_caption", "{out}", "--captions", f"{I}/fifo.jsonl", "--flux-dir", f"{I}/tiny_enc"],
            "not a regular file",
        ),
        (
            "cache_fifo_txt_caption",
            ["cache", f"{I}/fifo_caption", "{out}", "--flux-dir", f"{I}/tiny_enc"],
            "not a regular file",
        ),
        (
            "cache_folder_txt_caption",
            ["cache", f"{I}/folder_caption", "{out}", "--flux-dir", f"{I}/tiny_enc"],
            "is a folder",
        ),
        (
            "encode_prompts_fifo",
            ["encode-prompts", "--prompts", f"{I}/fifo_prompts.txt", "{out}.safetensors"],
            "not a regular file",
        ),
        (
            "sample_prompts_fifo",
            ["sample", f"{I}/tiny.safetensors", "--out", "{out}", "--prompts", f"{I}/fifo_prompts.txt"],
            "not a regular file",
        ),
        ("train_fifo_run_file", ["train", "--config", f"{I}/fifo_run.yaml"], "not a regular file"),
        (
            "cache_caption_dropout_nan",
            ["cache", f"{I}/empty_data", "{out}", "--caption-dropout", "nan"],
            "'nan' is not a finite number",
        ),
        (
            "cache_max_aspect_nan",
            ["cache", f"{I}/empty_data", "{out}", "--max-aspect", "nan"],
            "'nan' is not a finite number",
        ),
        # adapters as a plain LoRA, the fused optimizer mode
        (
            "convert_lokr_integer_tensors",
            ["convert", f"{I}/lokr_int.safetensors", "{out}.safetensors", "--to", "kohya", "--as-lora-rank", "4"],
            "holds int32 values, but adapter weights are",
        ),
        (
            "convert_dora_ranks_differ",
            [
                "convert",
                f"{I}/dora_ranks_differ.safetensors",
                "{out}.safetensors",
                "--to",
                "kohya",
                "--as-lora-rank",
                "2",
                "--base",
                f"{I}/tiny.safetensors",
            ],
            "(192, 3) and lora_A.weight (4, 64) do not multiply",
        ),
        (
            "convert_max_error_nan",
            [
                "convert",
                f"{I}/lokr.safetensors",
                "{out}.safetensors",
                "--to",
                "kohya",
                "--as-lora-rank",
                "1",
                "--max-error",
                "nan",
            ],
            "'nan' is not a finite number",
        ),
        (
            "gen_fused_mode_lora",
            [
                "gen-config",
                "--model",
                "flux-tiny",
                "--optimizer-mode",
                "fused-adafactor-sr",
                "--zero-stage",
                "0",
                "--gradient-clipping",
                "0",
                "--lora-rank",
                "4",
                "-o",
                "{out}.json",
            ],
            "is for full fine-tunes",
        ),
    ]


def _waited_too_long(*_):
    raise TimeoutError("the command waited 120 s (a read that blocks)")


CLI_XFAIL: dict[str, str] = {}  # none left; a case that cannot pass yet goes here with its reason


@pytest.mark.parametrize(
    "name, argv, words",
    [
        pytest.param(*c, marks=pytest.mark.xfail(strict=True, reason=CLI_XFAIL[c[0]])) if c[0] in CLI_XFAIL else c
        for c in _cli_cases()
    ],
)
def test_command_refuses_bad_input(inputs, tmp_path, monkeypatch, name, argv, words):
    from fluxzero.cli import main

    monkeypatch.chdir(ROOT)  # where a user runs `fluxzero launch` (launch/train.py is found)
    if name == "launch_unknown_host":  # the same refusal on a machine that has pdsh: only the venv's tools
        monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    argv = [a.replace("{in}", str(inputs)).replace("{out}", str(tmp_path / "out")) for a in argv]
    before = tree_hash(inputs)
    signal.signal(signal.SIGALRM, _waited_too_long)
    signal.alarm(120)  # a read that blocks (a FIFO) fails the case instead of hanging the suite
    try:
        r = CliRunner().invoke(main, argv, catch_exceptions=True)
    finally:
        signal.alarm(0)
    text = r.output + (
        f"\nTraceback (raised): {r.exc_info[1]!r}" if r.exception and not isinstance(r.exception, SystemExit) else ""
    )
    kind = {"check-config": "findings", "doctor": "report"}.get(argv[0], "one")
    problem = _meets_bar(r.exit_code, text, tree_hash(inputs) == before, kind)
    assert problem is None, problem
    assert words in text, text
    assert not list(tmp_path.glob("out*")), f"a refused command left {list(tmp_path.glob('out*'))}"


# ---------------------------------------------------------------------------------------------------------
# Training: every case one main() call in one child process (DeepSpeed never runs in the pytest process)
# ---------------------------------------------------------------------------------------------------------
CHILD = textwrap.dedent("""
    import contextlib, io, json, os, shutil, sys, warnings
    warnings.filterwarnings("ignore")
    os.environ["FLUXZERO_NO_PROGRESS"] = "1"
    sys.path.insert(0, os.environ["AUDIT_TESTS"])
    from test_bad_inputs import tree_hash, damage
    from fluxzero.train.distributed import init_distributed
    from fluxzero.train.loop import main
    init_distributed()
    results = {}
    for name, argv, watch, prep in json.load(open(sys.argv[1])):
        for op in prep:
            damage(*op)
        before = tree_hash(*watch)
        out = io.StringIO()
        with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
            try:
                code = main(argv)
            except SystemExit as e:
                code = e.code
            except BaseException:
                import traceback
                code = "raised"
                traceback.print_exc()
        results[name] = [code, out.getvalue(), tree_hash(*watch) == before]
    json.dump(results, open(sys.argv[2], "w"))
""")


def damage(op: str, path: str, arg=None) -> None:
    """What a user's mistake or a failure leaves in a checkpoint (run in the child, before the case)."""
    p = Path(path)
    if op == "copy":  # path <- arg, a copy of a good run's checkpoints
        shutil.copytree(arg, p)
    elif op == "write":
        p.write_text(arg)
    elif op == "truncate":
        p.write_bytes(p.read_bytes()[:arg])
    elif op == "flip":  # the same size, other bytes in the middle: what an overwrite in place leaves
        raw = bytearray(p.read_bytes())
        mid = len(raw) // 2
        raw[mid : mid + 64] = bytes(b ^ 0x5A for b in raw[mid : mid + 64])
        p.write_bytes(bytes(raw))
    elif op == "pickle":  # a checkpoint file replaced by one whose unpickling would create file `arg`
        import torch

        class Payload:
            def __reduce__(self):
                return (os.system, (f"touch {arg}",))

        torch.save({"step": Payload()}, p)
    elif op == "unlink":
        p.unlink()


def _train_cases(d: Path, outs: Path):
    """(name, argv, paths whose files must not change, damage ops, words the error must hold)."""
    run = ["--config", str(d / "run.yaml")]
    base_ck = outs / "base" / "checkpoints"
    tag = "step_00000002"

    def case(name, *over, run_file=None, words="", prep=(), watch=()):
        out = outs / name
        argv = ["--config", str(run_file or d / "run.yaml"), f"output_dir={out}", *over]
        return [name, argv, [str(d), *[str(out / w) for w in watch]], list(prep), words]

    def ck_case(name, ops, words, *over):  # resume a damaged copy of base's checkpoints
        ck = outs / name / "checkpoints"
        prep = [["copy", str(ck), str(base_ck)]] + [[op, str(ck / rel), arg] for op, rel, arg in ops]
        return case(name, *over, prep=prep, watch=["checkpoints"], words=words)

    cases = [
        # a good run first: its checkpoints are what the checkpoint cases damage
        ["base", [*run, f"output_dir={outs / 'base'}", "checkpoint.every=1"], [str(d)], [], None],
        # the run file: types, ranges, moved keys, unknown keys, duplicates, NaN/inf, not a mapping
        case("run_missing", run_file=d / "nope.yaml", words="nope.yaml"),
        case("run_syntax", run_file=d / "run_syntax.yaml", words="YAML"),
        case("run_list", run_file=d / "run_list.yaml", words="mapping"),
        case("run_duplicate", run_file=d / "run_dup.yaml", words="appears twice"),
        case("run_steps_type", "steps=abc", words="steps must be a whole number"),
        case("run_steps_negative", "steps=-3", words="steps"),
        case("run_unknown_key", "stpes=3", words="did you mean 'steps'"),
        case("run_moved_micro", "micro_batch=2", words="train_micro_batch_size_per_gpu"),
        case("run_lr", "lr=1e-4", words="optimizer.params.lr"),
        case("run_moved_warmup", "warmup_steps=10", words="warmup_num_steps"),
        case("run_moved_to_section", "checkpoint_every=1", words="checkpoint_every is checkpoint.every now"),
        case("run_guidance_nan", run_file=d / "run_nan.yaml", words="guidance"),
        case("run_checkpoint_every_inf", run_file=d / "run_inf.yaml", words="checkpoint.every"),
        case("run_shift_inf", run_file=d / "run_shift_inf.yaml", words="shift"),
        case("run_deep", run_file=d / "run_deep.yaml", words="nested more than 64 levels deep"),
        case("run_alias_bomb", run_file=d / "run_alias_bomb.yaml", words="aliases (*name) expand to more than"),
        case("run_tab", run_file=d / "run_tab.yaml", words="found character '\\t' that cannot start any token"),
        case("run_output_dir_type", "output_dir=5", words="output_dir"),
        case("run_export_format", "export.format=png", words="export.format"),
        case("run_ema_decay", "ema.decay=2", words="decay"),
        case("run_lora_rank", "lora.rank=0", words="rank"),
        case("run_sample_every_alone", "sample.every=1", words="sample.prompts"),
        case("run_unknown_model", "model=flux-huge", words="flux-huge"),
        case("run_seed_float", "seed=1.5", words="seed"),
        case("run_epochs_zero", "epochs=0", words="epochs"),
        case("run_keep_negative", "checkpoint.keep=-1", words="checkpoint.keep"),
        case("run_workers_negative", "num_workers=-1", words="num_workers"),
        case("run_log_every_zero", "log_every=0", words="log_every"),
        case("run_export_dtype", "export.dtype=fp8", words="export.dtype"),
        case("run_export_ema_without_ema", "export.weights=ema", words="ema"),
        case("run_attention", "attention=magic", words="attention"),
        case("run_timestep_sampling", "flow.timestep_sampling=beta", words="timestep_sampling"),
        case("run_resume_text", "checkpoint.resume=maybe", words="checkpoint.resume"),
        case("run_validation_missing", f"validation.data={d / 'nope'}", words="nope"),
        case("run_empty", run_file=d / "run_empty.yaml", words="must set"),
        case("run_binary", run_file=d / "run_binary.yaml", words="text file"),
        case("run_model_mapping", run_file=d / "run_model_mapping.yaml", words="depth"),
        case("run_sample_size", run_file=d / "run_sample_size.yaml", words="sample.size"),
        case("run_synthetic_spec", "data=synthetic:n=abc", words="synthetic"),
        case("run_lora_targets", "lora.targets=[nope_*]", words="nope_"),
        case(
            "lora_weights_rank_text",
            "lora.rank=4",
            f"lora.weights={d / 'lora_rank_text.safetensors'}",
            words="header entry fluxzero.rank is 'four'",
        ),
        case(
            "lora_weights_alpha_two_values",
            "lora.rank=4",
            f"lora.weights={d / 'lora_alpha2.safetensors'}",
            words="an alpha is one number",
        ),
        case("lora_weights_nan", "lora.rank=4", f"lora.weights={d / 'lora_nan.safetensors'}", words="NaN"),
        case(
            "sample_prompts_nan",
            "sample.every=1",
            f"sample.prompts={d / 'emb_nan.safetensors'}",
            f"sample.vae={d / 'vae'}",
            "sample.size=16x16",
            words="t5 holds NaN",
        ),
        case(
            "sample_prompts_other_width",
            "sample.every=1",
            f"sample.prompts={d / 'emb_wide.safetensors'}",
            f"sample.vae={d / 'vae'}",
            "sample.size=16x16",
            words="T5 128",
        ),
        # FLUX.1 Kontext previews: a reference for a model that takes none, none for one that needs it, a missing file
        case(
            "run_sample_reference_not_kontext",
            f"sample.reference={d / 'nope.png'}",
            words="is not one; remove sample.reference",
        ),
        case(
            "run_kontext_previews_without_reference",
            "model=flux-tiny-kontext",
            "sample.every=1",
            f"sample.prompts={d / 'emb_nan.safetensors'}",
            f"sample.vae={d / 'vae'}",
            words="so its previews edit a reference image; set sample.reference",
        ),
        case(
            "sample_reference_missing",
            "model=flux-tiny-kontext",
            "sample.every=1",
            f"sample.prompts={d / 'emb_nan.safetensors'}",
            f"sample.vae={d / 'vae'}",
            f"sample.reference={d / 'nope.png'}",
            words=f"sample.reference {d / 'nope.png'} does not exist",
        ),
        case("run_output_dir_file", f"output_dir={d / 'a_file'}", words="a_file"),
        case("run_override_no_value", "steps", words="steps"),
        # the DeepSpeed config
        case("ds_missing", f"deepspeed={d / 'nope.json'}", words="nope.json"),
        case("ds_syntax", f"deepspeed={d / 'ds_syntax.json'}", words="ds_syntax.json"),
        case("ds_unknown_key", f"deepspeed={d / 'ds_unknown.json'}", words="zero_optimization"),
        case("ds_type", f"deepspeed={d / 'ds_type.json'}", words="train_micro_batch_size_per_gpu"),
        case("ds_offload_param_z2", f"deepspeed={d / 'ds_offload_param_z2.json'}", words="offload_param"),
        case("ds_batch_arith", f"deepspeed={d / 'ds_batch.json'}", words="train_batch_size"),
        case("ds_no_clipping", f"deepspeed={d / 'ds_noclip.json'}", words="gradient_clipping"),
        case("ds_fp16_and_bf16", f"deepspeed={d / 'ds_fp16_bf16.json'}", words="fp16"),
        case("ds_duplicate_key", f"deepspeed={d / 'ds_dup.json'}", words="gradient_clipping"),
        case("ds_stage9", f"deepspeed={d / 'ds_stage9.json'}", words="stage"),
        case("ds_micro0", f"deepspeed={d / 'ds_micro0.json'}", words="train_micro_batch_size_per_gpu"),
        case("ds_bogus_optimizer", f"deepspeed={d / 'ds_bogus_optimizer.json'}", words="Bogus"),
        case("ds_stage_text", f"deepspeed={d / 'ds_stage_text.json'}", words="stage"),
        case("ds_bogus_scheduler", f"deepspeed={d / 'ds_bogus_scheduler.json'}", words="Bogus"),
        case("ds_ckpt_negative", f"deepspeed={d / 'ds_ckpt_negative.json'}", words="every_k_blocks"),
        case("ds_fluxzero_unknown", f"deepspeed={d / 'ds_fluxzero_unknown.json'}", words="complie"),
        case("ds_nvme_no_path", f"deepspeed={d / 'ds_nvme_no_path.json'}", words="nvme_path"),
        case("ds_lr_nan", f"deepspeed={d / 'ds_lr_nan.json'}", words="lr"),
        case("ds_accum0", f"deepspeed={d / 'ds_accum0.json'}", words="gradient_accumulation_steps"),
        case("ds_empty", f"deepspeed={d / 'ds_empty.json'}", words="ds_empty.json"),
        case("ds_folder", f"deepspeed={d / 'empty_data'}", words="folder"),
        case("ds_clip_negative", f"deepspeed={d / 'ds_clip_negative.json'}", words="gradient_clipping"),
        case("ds_offload_opt_z0", f"deepspeed={d / 'ds_offload_opt_z0.json'}", words="offload"),
        # data
        case("data_missing", f"data={d / 'nope'}", words="nope"),
        case("data_empty", f"data={d / 'empty_data'}", words="empty"),
        case("data_truncated", f"data={d / 'truncated'}", words="shard"),
        case("data_flipped_sample", f"data={d / 'flipped'}", words="checksum"),
        case("data_bad_manifest", f"data={d / 'bad_manifest'}", words="manifest"),
        case("data_channels", f"data={d / 'channels8'}", words="channels"),
        case("data_t5_width", "data=synthetic:n=8,hw=8x8,txt=4,ctx=4096,vec=32", words="4096"),
        case("data_odd_latent", "data=synthetic:n=8,hw=7x8,txt=4,ctx=64,vec=32", words="7x8"),
        case("data_kontext_without_pairs", "model=flux-tiny-kontext", words="holds no reference latents"),
        case(
            "data_pairs_without_kontext",
            "data=synthetic:n=8,hw=8x8,txt=4,ctx=64,vec=32,ref=1",
            words="not a Kontext model",
        ),
        case("data_shard_gone", f"data={d / 'shard_gone'}", words="shard"),
        case("data_shard_resized", f"data={d / 'shard_resized'}", words="shard"),
        case("data_is_a_file", f"data={d / 'a_file'}", words="a_file"),
        # several datasets: an empty one among them, repeats of 0
        case(
            "datasets_one_empty",
            f"data=[{{path: {d / 'shards'}}}, {{path: {d / 'empty_data'}}}]",
            words=f"{d / 'empty_data'} is empty",
        ),
        case("datasets_repeats_zero", f"data=[{{path: {d / 'shards'}, repeats: 0}}]", words="set repeats to 1 or more"),
        case("data_synthetic_none", "data=synthetic:n=0,hw=8x8,txt=4,ctx=64,vec=32", words="n="),
        # weights
        case("weights_missing", f"weights={d / 'nope.safetensors'}", words="nope.safetensors"),
        case("weights_not_safetensors", f"weights={d / 'not_weights.safetensors'}", words="not_weights"),
        case("weights_other_model", f"weights={d / 'schnell.safetensors'}", words="guidance_in"),
        case("weights_lora_as_full", f"weights={d / 'lora.safetensors'}", words="LoRA"),
        case("weights_truncated", f"weights={d / 'tiny_truncated.safetensors'}", words="tiny_truncated"),
        case("weights_empty_folder", f"weights={d / 'no_weights_dir'}", words="no_weights_dir"),
        case(
            "weights_zero3_lora_file", f"deepspeed={d / 'ds3.json'}", f"weights={d / 'lora.safetensors'}", words="LoRA"
        ),
        # checkpoints (copies of base's, damaged)
        ck_case("ck_empty_latest", [["write", "latest", ""]], "latest"),
        ck_case("ck_dangling_latest", [["write", "latest", "step_00000099"]], "step_00000099"),
        ck_case("ck_truncated", [["truncate", f"{tag}/mp_rank_00_model_states.pt", 1000]], "incomplete or corrupt"),
        ck_case(
            "ck_overwritten",
            [["flip", f"{tag}/zero_pp_rank_0_mp_rank_00_optim_states.pt", None]],
            "incomplete or corrupt",
        ),
        ck_case("ck_missing_file", [["unlink", f"{tag}/trainer_state_rank0.pt", None]], "trainer_state_rank0.pt"),
        ck_case("ck_pickle_payload", [["pickle", f"{tag}/trainer_state_rank0.pt", str(d / "PWNED")]], "posix.system"),
        ck_case(
            "ck_pickle_model_states",
            [["pickle", f"{tag}/mp_rank_00_model_states.pt", str(d / "PWNED")]],
            "posix.system",
        ),
        ck_case("ck_bad_run_yaml", [["write", f"{tag}/run.yaml", "model: [unclosed\n"]], "run.yaml"),
        ck_case("ck_other_stage", [], "ZeRO stage 2", f"deepspeed={d / 'ds3.json'}"),
        ck_case("ck_other_precision", [], "fp32", f"deepspeed={d / 'ds_bf16.json'}"),
        ck_case("ck_other_model", [], "flux-tiny-schnell", "model=flux-tiny-schnell"),
        ck_case("ck_resume_off", [], "resume is off", "checkpoint.resume=false"),
        ck_case("ck_latest_traversal", [["write", "latest", "../../../in"]], "latest"),
        ck_case("ck_latest_file", [["write", "latest", "step_00000001/run.yaml"]], "latest"),
        ck_case("ck_trainer_state_truncated", [["truncate", f"{tag}/trainer_state_rank0.pt", 200]], "trainer_state"),
        ck_case("ck_ds_config_garbage", [["write", f"{tag}/ds_config.json", "{not json"]], "ds_config.json"),
        ck_case(
            "ck_optim_truncated",
            [["truncate", f"{tag}/zero_pp_rank_0_mp_rank_00_optim_states.pt", 5000]],
            "incomplete or corrupt",
        ),
        ck_case("ck_other_seed", [], "seed", "seed=7"),
        ck_case("ck_run_yaml_alias_bomb", [["write", f"{tag}/run.yaml", ALIAS_BOMB]], "aliases (*name) expand"),
        ck_case("ck_ds_config_deep", [["write", f"{tag}/ds_config.json", DEEP_JSON]], "nested more than 64"),
        # beside the intact files, a name DeepSpeed's glob (mp_rank_*_model_states.pt) picks first
        ck_case(
            "ck_planted_model_states",
            [["pickle", f"{tag}/mp_rank_00-a_model_states.pt", str(d / "PWNED")]],
            "mp_rank_00-a_model_states.pt, which no fluxzero save of this run writes",
        ),
        ck_case("ck_stray_file", [["write", f"{tag}/notes.txt", "mine"]], "notes.txt"),
    ]
    return cases


TRAIN_XFAIL: dict[str, str] = {}  # none left


@pytest.fixture(scope="module")
def trained(inputs):
    outs = inputs.parent / "outs"
    outs.mkdir()
    todo = _train_cases(inputs, outs)
    (inputs.parent / "cases.json").write_text(json.dumps([c[:4] for c in todo]))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AUDIT_TESTS": str(ROOT / "tests"), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(
        [sys.executable, "-c", CHILD, str(inputs.parent / "cases.json"), str(inputs.parent / "results.json")],
        env=env,
        cwd=inputs.parent,
        timeout=900,
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads((inputs.parent / "results.json").read_text()), {c[0]: c[4] for c in todo}


def _train_names():
    from tempfile import gettempdir

    names = [c[0] for c in _train_cases(Path(gettempdir()), Path(gettempdir()))][1:]
    return [
        pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=TRAIN_XFAIL[n])) if n in TRAIN_XFAIL else n
        for n in names
    ]


@pytest.mark.slow
def test_the_good_run_trains(trained):
    results, _ = trained
    assert results["base"][0] == 0, results["base"][1][-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("name", _train_names())
def test_training_refuses_bad_input(inputs, trained, name):
    results, words = trained
    code, text, same = results[name]
    words = words[name]
    assert not (inputs / "PWNED").exists(), "a checkpoint's pickle ran code"
    problem = _meets_bar(code, text, same)
    assert problem is None, problem
    assert words in text, text


EXPORT_CASES = [  # (name, damage ops relative to the copied output_dir, extra flags, words)
    ("export_empty_latest", [["write", "checkpoints/latest", ""]], [], "latest"),
    ("export_dangling_latest", [["write", "checkpoints/latest", "step_00000099"]], [], "step_00000099"),
    (
        "export_truncated",
        [["truncate", "checkpoints/step_00000002/mp_rank_00_model_states.pt", 1000]],
        [],
        "incomplete or corrupt",
    ),
    (
        "export_overwritten",
        [["flip", "checkpoints/step_00000002/zero_pp_rank_0_mp_rank_00_optim_states.pt", None]],
        [],
        "incomplete or corrupt",
    ),
    (
        "export_pickle_payload",
        [["pickle", "checkpoints/step_00000002/mp_rank_00_model_states.pt", "PWNED"]],
        [],
        "posix.system",
    ),
    ("export_ema_without_ema", [], ["--weights", "ema"], "EMA"),
    (
        "export_planted_model_states",
        [["pickle", "checkpoints/step_00000002/mp_rank_00-a_model_states.pt", "PWNED"]],
        [],
        "mp_rank_00-a_model_states.pt, which no fluxzero save of this run writes",
    ),
    ("export_merge_full_run", [], ["--merge"], "LoRA"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, ops, flags, words", EXPORT_CASES)
def test_export_refuses_a_damaged_checkpoint(inputs, trained, tmp_path, name, ops, flags, words):
    results, _ = trained
    assert results["base"][0] == 0
    run = tmp_path / "run"
    shutil.copytree(inputs.parent / "outs" / "base", run, ignore=shutil.ignore_patterns("export*"))
    for op, rel, arg in ops:
        damage(op, str(run / rel), str(tmp_path / arg) if op == "pickle" else arg)
    export_refused(run, tmp_path / "out.safetensors", flags, words, tmp_path / "PWNED")


def export_refused(run: Path, out: Path, flags: list, words: str, marker: Path) -> None:
    """`fluxzero export RUN OUT FLAGS` meets the bar, names `words`, writes no OUT and never creates `marker`."""
    from fluxzero.cli import main

    before = tree_hash(run)
    r = CliRunner().invoke(main, ["export", str(run), str(out), *flags])
    text = r.output + (
        f"\nTraceback (raised): {r.exc_info[1]!r}" if r.exception and not isinstance(r.exception, SystemExit) else ""
    )
    assert not marker.exists(), "a checkpoint's pickle ran code"
    problem = _meets_bar(r.exit_code, text, tree_hash(run) == before)
    assert problem is None, problem
    assert words in text and not out.exists(), text


# ---------------------------------------------------------------------------------------------------------
# Two ranks: batch arithmetic for the world size, a checkpoint of another world size
# ---------------------------------------------------------------------------------------------------------
TWO = textwrap.dedent("""
    import contextlib, io, json, os, sys, warnings
    warnings.filterwarnings("ignore")
    os.environ["FLUXZERO_NO_PROGRESS"] = "1"
    from fluxzero.train.loop import main
    from fluxzero.train.distributed import init_distributed
    init_distributed()
    for name, argv in json.load(open(sys.argv[1])):
        code = main(argv)
        sys.stderr.write(f"@@ {name} {code}\\n")
        sys.stderr.flush()
    os._exit(0)
""")


def two_rank_cases(todo: list, work: Path, timeout: float = 300) -> tuple[dict[str, tuple[int, str]], str]:
    """main(argv) of every [name, argv] case of `todo` on 2 ranks (one process pair for all): name -> (exit code,
    rank 0's output of that case), and rank 1's whole output."""
    from tests.helpers import popen_ranks

    (work / "cases.json").write_text(json.dumps(todo))
    procs = popen_ranks([sys.executable, "-c", TWO, str(work / "cases.json")], cwd=work)
    (_, err0), (_, err1) = [p.communicate(timeout=timeout) for p in procs]
    by_case, text = {}, ""
    for line in err0.splitlines(keepends=True):
        if line.startswith("@@ "):
            _, name, code = line.split()
            by_case[name], text = (int(code), text), ""
        else:
            text += line
    assert set(by_case) == {name for name, _ in todo}, err0[-3000:]
    return by_case, err1


@pytest.mark.slow
def test_two_ranks_refuse_batch_arithmetic_and_another_world_size(inputs, trained, tmp_path):
    """ds_batch6.json says train_batch_size 6 (right for 3 ranks); base's checkpoint was written by 1 rank."""
    results, _ = trained
    assert results["base"][0] == 0
    shutil.copytree(inputs.parent / "outs" / "base" / "checkpoints", tmp_path / "world" / "checkpoints")
    run = ["--config", str(inputs / "run.yaml")]
    todo = [
        ["batch6", [*run, f"output_dir={tmp_path / 'b6'}", f"deepspeed={inputs / 'ds_batch6.json'}"]],
        ["other_world", [*run, f"output_dir={tmp_path / 'world'}"]],
    ]
    before = tree_hash(inputs, tmp_path / "world" / "checkpoints")
    by_case, err1 = two_rank_cases(todo, tmp_path)
    assert tree_hash(inputs, tmp_path / "world" / "checkpoints") == before
    for name, words in [("batch6", "train_batch_size"), ("other_world", "rank")]:
        code, text = by_case[name]
        assert _meets_bar(code, text, True) is None, text
        assert words in text, text
    assert "Traceback" not in err1 and not _error_lines(err1), err1[-2000:]


# ---------------------------------------------------------------------------------------------------------
# Every reader of a JSON or YAML file fluxzero is given: nesting that would exhaust Python's stack, a YAML alias
# bomb, a YAML syntax error (one sentence, bounded, naming the file; the YAML one keeps PyYAML's line and column)
# ---------------------------------------------------------------------------------------------------------


def _safetensors_with(path: Path, meta: dict, tensors: dict | None = None) -> Path:
    import torch
    from safetensors.torch import save_file

    save_file(tensors or {"x": torch.zeros(1)}, str(path), meta)
    return path


def _read_run_file(tmp: Path, text: str):
    from fluxzero.config.runfile import load_config

    (tmp / "run.yaml").write_text(text)
    return load_config(str(tmp / "run.yaml"))


def _read_saved_run(tmp: Path, text: str):
    from fluxzero.config.runfile import read_saved_run

    (tmp / "run.yaml").write_text(text)
    return read_saved_run(tmp / "run.yaml", "restore it", ValueError)


def _reader_cases():
    """(name, reader(tmp) that raises, words its one sentence holds)."""

    def ds_json(tmp):
        from fluxzero.config.deepspeed.file import read_json

        (tmp / "ds.json").write_text('{"optimizer": ' + DEEP_JSON + "}")
        return read_json(tmp / "ds.json")

    def ckpt_ds_config(tmp):
        from fluxzero.train.checkpoint.resume import saved_view

        (tmp / "ds_config.json").write_text(DEEP_JSON)
        return saved_view(tmp / "ds_config.json")

    def lora_targets(tmp):
        import torch

        from fluxzero.model.lora_formats import read_lora

        t = {
            "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.zeros(4, 64),
            "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.zeros(192, 4),
        }
        return read_lora(_safetensors_with(tmp / "lora.safetensors", {"fluxzero.targets": DEEP_JSON}, t))

    def weights_header(tmp):
        from fluxzero.model.layouts import MODEL_METADATA
        from fluxzero.model.weights import declared

        return declared(_safetensors_with(tmp / "w.safetensors", {MODEL_METADATA: DEEP_JSON}))

    def diffusers_index(tmp):
        from fluxzero.model.layouts import DIFFUSERS_INDEX
        from fluxzero.model.weights import source_config

        (tmp / "config.json").write_text("{}")
        (tmp / DIFFUSERS_INDEX).write_text(DEEP_JSON)
        return source_config(tmp)

    def diffusers_config(tmp):
        from fluxzero.config.models import from_diffusers_config

        (tmp / "config.json").write_text(DEEP_JSON)
        return from_diffusers_config(tmp / "config.json")

    def manifest(tmp):
        from fluxzero.data.shards import MANIFEST, read_manifest

        (tmp / MANIFEST).write_text(DEEP_JSON)
        return read_manifest(tmp)

    def metadata_jsonl(tmp):
        from fluxzero.data.images import read_caption_table

        (tmp / "metadata.jsonl").write_text('{"file_name": "a.png", "text": "a"}\n' + DEEP_JSON + "\n")
        return read_caption_table(tmp / "metadata.jsonl")

    def embeddings(tmp):
        import torch

        from fluxzero.sampling.embeddings import FORMAT, VERSION, load_embeddings

        return load_embeddings(
            _safetensors_with(
                tmp / "emb.safetensors",
                {"format": FORMAT, "version": VERSION, "prompts": DEEP_JSON},
                {"t5": torch.zeros(1, 4, 64), "clip_pooled": torch.zeros(1, 32)},
            )
        )

    return [
        ("run_file_deep", lambda tmp: _read_run_file(tmp, DEEP_YAML), "nested more than"),
        ("run_file_alias_bomb", lambda tmp: _read_run_file(tmp, ALIAS_BOMB), "aliases"),
        (
            "run_file_tab",
            lambda tmp: _read_run_file(tmp, TAB_YAML),
            "found character '\\t' that cannot start any token at line 3, column 1",
        ),
        (
            "run_override_deep",
            lambda tmp: __import__("fluxzero.config.runfile").config.runfile.load_config(None, ["steps=" + "[" * 5000]),
            "steps=",
        ),
        ("saved_run_yaml_deep", lambda tmp: _read_saved_run(tmp, DEEP_YAML), "nested more than"),
        ("saved_run_yaml_bomb", lambda tmp: _read_saved_run(tmp, ALIAS_BOMB), "aliases"),
        ("deepspeed_json", ds_json, "nested more than"),
        ("checkpoint_ds_config", ckpt_ds_config, "ds_config.json"),
        ("lora_header", lora_targets, "fluxzero.targets"),
        ("weights_header", weights_header, "w.safetensors"),
        ("diffusers_index", diffusers_index, "index"),
        ("diffusers_config", diffusers_config, "config.json"),
        ("shard_manifest", manifest, "manifest"),
        ("metadata_jsonl", metadata_jsonl, "line 2"),
        ("embeddings_prompts", embeddings, "emb.safetensors"),
    ]


@pytest.mark.parametrize("name, reader, words", _reader_cases(), ids=[c[0] for c in _reader_cases()])
def test_reader_refuses_deep_or_aliased_input_in_one_sentence(tmp_path, name, reader, words):
    with pytest.raises(Exception) as e:
        reader(tmp_path)
    text = str(e.value)
    assert isinstance(e.value, ValueError) or type(e.value).__module__.startswith("fluxzero"), repr(e.value)[:500]
    assert words in text and "\n" not in text and len(text) < 400, text


def test_readers_that_skip_damage_skip_deep_lines(tmp_path):
    """metrics.jsonl on resume and the cache plan treat an unreadable record as damage (dropped, encoded again)."""
    from fluxzero.data.cache import _read_plan
    from fluxzero.train.metrics import truncate_jsonl

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n' + DEEP_JSON + '\n{"step": 2}\n')
    assert truncate_jsonl(tmp_path / "metrics.jsonl", 1) == 2
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'
    (tmp_path / "plan.json").write_text(DEEP_JSON)
    assert _read_plan(tmp_path / "plan.json") == {"fingerprint": "damaged"}


def test_an_excerpt_bounds_any_value_quoted_in_an_error():
    from fluxzero.config.runfile import ConfigError, load_config
    from fluxzero.config.user_files import excerpt, parse_yaml

    shared = parse_yaml(
        "a: &a ["
        + ", ".join(['"lol"'] * 9)
        + "]\n"
        + "".join(f"a{i}: &a{i} [{', '.join(['*a' + (str(i - 1) if i > 1 else '')] * 9)}]\n" for i in range(1, 5))
    )
    assert len(excerpt(shared["a4"])) < 120 and len(excerpt("x" * 10**6)) < 120
    with pytest.raises(ConfigError) as e:  # a large value within the bounds: quoted short
        load_config(None, ["deepspeed=a", "data=b", "output_dir=c", f"steps={list(range(3000))}"])
    assert "steps must be a whole number" in str(e.value) and len(str(e.value)) < 200, str(e.value)[:500]


# ---------------------------------------------------------------------------------------------------------
# Numbers without a bound in a run file: refused where they enter (the dataclasses), naming the setting and range
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "override, words",
    [
        (f"seed={2**70}", "seed must be a whole number from 0 to 2**63 - 1"),
        ("seed=-1", "seed must be a whole number from 0 to 2**63 - 1"),
        ("lora={rank: 100000000}", "lora.rank must be from 1 to the model's width 64"),
        ("lora={rank: 4, alpha: .inf}", "lora.alpha must be a positive number (finite)"),
        ("lora={rank: 4, targets: [nope.*]}", "matches no linear layer of flux-tiny"),
        ("model={preset: flux-tiny, theta: 0}", "theta (RoPE base) must be from 1 to"),
        ("model={preset: flux-tiny, theta: -3}", "theta (RoPE base) must be from 1 to"),
        (
            "model={preset: flux-tiny, mlp_ratio: 0.001}",
            "mlp_ratio 0.001 gives an MLP width of hidden_size x mlp_ratio = 0",
        ),
        ("model={preset: flux-tiny, mlp_ratio: .inf}", "mlp_ratio"),
        ("model={preset: flux-tiny, depth: 10000000000}", "depth must be from 0 to 1024"),
        ("model={preset: flux-tiny, hidden_size: 100000000, num_heads: 1}", "hidden_size"),
    ],
    ids=lambda v: v if len(v) < 40 else v[:40],
)
def test_run_file_refuses_unbounded_numbers(override, words):
    from fluxzero.config.runfile import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, ["deepspeed=ds.json", "data=d", "output_dir=o", "model=flux-tiny", override])
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


# ---------------------------------------------------------------------------------------------------------
# What gen-config writes and prints, the trainer accepts: its JSON passes the trainer's DeepSpeed checks and the
# run-file keys of its `next:` line load as the trainer loads a run file
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv",
    [
        ["--model", "flux-tiny"],
        ["--model", "flux-tiny", "--lora-rank", "8"],
        ["--model", "flux-tiny", "--lora-rank", "8", "--lora-targets", "double_blocks.*.img_attn.qkv,single_blocks.*"],
        ["--model", "flux-tiny", "--lora-rank", "4", "--lora-targets", "*.linear1"],
        ["--model", "flux-tiny", "--zero-stage", "2", "--fp8", "tensorwise", "--precision", "bf16"],
        ["--model", "flux-tiny", "--lora-rank", "8", "--fit", "--gpu-memory", "24", "--world-size", "1"],
        ["--model", "flux-tiny", "--fit", "--gpu-memory", "80", "--world-size", "2", "--ema", "bf16"],
        ["--model", "flux-tiny", "--optimizer-mode", "fused-adafactor-sr", "--offload-blocks", "2"],  # stage 0 chosen
    ],
    ids=lambda a: " ".join(a[2:]) or "plain",
)
def test_what_gen_config_writes_passes_the_trainers_checks(tmp_path, argv):
    from fluxzero.cli import main
    from fluxzero.config.deepspeed.file import load_for_training
    from fluxzero.config.runfile import load_config

    out = tmp_path / "ds.json"
    r = CliRunner().invoke(main, ["gen-config", *argv, "-o", str(out)])
    assert r.exit_code == 0, r.output
    world = int(argv[argv.index("--world-size") + 1]) if "--world-size" in argv else 1
    load_for_training(out, world)  # the trainer's checks of its DeepSpeed config (raises on a finding)
    nxt = [line for line in r.output.splitlines() if line.startswith("next: in run.yaml set ")]
    keys = nxt[0].removeprefix("next: in run.yaml set ").split("; then ")[0].split("; ") if nxt else []
    run = tmp_path / "run.yaml"
    keys = keys or [f"deepspeed: {out}"]
    run.write_text("\n".join(keys) + "\ndata: d\noutput_dir: o\nmodel: flux-tiny\n")
    cfg = load_config(str(run))
    assert (cfg.lora is not None) == ("--lora-rank" in argv) and cfg.deepspeed == str(out)


def test_convert_names_the_tensors_it_leaves_out(tmp_path):
    """A ComfyUI all-in-one checkpoint's VAE and text encoders are not the transformer's: convert says so."""
    import torch
    from safetensors.torch import save_file

    from fluxzero.cli import main
    from fluxzero.model import build_model
    from fluxzero.model.layouts import COMFY_PREFIX
    from fluxzero.model.weights import load_weights

    sd = build_model("flux-tiny").state_dict()
    save_file(
        {
            **{COMFY_PREFIX + k: v.contiguous() for k, v in sd.items()},
            "first_stage_model.w": torch.zeros(2),
            "cond_stage_model.a.w": torch.zeros(3),
            "cond_stage_model.b.w": torch.zeros(3),
        },
        str(tmp_path / "aio.safetensors"),
    )
    r = CliRunner().invoke(
        main, ["convert", str(tmp_path / "aio.safetensors"), str(tmp_path / "out.safetensors"), "--to", "bfl"]
    )
    assert r.exit_code == 0, r.output
    assert (
        "left out 3 tensors of IN that are not the transformer's: cond_stage_model.* (2), first_stage_model.* (1)"
        in r.output
    ), r.output
    assert set(load_weights(tmp_path / "out.safetensors")) == set(sd)


def test_gen_config_fit_never_writes_fp8_at_zero3(tmp_path):
    """--fit with --fp8 pinned on a GPU too small for ZeRO-2: the ZeRO-3 rows are not written (the trainer refuses
    fp8 at ZeRO-3), so gen-config writes a config the trainer accepts or nothing at all."""
    from fluxzero.cli import main
    from fluxzero.config.deepspeed.file import load_for_training

    out = tmp_path / "ds.json"
    r = CliRunner().invoke(
        main,
        [
            "gen-config",
            "--fit",
            "--fp8",
            "tensorwise",
            "--precision",
            "bf16",
            "--model",
            "flux-dev",
            "--gpu-memory",
            "40",
            "--world-size",
            "1",
            "-o",
            str(out),
        ],
    )
    if r.exit_code == 0:
        load_for_training(out, 1)
        ds = json.loads(out.read_text())  # the engine's rule, which older checks left to the trainer's start
        assert not (ds["zero_optimization"]["stage"] == 3 and "fp8" in ds.get("fluxzero", {})), ds
    else:
        assert "Traceback" not in r.output and "--fp8 with ZeRO-3 is not supported" in r.output and not out.exists()
