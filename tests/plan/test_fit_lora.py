"""`gen-config --fit` and `estimate` for a LoRA and for the GPUs users own (24 GB, 16 GB, 48 GB, 80 GB): the model
born in its training dtype (no fp32 build peak), a quantized frozen base as an option, the LoRA's lr defaults, a
short "nothing fits", the host memory said on the last line, the next command. Pure Python; CliRunner."""

import json
import re

import pytest
from click.testing import CliRunner

from fluxzero import plan as memory
from fluxzero.cli import main
from fluxzero.config import get_model_config
from fluxzero.config.deepspeed import build as ds_config
from fluxzero.plan import GiB, RunSpec, estimate
from tests.pure_python import run_without_torch

DEV = get_model_config("flux-dev")


def gen(*args):
    r = CliRunner().invoke(main, ["gen-config", *args])
    return r, (json.loads(r.stdout) if r.exit_code == 0 and r.stdout.startswith("{") else None)


def predicted(stderr: str) -> tuple[float, float]:
    """(allocated, needed) GiB of the `chose ...` line."""
    m = re.search(r"predicted ([\d.]+) GiB allocated, ([\d.]+) GiB with allocator slack", stderr)
    return float(m.group(1)), float(m.group(2))


# ---------------------------------------------------------------------------------------------------------
# The memory model: no fp32 build peak, a quantized base
# ---------------------------------------------------------------------------------------------------------
def test_lora_engine_start_holds_no_fp32_model():
    """The model is born in bf16: building a ZeRO-2 LoRA engine holds the bf16 model and the flat adapters,
    not the 44.5 GiB fp32 model (issue 23 item 1)."""
    r = CliRunner().invoke(main, ["estimate", "--gpu", "rtx4090", "--lora-rank", "16", "--zero-stage", "2", "--json"])
    d = json.loads(r.stdout)
    init = next(i for i in d["items"] if i["name"] == "building the engine")
    base = next(i for i in d["items"] if i["name"] == "frozen base parameters (bf16)")
    assert init["gib"] < base["gib"] + 0.5 and d["peak_phase"] == "train"
    for stage in (0, 1, 2):
        e = estimate(RunSpec(DEV, stage=stage, lora_rank=16))
        assert e.gpu_phase("init") < 23 * GiB


def test_int8_base_is_a_byte_per_weight_plus_scales():
    bf16 = estimate(RunSpec(DEV, stage=2, lora_rank=16))
    int8 = estimate(RunSpec(DEV, stage=2, lora_rank=16, base_quant="int8"))
    base = {i.name: i.bytes for i in int8.items}["frozen base parameters (int8)"]
    assert 0.49 < base / {i.name: i.bytes for i in bf16.items}["frozen base parameters (bf16)"] < 0.51
    assert int8.gpu_total < bf16.gpu_total - 9 * GiB
    # each dequantized weight is saved for backward: without checkpointing every block's bf16 weights are alive
    plain = {i.name: i.bytes for i in estimate(RunSpec(DEV, stage=2, lora_rank=16, checkpoint_every=0)).items}
    q = {
        i.name: i.bytes
        for i in estimate(RunSpec(DEV, stage=2, lora_rank=16, checkpoint_every=0, base_quant="int8")).items
    }
    linear_weights = sum(i * o for n, (i, o) in memory.spec.linear_shapes(DEV).items() if "_blocks." in n)
    assert q["activations saved for backward"] - plain["activations saved for backward"] == 2 * linear_weights


def test_fp8_matmul_base_saves_no_dequantized_weight():
    """fp8-matmul multiplies the e4m3 weight itself: the same base bytes as int8, the bf16 base's saved activations
    (tests/plan/test_memory_activations.py measures the block), and one dequantized linear weight in backward."""
    items = {
        q: {
            i.name: i.bytes
            for i in estimate(RunSpec(DEV, stage=2, lora_rank=16, checkpoint_every=0, base_quant=q)).items
        }
        for q in (None, "int8", "fp8-matmul")
    }
    plain, int8, fp8mm = items[None], items["int8"], items["fp8-matmul"]
    assert fp8mm["frozen base parameters (fp8-matmul)"] == int8["frozen base parameters (int8)"]
    assert fp8mm["activations saved for backward"] == plain["activations saved for backward"]
    largest = max(i * o for n, (i, o) in memory.spec.linear_shapes(DEV).items() if "_blocks." in n)  # linear1
    assert fp8mm["backward working set"] - plain["backward working set"] == (4 + 2) * largest


@pytest.mark.parametrize(
    "args,word",
    [
        (["--base-quant", "int8"], "add --lora-rank"),
        (["--base-quant", "int8", "--lora-rank", "16", "--zero-stage", "3"], "stage 0, 1 or 2"),
    ],
)
def test_estimate_base_quant_refusals(args, word):
    r = CliRunner().invoke(main, ["estimate", *args])
    assert r.exit_code == 2 and word in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("command", ["estimate", "gen-config"])
def test_fp8_matmul_base_on_a_gpu_without_fp8_tensor_cores_is_refused(command, tmp_path):
    """--gpu names a card: fp8-matmul is refused on one without FP8 tensor cores (A100) in one sentence that names
    the kinds it can take, and accepted on an Ada card (RTX 4090)."""
    fit = ["--fit", "--world-size", "1", "-o", str(tmp_path / "ds.json")] if command == "gen-config" else []
    args = [command, *fit, "--lora-rank", "16", "--base-quant", "fp8-matmul", "--gpu"]
    r = CliRunner().invoke(main, [*args, "a100-80"])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert "--base-quant fp8-matmul needs FP8 tensor cores" in r.output and "--gpu a100-80 lacks" in r.output
    assert "use --base-quant fp8 (weight-only) or int8" in r.output
    r = CliRunner().invoke(main, [*args, "rtx4090"])
    assert r.exit_code == 0 and "FP8 tensor cores" not in r.output, r.output
    assert memory.GPU_FP8_MATMUL.issubset(memory.GPU_MEMORY_GIB)  # every card it names is one --gpu takes


def test_estimate_says_what_fits_instead_and_the_next_command():
    r = CliRunner().invoke(main, ["estimate", "--gpu", "rtx3090", "--lora-rank", "16", "--zero-stage", "2"])
    assert r.exit_code == 0 and "DOES NOT FIT" in r.output
    # the base in bf16, its last 40 blocks streamed from host memory (before: an int8 base, all resident)
    assert "What fits instead: ZeRO-0 without offload, the last 40 blocks streamed from host memory" in r.output
    assert "next: fluxzero gen-config --fit --gpu rtx3090 --world-size 1 --lora-rank 16 -o ds.json" in r.output
    # a card with FP8 tensor cores: the fp8-matmul base, nothing streamed, as gen-config --fit chooses there
    r = CliRunner().invoke(main, ["estimate", "--gpu", "rtx4090", "--lora-rank", "16", "--zero-stage", "2"])
    assert "What fits instead: ZeRO-0 without offload, fp8-matmul base, micro batch 8, every block" in r.output
    assert "streamed" not in r.output.split("What fits instead")[1]
    assert "next: fluxzero gen-config --fit --gpu rtx4090 --world-size 1 --lora-rank 16 -o ds.json" in r.output
    r = CliRunner().invoke(main, ["estimate", "--gpu", "h100", "--lora-rank", "16", "--zero-stage", "2", "--json"])
    d = json.loads(r.stdout)
    assert (
        d["fits"]
        and d["instead"] is None
        and d["next"].startswith("fluxzero gen-config --world-size 1 --lora-rank 16 --zero-stage 2")
    )


# ---------------------------------------------------------------------------------------------------------
# gen-config --lora-rank: the LoRA's lr, --fit's choices on the GPUs of issue 23
# ---------------------------------------------------------------------------------------------------------
def test_lora_lr_and_warmup_defaults():
    _, full = gen()
    _, lora = gen("--lora-rank", "16")
    assert full["optimizer"]["params"]["lr"] == 1e-5 and full["scheduler"]["params"]["warmup_num_steps"] == 98
    assert lora["optimizer"]["params"]["lr"] == ds_config.LORA_DEFAULTS["lr"] == 1e-4
    assert lora["scheduler"]["params"]["warmup_num_steps"] == ds_config.LORA_DEFAULTS["warmup_steps"] - 2
    _, given = gen("--lora-rank", "16", "--lr", "3e-4", "--warmup-steps", "50")
    assert given["optimizer"]["params"]["lr"] == 3e-4 and given["scheduler"]["params"]["warmup_num_steps"] == 48
    r, _ = gen("--lora-rank", "16", "--lora-targets", "attn")
    assert r.exit_code == 2 and "not a preset" in r.output


# GPU, resolution -> what --fit writes for a rank-16 LoRA on one GPU (issue 23's cases; the peaks are printed)
# a bf16 base with its last K blocks streamed from host memory where the card is short (measured on a 16 GB cap:
# 5.60 samples/s, against 1.58 for the int8 base that fits there only at micro batch 1); on a card with FP8 tensor
# cores the fp8-matmul base instead where it fits (measured at 24 GB: 7.39 against 6.31 streamed), not on the 16 GB
# RTX 4080 (it does not fit) nor where the bf16 base fits whole (H100, H200)
LORA_CASES = {
    ("rtx4090", "512"): {"stage": 0, "quant": "fp8-matmul", "offload_param": None, "streamed": 0},
    ("rtx4090", "1024"): {"stage": 0, "quant": "fp8-matmul", "offload_param": None, "streamed": 0},
    ("rtx3090", "512"): {"stage": 0, "quant": None, "offload_param": None, "streamed": 40},
    ("rtx4080", "512"): {"stage": 0, "quant": None, "offload_param": None, "streamed": 52},
    ("h100", "512"): {"stage": 0, "quant": None, "offload_param": None, "streamed": 0},
    ("h200", "512"): {"stage": 0, "quant": None, "offload_param": None, "streamed": 0},
}


@pytest.mark.parametrize("gpu,res", LORA_CASES)
def test_fit_lora_on_one_gpu(tmp_path, gpu, res):
    want = LORA_CASES[gpu, res]
    out = tmp_path / "ds.json"
    r = CliRunner().invoke(
        main,
        [
            "gen-config",
            "--fit",
            "--world-size",
            "1",
            "--gpu",
            gpu,
            "--host-memory",
            "64",
            "--lora-rank",
            "16",
            "--resolution",
            res,
            "-o",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    cfg = json.loads(out.read_text())
    z = cfg["zero_optimization"]
    assert z["stage"] == want["stage"] and z.get("offload_param", {}).get("device") == want["offload_param"]
    assert "offload_optimizer" not in z  # a LoRA's optimizer states are too small to be worth offloading
    assert cfg["fluxzero"].get("offload_blocks", 0) == want["streamed"]
    assert cfg["optimizer"]["params"]["lr"] == 1e-4
    # compiled below ZeRO-3 (the trainer refuses compile with a LoRA under ZeRO-3)
    assert cfg["fluxzero"].get("compile", {}).get("blocks", False) is (want["stage"] < 3)
    lora_line = "lora: {rank: 16, targets: attention+mlp" + (
        f", base_quant: {want['quant']}}}" if want["quant"] else "}"
    )
    last = r.stderr.strip().splitlines()[-1]
    assert (
        last == f"next: in run.yaml set deepspeed: {out}; {lora_line}; then deepspeed --num_gpus 1 "
        "launch/train.py --config run.yaml"
    )
    # the printed peak is the estimate of the file written, as `estimate --ds-config` reads it
    alloc, need = predicted(r.stderr)
    e = CliRunner().invoke(
        main,
        [
            "estimate",
            "--ds-config",
            str(out),
            "--lora-rank",
            "16",
            "--resolution",
            res,
            "--base-quant",
            want["quant"] or "none",
            "--gpu",
            gpu,
            "--json",
        ],
    )
    d = json.loads(e.stdout)
    assert d["fits"] and (round(d["gpu_allocated_gib"], 1), round(d["gpu_needed_gib"], 1)) == (alloc, need)


def test_fit_lora_pins_and_refusals():
    r, cfg = gen("--fit", "--world-size", "1", "--gpu", "rtx4090", "--lora-rank", "16", "--base-quant", "none")
    assert r.exit_code == 0, r.output
    assert cfg["fluxzero"]["offload_blocks"] == 40 and "int8" not in r.stderr and "fp8-matmul" not in r.stderr
    # the base streamed is a choice --fit makes: pinned to none, the bf16 base goes to ZeRO-3 parameter offload
    r, cfg = gen(
        "--fit",
        "--world-size",
        "1",
        "--gpu",
        "rtx4090",
        "--lora-rank",
        "16",
        "--base-quant",
        "none",
        "--offload-blocks",
        "0",
    )
    assert r.exit_code == 0, r.output
    assert cfg["zero_optimization"]["offload_param"]["device"] == "cpu" and not cfg["fluxzero"].get("offload_blocks")
    r, cfg = gen(
        "--fit", "--world-size", "1", "--gpu", "h100", "--lora-rank", "16", "--base-quant", "int8", "--no-compile"
    )
    assert r.exit_code == 0 and "base_quant: int8" in r.stderr and cfg["fluxzero"].get("compile") == {"blocks": False}
    r, _ = gen("--fit", "--world-size", "1", "--gpu", "h100", "--base-quant", "int8")
    assert r.exit_code == 2 and "add --lora-rank" in r.output


def test_fit_policy_is_the_memory_model_s():
    """commands/ parse and print; the search over gen-config's own configs is memory.fit_gen_config."""
    req = memory.FitRequest(memory.Hardware(23.6, 64), {"lora_rank": 16})
    plan = memory.fit_gen_config(ds_config.options_from(None, lora=True, world_size=1), {}, req)
    assert plan.overrides["zero_stage"] == 0 and plan.result.options["base_quant"] is None
    assert plan.result.options["offload_blocks"] == 40
    assert plan.overrides["compile"] is True and plan.host_warning is None
    # the same card with FP8 tensor cores: the fp8-matmul base, nothing streamed
    req = memory.FitRequest(memory.Hardware(23.6, 64, fp8_matmul=True), {"lora_rank": 16})
    plan = memory.fit_gen_config(ds_config.options_from(None, lora=True, world_size=1), {}, req)
    assert plan.result.options["base_quant"] == "fp8-matmul" and plan.result.options["offload_blocks"] == 0
    assert plan.overrides["zero_stage"] == 0 and plan.overrides["micro_batch"] == 8


def test_fit_chooses_the_fp8_matmul_base_on_a_gpu_with_fp8_tensor_cores(tmp_path):
    """--gpu rtx4090 (Ada): the fp8-matmul base, nothing streamed, where the bf16 base would be streamed (measured
    7.39 against 6.31 samples/s at 24 GB) or the int8 base chosen: the very config that pinning it writes for a
    24 GB card, and the reason says what it was chosen over. (rtx3090, h200: LORA_CASES.)"""
    pinned, chosen = tmp_path / "pinned.json", tmp_path / "chosen.json"
    common = ["--fit", "--world-size", "1", "--host-memory", "128", "--lora-rank", "16"]
    r, _ = gen(*common, "--gpu-memory", "24", "--base-quant", "fp8-matmul", "-o", str(pinned))
    assert r.exit_code == 0, r.output
    r, _ = gen(*common, "--gpu", "rtx4090", "-o", str(chosen))
    assert r.exit_code == 0, r.output
    a, b = json.loads(pinned.read_text()), json.loads(chosen.read_text())

    def key(c):
        return (
            c["train_micro_batch_size_per_gpu"],
            c["fluxzero"]["activation_checkpointing"],
            c["zero_optimization"]["stage"],
            c["fluxzero"].get("offload_blocks", 0),
        )

    assert key(a) == key(b) == (8, {"every_k_blocks": 1, "implementation": "torch"}, 0, 0)
    assert "lora: {rank: 16, targets: attention+mlp, base_quant: fp8-matmul}" in r.stderr
    assert "chose ZeRO-0 without offload, fp8-matmul base: micro batch 8" in r.stderr
    why = next(line for line in r.stderr.splitlines() if "fp8-matmul base: set lora.base_quant" in line)
    assert "chosen on an FP8 GPU over the bf16 base with its last 40 blocks streamed from host memory" in why
    assert "7.39 samples/s" in why and "benchmarks/RESULTS.md" in why and "--base-quant none keeps" in why
    assert "does not fit without parameter offload" not in r.stderr and "streamed from host memory (" not in r.stderr
    # little host memory: the choice before is the int8 base; fp8-matmul replaces it
    r, _ = gen("--fit", "--world-size", "1", "--gpu", "rtx4090", "--host-memory", "8", "--lora-rank", "16")
    assert r.exit_code == 0 and "base_quant: fp8-matmul}" in r.stderr, r.output
    assert "chosen on an FP8 GPU over the int8 base" in r.stderr


def test_fit_keeps_the_bf16_base_where_the_gpu_is_unknown_or_fp8_matmul_is_not_faster():
    """--gpu-memory alone: the GPU unknown, no FP8 tensor cores assumed, the bf16 base streamed as before. Where the
    fp8-matmul base fits only a smaller micro batch than the streamed bf16 base (16 GB at 384 px: 1 against 8), the
    streamed base stays: a small micro batch costs more than streaming (1.58 against 5.60 samples/s at 16 GB)."""
    r, cfg = gen("--fit", "--world-size", "1", "--gpu-memory", "24", "--lora-rank", "16")
    assert r.exit_code == 0 and "fp8-matmul" not in r.stderr and cfg["fluxzero"]["offload_blocks"] == 40, r.output
    r, cfg = gen("--fit", "--world-size", "1", "--gpu", "rtx4080", "--lora-rank", "16", "--resolution", "384")
    assert r.exit_code == 0 and "fp8-matmul" not in r.stderr and cfg["fluxzero"]["offload_blocks"] > 0, r.output


# ---------------------------------------------------------------------------------------------------------
# Full fine-tune: nothing fits in a few lines; an unchecked host said on the last line
# ---------------------------------------------------------------------------------------------------------
def test_nothing_fits_is_a_few_lines_of_what_would():
    # DeepSpeed's CPU Adam pinned (fp32 masters): the host modes would fit (test_fit_full_fine_tune_on_80_and_48_gb)
    r, _ = gen("--fit", "--world-size", "1", "--gpu", "rtx4090", "--host-memory", "128", "--adam-impl", "cpu")
    assert r.exit_code == 2
    message = r.output[r.output.index("gen-config --fit:") :]
    assert len(message.splitlines()) <= 10 and len(message) < 1400, message
    for tip in (
        "more GPUs: 16",
        "more host memory: ZeRO-3 with CPU offload of parameters and optimizer, given 309 GiB",
        "--host-memory 309",
        "NVMe:",
        "--nvme-path",
        "a LoRA instead of a full fine-tune",
        "--lora-rank 16",
    ):
        assert tip in message
    assert "host needs 277.4 GiB per node > 115.2 GiB budget" in message


def test_an_unchecked_host_beyond_common_machines_is_the_last_line(tmp_path):
    # DeepSpeed's CPU Adam pinned: the fused mode (test_memory_modes) needs only 16 GiB of host here
    r, cfg = gen(
        "--fit", "--world-size", "1", "--gpu", "rtx4090", "--adam-impl", "cpu", "-o", str(tmp_path / "ds.json")
    )
    assert r.exit_code == 0, r.output
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("warning: this config needs 277 GiB of host memory per node") and "--host-memory" in last
    r, _ = gen("--fit", "--world-size", "1", "--gpu", "rtx4090", "--lora-rank", "16")
    assert "warning" not in r.stderr  # 44 GiB: within a common machine
    r = CliRunner().invoke(main, ["estimate", "--gpu", "rtx4090"])  # what fits instead: the fused mode, 16 GiB
    assert "What fits instead: ZeRO-0 without offload, optimizer mode fused-adafactor-sr" in r.output
    assert "warning" not in r.output


def test_fit_full_fine_tune_on_80_and_48_gb():
    # the modes without a fused step (the fused one is chosen first: tests/plan/test_memory_modes.py)
    r, cfg = gen(
        "--fit", "--world-size", "1", "--gpu", "h100", "--host-memory", "120", "--optimizer-mode", "adafactor-sr"
    )
    assert r.exit_code == 0, r.output
    assert (cfg["zero_optimization"]["stage"], cfg["fluxzero"]["optimizer_mode"]) == (0, "adafactor-sr")
    # micro batch 16 with every block checkpointed: with the AdafactorSR step paid once per micro batch it beats micro
    # batch 4 with every 8th block checkpointed selectively (the choice before the step had a cost)
    assert cfg["train_micro_batch_size_per_gpu"] == 16
    assert cfg["fluxzero"]["activation_checkpointing"] == {"every_k_blocks": 1, "implementation": "torch"}
    assert predicted(r.stderr) == (49.0, 55.1)
    r, cfg = gen("--fit", "--world-size", "1", "--gpu", "a6000", "--host-memory", "120", "--offload-optimizer", "cpu")
    assert r.exit_code == 0, r.output  # bf16 masters and 8-bit states stepped on the host
    assert (cfg["zero_optimization"]["stage"], cfg["fluxzero"]["optimizer_mode"]) == (3, "cpu-adamw8bit-sr")
    r, _ = gen("--fit", "--world-size", "1", "--gpu", "a6000", "--host-memory", "120", "--optimizer-mode", "fp32")
    assert r.exit_code == 2 and "a LoRA instead of a full fine-tune: rank 16 fits with ZeRO-0" in r.output


def test_gen_config_fit_lora_runs_without_torch_or_deepspeed():
    r = run_without_torch("""
        from fluxzero.cli import main
        main(['gen-config', '--fit', '--world-size', '1', '--gpu', 'rtx4090', '--lora-rank', '16'])
    """)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["optimizer"]["params"]["lr"] == 1e-4 and "blocks streamed from host memory" in r.stderr


# ---------------------------------------------------------------------------------------------------------
# What a new user meets: a lone --gpu, nothing fitting a LoRA, the caveat of the plan's own kind
# ---------------------------------------------------------------------------------------------------------
def test_a_lone_gpu_is_one_gpu_as_estimate_assumes():
    r, cfg = gen("--fit", "--gpu", "rtx4090", "--lora-rank", "16", "--host-memory", "64")
    assert r.exit_code == 0, r.output
    assert "world size not given: 1 GPU (pass --world-size N for more)" in r.stderr
    assert cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"]
    assert "deepspeed --num_gpus 1 launch/train.py" in r.stderr


def test_nothing_fits_a_lora_names_the_memory_short_and_ends_in_one_sentence():
    r, _ = gen("--fit", "--gpu-memory", "1", "--host-memory", "8", "--lora-rank", "16")
    assert r.exit_code == 2 and "Usage:" not in r.output and "larger GPU" not in r.output, r.output
    assert (
        "It would fit with a GPU of 8 GiB or more (--gpu-memory 8, e.g. --gpu rtx4080) and 38 GiB of host memory "
        "per node (--host-memory 38): ZeRO-3 with optimizer offload cpu, parameter offload cpu, micro batch 1, "
        "every block checkpointed."
    ) in r.output, r.output
    last = r.output.strip().splitlines()[-1]
    assert last.startswith("Error: --fit: nothing fits 1 GPU(s) of 1 GiB") and last.endswith(
        "nothing was written (what would fit is above)."
    )
    assert gen("--fit", "--gpu-memory", "8", "--host-memory", "38", "--lora-rank", "16")[0].exit_code == 0


def test_the_compile_caveat_is_the_plan_s_own_kind():
    r, _ = gen("--fit", "--gpu", "h200", "--host-memory", "256")  # a full fine-tune at ZeRO-0: compiled
    assert r.exit_code == 0 and "compiled blocks" in r.stderr, r.output
    assert "LoRA" not in r.stderr and "a full fine-tune of flux-dev-lite: 11.5 -> 15.3 samples/s" in r.stderr
    r, _ = gen("--fit", "--gpu", "rtx4090", "--lora-rank", "16")
    assert "a rank-16 FLUX.1-dev LoRA: 3.48 -> 4.65 samples/s" in r.stderr, r.output


# ---------------------------------------------------------------------------------------------------------
# DoRA and LoKr (--lora-type): their own parameters, the run file's keys, the trainer's refusals
# ---------------------------------------------------------------------------------------------------------
def test_adapter_types_count_their_own_parameters():
    lora, dora, lokr = (RunSpec(DEV, stage=2, lora_rank=16, lora_type=t) for t in ("lora", "dora", "lokr"))
    rows = sum(
        o
        for n, (_, o) in memory.spec.linear_shapes(DEV).items()
        if any(__import__("fnmatch").fnmatchcase(n, p) for p in memory.lora_config(lora).patterns)
    )
    assert memory.trained_params(dora) == memory.trained_params(lora) + rows  # one magnitude per output row
    assert memory.trained_params(lokr) < memory.trained_params(lora) / 10
    assert estimate(dora).gpu_total > estimate(lora).gpu_total > estimate(lokr).gpu_total  # blocks checkpointed
    # not checkpointed, a LoKr's saved whole updates (out x in per adapted linear, per block) and a DoRA's
    # output-width tensors per token outweigh what their states save
    kept = {s.lora_type: estimate(s.replace(checkpoint_every=0)).gpu_total for s in (lora, dora, lokr)}
    assert kept["lokr"] > kept["dora"] > kept["lora"]
    r = CliRunner().invoke(
        main, ["estimate", "--lora-rank", "16", "--lora-type", "lokr", "--lora-factor", "16", "--json"]
    )
    d = json.loads(r.stdout)
    want = memory.trained_params(RunSpec(DEV, stage=2, lora_rank=16, lora_type="lokr", lora_factor=16))
    assert d["lora_type"] == "lokr" and d["trained_params"] == want != memory.trained_params(lokr)


def test_gen_config_names_the_adapter_type_and_refuses_what_the_trainer_refuses():
    r, _ = gen("--lora-rank", "16", "--lora-type", "lokr", "--lora-factor", "16", "--lora-decompose-both")
    assert (
        r.exit_code == 0
        and ("lora: {rank: 16, targets: attention+mlp, type: lokr, factor: 16, decompose_both: true}") in r.stderr
    )
    for args, word in (
        (("--lora-type", "dora"), "give --lora-rank too"),
        (("--lora-rank", "4", "--lora-type", "dora", "--base-quant", "int8"), "--base-quant"),
        (("--lora-rank", "4", "--lora-factor", "4"), "--lora-factor"),
    ):
        r, _ = gen(*args)
        assert r.exit_code == 2 and word in r.output and "Traceback" not in r.output, r.output
    r = CliRunner().invoke(main, ["estimate", "--lora-type", "dora"])  # the same sentence in both commands
    assert r.exit_code == 2 and "give --lora-rank too" in r.output
    # --fit never tries the int8 base for a DoRA (the trainer refuses one) and counts its magnitudes
    r, _ = gen("--lora-rank", "16", "--lora-type", "dora", "--fit", "--gpu", "rtx4090")
    assert "int8" not in r.stderr.split("next:")[-1] and "type: dora" in r.stderr
