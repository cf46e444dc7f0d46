"""The memory model with optimizer modes, LoRA and EMA; `gen-config --fit` over the modes on the three reference
machines; `--fit` models exactly the file it writes; `estimate` never says "yes" for an unchecked host.
Pure Python (the memory model has no torch); the CLI runs through CliRunner."""

import json
import math
import re

import pytest
from click.testing import CliRunner

from fluxzero import plan as memory
from fluxzero.cli import main
from fluxzero.config import LoraConfig, get_model_config, lora_param_count, optim_modes
from fluxzero.plan import RunSpec, estimate

DEV = get_model_config("flux-dev")
P = memory.param_inventory(DEV).total


def items(spec: RunSpec) -> dict[str, memory.Item]:
    return {i.name: i for i in estimate(spec).items}


@pytest.mark.parametrize("mode", [m for m, spec in optim_modes.MODES.items() if m != "bf16-rtn" and not spec.fused])
def test_mode_bytes_come_from_the_registry(mode):
    m = optim_modes.get_mode(mode)
    offload = "cpu" if m.needs_offload else "none"  # the host modes step DeepSpeed's offloaded partitions
    spec = RunSpec(DEV, gpus_per_node=4, stage=2, optimizer_mode=mode, offload_optimizer=offload)
    part = math.ceil(P / 4)
    it = items(spec)
    master = "bf16 master partition" if m.master_dtype == "bf16" else "fp32 master partition"
    assert it[master].bytes == int((m.master if m.master_dtype == "bf16" else 4) * part)
    assert it[master].where == ("host" if m.needs_offload else "gpu")
    states = m.states if m.states_flat is None else m.states_flat  # ZeRO 1-3 hand the optimizer flat partitions
    assert it[f"optimizer state partition ({mode})"].bytes == int(states * part)
    if m.needs_offload:  # bf16 gradients straight into the host buffer the optimizer reads
        assert it["bf16 master gradient partition (offloaded)"].bytes == 2 * part
        assert it["optimizer temporary at step (host)"].bytes == 32 * optim_modes.HOST_STEP_CHUNK  # one chunk
        return
    assert it["gradient partition (bf16)"].bytes == 2 * part
    # bf16 masters: the flattened bf16 gradient is handed over as it is, no fp32 copy at the step
    assert ("fp32 gradient partition at step" in it) is (m.master_dtype == "fp32")


def test_stage0_bf16_mode_steps_the_weights_themselves():
    it = items(RunSpec(DEV, stage=0, optimizer_mode="bf16-sr"))
    assert "fp32 master parameters" not in it and "fp32 gradient copies at step" not in it
    assert it["optimizer states (bf16-sr)"].bytes == 4 * P  # bf16 m and v, whole at ZeRO 0
    assert it["parameters (full, bf16)"].bytes == 2 * P and it["gradients (full, bf16)"].bytes == 2 * P


def test_modes_refuse_what_deepspeed_refuses():
    with pytest.raises(ValueError, match="does not offload for it"):
        RunSpec(DEV, stage=2, offload_optimizer="cpu", optimizer_mode="bf16-sr")
    with pytest.raises(ValueError, match="needs offload_optimizer cpu"):
        RunSpec(DEV, stage=2, optimizer_mode="cpu-bf16-sr")
    RunSpec(DEV, stage=3, offload_optimizer="cpu", optimizer_mode="cpu-adamw8bit-sr")  # on the host: fine
    with pytest.raises(ValueError, match="unknown optimizer mode"):
        RunSpec(DEV, optimizer_mode="bf16-fast")
    RunSpec(DEV, stage=3, offload_optimizer="cpu", offload_param="cpu", optimizer_mode="fp32")  # fp32 masters: fine


@pytest.mark.parametrize("mode", ["bf16-kahan", "adafactor-sr"])
def test_eager_modes_hold_one_chunk_of_temporaries_whatever_the_partition(mode):
    """KahanAdamW and AdafactorSR step a flat partition step_chunk elements at a time (tests/train/
    test_optim_chunked.py): the step's temporary is one chunk's, at 1 GPU (12B elements) as at 8."""
    chunk = optim_modes.get_mode(mode).step_chunk
    assert chunk == optim_modes.STEP_CHUNK
    for stage, gpus in ((1, 1), (2, 1), (2, 8), (3, 2)):
        it = items(RunSpec(DEV, gpus_per_node=gpus, stage=stage, optimizer_mode=mode))
        assert it["optimizer temporary at step"].bytes == int(memory.MODE_STEP_TEMP[mode] * chunk), (stage, gpus)
    # a mode without a step_chunk (torchao's, one compiled kernel per tensor) still counts its whole partition
    it = items(RunSpec(DEV, gpus_per_node=2, stage=2, optimizer_mode="bf16-sr"))
    assert it["optimizer temporary at step"].bytes == int(memory.MODE_STEP_TEMP["bf16-sr"] * math.ceil(P / 2))


def test_lora_trains_only_the_adapters():
    full, lora = RunSpec(DEV, stage=2), RunSpec(DEV, stage=2, lora_rank=16)
    A = lora_param_count(DEV, LoraConfig(rank=16))
    assert memory.trained_params(lora) == A and 0 < A < P / 50
    it = items(lora)
    assert it["frozen base parameters (bf16)"].bytes == 2 * (P - A)
    assert it["LoRA adapters (full, bf16)"].bytes == 2 * A
    assert it["gradient partition (bf16)"].bytes == 2 * A and it["fp32 master partition"].bytes == 4 * A
    assert it["optimizer state partition (fp32)"].bytes == 8 * A
    # ZeRO-3 partitions the frozen base too
    it3 = items(RunSpec(DEV, stage=3, gpus_per_node=4, lora_rank=16))
    assert it3["frozen base partition (bf16)"].bytes == 2 * math.ceil((P - A) / 4)
    # activations: the same saved tensors plus each adapter's A x (rank values per token), less the input of each
    # frozen linear no adapter covers (its weight takes no gradient)
    a_full, a_lora = (memory.activation_bytes(s.replace(checkpoint_every=0)) for s in (full, lora))
    extra = a_lora["per_block_double"] - a_full["per_block_double"]
    # attention+mlp adapts qkv, proj, mlp.0, mlp.2 of both streams: 4 x 16 values x (1024 + 512) tokens x 2 B; it
    # leaves the two modulation linears, whose input is one 3072-wide vector a sample
    assert extra == 4 * 16 * (1024 + 512) * 2 - 2 * 3072 * 2
    assert estimate(lora).gpu_phase("step") < estimate(full).gpu_phase("step") / 3


def test_ema_is_partitioned_like_the_optimizer_states():
    for stage, n, share in ((2, 4, 1 / 4), (3, 8, 1 / 8), (1, 2, 1 / 2)):
        it = items(RunSpec(DEV, stage=stage, gpus_per_node=n, ema="fp32"))
        assert it["EMA (fp32)"].bytes == int(4 * P * share)
    assert items(RunSpec(DEV, stage=2, ema="bf16"))["EMA (bf16)"].bytes == 2 * P
    host = items(RunSpec(DEV, stage=2, gpus_per_node=2, ema="bf16", ema_device="cpu"))["EMA (bf16)"]
    assert host.where == "host" and host.bytes == P  # 2 B / 2 ranks
    # a bf16-master mode at ZeRO 0 keeps no partitioned masters: the EMA is whole on every rank
    stage0 = RunSpec(DEV, stage=0, gpus_per_node=2, optimizer_mode="bf16-sr", ema="fp32")
    assert items(stage0)["EMA (fp32)"].bytes == 4 * P


def test_stage1_holds_a_whole_gradient_until_backward_ends():
    """benchmarks/archive/zero1_grad_probe.py on real engines: without overlap_comm every param.grad stays whole; with it,
    this rank's own gradients go into its partition but the other ranks' stay (b P/N + b P (N-1)/N = b P)."""
    for overlap in (True, False):
        spec = RunSpec(DEV, stage=1, gpus_per_node=8, zero=memory.ZeroSettings(overlap_comm=overlap))
        it = items(spec)
        part = math.ceil(P / 8)
        held = sum(
            i.bytes
            for n, i in it.items()
            if n.startswith("gradient")
            and i.phase in ("resident", "train")
            and "bucket" not in n
            and "being produced" not in n
        )
        assert held == (2 * P if overlap else 2 * P + 2 * part)


# ---------------------------------------------------------------------------------------------------------
# gen-config --fit on the reference machines (flux-dev full fine-tune, 512 px, 128 GiB host)
# ---------------------------------------------------------------------------------------------------------
def fit(*args):
    r = CliRunner().invoke(main, ["gen-config", "--fit", "--world-size", "1", *args])
    return r, (json.loads(r.stdout) if r.exit_code == 0 else None)


def test_fit_one_h200_needs_a_bf16_mode():
    r, _ = fit("--gpu", "h200", "--host-memory", "128", "--optimizer-mode", "fp32")
    assert r.exit_code == 2 and "nothing fits" in r.output  # fp32 masters: today's answer
    r, cfg = fit("--gpu", "h200", "--host-memory", "128")
    assert r.exit_code == 0, r.output
    assert cfg["zero_optimization"]["stage"] == 0 and cfg["fluxzero"]["optimizer_mode"] == "bf16-kahan"
    assert "bf16" not in cfg  # ZeRO 0: bf16 off, the trainer casts the model
    assert (
        cfg["train_micro_batch_size_per_gpu"] == 16
        and cfg["fluxzero"]["activation_checkpointing"]["every_k_blocks"] == 1
    )
    assert "optimizer mode bf16-kahan (KahanAdamW (ours)" in r.stderr  # its caveat, one line
    assert cfg["fluxzero"]["compile"] == {"blocks": True, "mode": "default"}  # what the trainer runs, written out
    assert optim_modes.get_mode("bf16-kahan").caveat in r.stderr


def test_fit_one_80gb_gpu():
    # fused-adafactor-sr comes first where it fits (test_fit_chooses_the_fused_mode...); adafactor-sr pinned here
    r, cfg = fit("--gpu", "h100", "--host-memory", "128", "--optimizer-mode", "adafactor-sr")
    assert r.exit_code == 0, r.output
    assert (cfg["zero_optimization"]["stage"], cfg["fluxzero"]["optimizer_mode"]) == (0, "adafactor-sr")
    # the AdafactorSR step, paid once per micro batch (OptimMode.step_s_per_billion), makes micro batch 16 with every
    # block checkpointed faster than micro batch 4 with every 8th (measured so for fused-adafactor-sr,
    # benchmarks/RESULTS.md); without the step term --fit chose the latter
    assert cfg["train_micro_batch_size_per_gpu"] == 16
    assert cfg["fluxzero"]["activation_checkpointing"]["every_k_blocks"] == 1
    assert "not AdamW's trajectory" in r.stderr
    r, cfg = fit("--gpu", "h100", "--host-memory", "128")
    assert (
        "ZeRO-0/1/2/3 without offload, optimizer mode adamw8bit-sr: even micro batch 1 with every block "
        "checkpointed does not fit: ZeRO-0: GPU needs 72.6 GiB > 71.2 GiB budget" in r.stderr
    )
    assert cfg["fluxzero"]["optimizer_mode"] == "fused-adafactor-sr"


@pytest.mark.parametrize("gpus, gib, micro", [(4, 48, 4), (2, 80, 2)])
def test_fit_several_gpus_choose_zero3_with_bf16_kahan(gpus, gib, micro):
    """Chunked steps put bf16-kahan at ZeRO-3 on 4 x 48 GB and 2 x 80 GB (its whole-partition step needed 98.3
    and 132.8 GiB, so --fit fell back to adamw8bit-sr); --fit tries the modes closest to fp32 masters first
    (docs/memory.md's table)."""
    r = CliRunner().invoke(
        main, ["gen-config", "--fit", "--world-size", str(gpus), "--gpu-memory", str(gib), "--host-memory", "128"]
    )
    assert r.exit_code == 0, r.output
    cfg = json.loads(r.stdout)
    assert (cfg["zero_optimization"]["stage"], cfg["fluxzero"]["optimizer_mode"]) == (3, "bf16-kahan")
    assert cfg["train_micro_batch_size_per_gpu"] == micro


def test_fit_one_24gb_gpu_needs_zero3_offload_and_a_larger_host():
    # DeepSpeed's CPU Adam on fp32 masters (the host modes fit there: test_fit_full_fine_tune_on_a_48gb_card...)
    r, _ = fit("--gpu", "rtx4090", "--host-memory", "128", "--adam-impl", "cpu")
    assert r.exit_code == 2
    assert (
        "ZeRO-3 with optimizer offload cpu, parameter offload cpu: even micro batch 1 with every block "
        "checkpointed does not fit (host needs 277.4 GiB per node > 115.2 GiB budget)" in r.output
    )
    assert "ZeRO-3 with CPU offload of parameters and optimizer, given 309 GiB of host memory per node" in r.output
    r, cfg = fit("--gpu", "rtx4090", "--host-memory", "320", "--adam-impl", "cpu")
    assert r.exit_code == 0, r.output
    z = cfg["zero_optimization"]
    assert (z["stage"], z["offload_optimizer"]["device"], z["offload_param"]["device"]) == (3, "cpu", "cpu")
    assert "optimizer_mode" not in cfg["fluxzero"] and cfg["train_micro_batch_size_per_gpu"] == 8
    assert "host memory: the choice needs 277.4 GiB per node of 288.0 GiB budget" in r.stderr


def test_fit_one_24gb_gpu_names_the_host_a_host_mode_needs():
    # pinned buffers as torch rounds them: nothing fits 128 GiB; the tip names the leanest mode's host, which fits
    # optimizer offload pinned: the fused mode, which streams blocks instead, fits 24 GB without it
    r, _ = fit("--gpu", "rtx4090", "--host-memory", "128", "--offload-optimizer", "cpu")
    assert r.exit_code == 2
    assert (
        "more host memory: ZeRO-3 with CPU offload of parameters and optimizer, optimizer mode cpu-adamw8bit-sr, "
        "given 184 GiB of host memory per node (--host-memory 184)" in r.output
    )
    r, cfg = fit("--gpu", "rtx4090", "--host-memory", "184", "--offload-optimizer", "cpu")
    assert r.exit_code == 0, r.output
    assert cfg["fluxzero"]["optimizer_mode"] == "cpu-adamw8bit-sr"
    assert "host memory: the choice needs 165.2 GiB per node of 165.6 GiB budget" in r.stderr


def test_fit_full_fine_tune_on_a_48gb_card_and_120gb_host_steps_on_the_host():
    """Issue 23's 48 GB case: bf16 masters and 8-bit states on the host (cpu-adamw8bit-sr) need 103 GiB (measured
    103.1 GiB on one H200: 91 before the pinned buffers' power-of-two rounding was counted), the bf16-state
    cpu-bf16-sr 125 GiB (over 120 GiB less the margin); fp32 masters on the host fit nothing."""
    r, _ = fit("--gpu-memory", "48", "--host-memory", "120", "--optimizer-mode", "fp32")
    assert r.exit_code == 2 and "nothing fits" in r.output
    r, cfg = fit("--gpu-memory", "48", "--host-memory", "120", "--offload-optimizer", "cpu")  # not the fused mode
    assert r.exit_code == 0, r.output
    z = cfg["zero_optimization"]
    assert (z["stage"], z["offload_optimizer"]["device"], "offload_param" in z) == (3, "cpu", False)
    assert cfg["fluxzero"]["optimizer_mode"] == "cpu-adamw8bit-sr" and cfg["zero_force_ds_cpu_optimizer"] is False
    assert cfg["bf16"] == optim_modes.BF16_MASTER_KEYS
    assert (
        "optimizer mode cpu-bf16-sr: even micro batch 1 with every block checkpointed does not fit: ZeRO-1: GPU "
        "needs 52.6 GiB"
        in r.stderr
        and "ZeRO-3: host needs 125.1 GiB per node > 108.0 GiB budget" in r.stderr
    )
    assert re.search(r"host memory: the choice needs 103\.3 GiB per node of 108\.0 GiB budget", r.stderr)
    r, cfg = fit("--gpu-memory", "48", "--host-memory", "140", "--offload-optimizer", "cpu")  # bf16 states fit
    assert r.exit_code == 0 and cfg["fluxzero"]["optimizer_mode"] == "cpu-bf16-sr", r.output


def test_fit_models_exactly_the_file_it_writes(tmp_path):
    """The new user's report: --adam-impl cpu modelled DeepSpeed's 5e8 buckets while 2e8 were written."""
    out = tmp_path / "ds.json"
    r = CliRunner().invoke(
        main,
        [
            "gen-config",
            "--fit",
            "--gpu",
            "h100",
            "--world-size",
            "1",
            "--adam-impl",
            "cpu",
            "--host-memory",
            "512",
            "--checkpoint-policy",
            "full",
            "-o",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    cfg = json.loads(out.read_text())
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 200_000_000
    predicted = float(re.search(r"chose .*?, ([\d.]+) GiB with allocator slack", r.stderr).group(1))
    e = CliRunner().invoke(
        main, ["estimate", "--ds-config", str(out), "--gpu", "h100", "--host-memory", "512", "--json"]
    )
    d = json.loads(e.output)
    assert d["micro_batch"] == cfg["train_micro_batch_size_per_gpu"] == 16
    assert d["fits"] and round(d["gpu_needed_gib"], 1) == predicted


def test_fit_says_when_the_host_was_not_checked():
    r = CliRunner().invoke(
        main, ["gen-config", "--fit", "--gpu", "a100-80", "--world-size", "1", "--optimizer-mode", "fp32"]
    )
    assert r.exit_code == 0, r.output
    assert "host memory not given: not checked" in r.stderr
    assert re.search(r"host memory: the choice needs [\d.]+ GiB per node \(not checked", r.stderr)


def test_estimate_never_says_yes_for_an_unchecked_host():
    r = CliRunner().invoke(main, ["estimate", "--gpu", "h200", "--gpus-per-node", "8", "--json"])
    d = json.loads(r.output)
    assert d["host_checked"] is False and {row["fits"] for row in d["table"]} <= {"gpu", "no"}
    r = CliRunner().invoke(main, ["estimate", "--gpu", "h200", "--gpus-per-node", "8"])
    assert "FITS THE GPU" in r.output and "host memory not checked" in r.output
    assert not re.search(r"\byes$", r.output, re.M)
    r = CliRunner().invoke(main, ["estimate", "--gpu", "h200", "--gpus-per-node", "8", "--host-memory", "2048"])
    assert re.search(r"\byes$", r.output, re.M) and "FITS: " in r.output


def test_estimate_options_and_config_read_the_mode(tmp_path):
    r = CliRunner().invoke(main, ["estimate", "--optimizer-mode", "bf16-sr", "--zero-stage", "0", "--json"])
    d = json.loads(r.output)
    assert any(i["name"] == "optimizer states (bf16-sr)" for i in d["items"])
    path = tmp_path / "ds.json"
    assert (
        CliRunner()
        .invoke(main, ["gen-config", "--optimizer-mode", "adamw8bit-sr", "--zero-stage", "0", "-o", str(path)])
        .exit_code
        == 0
    )
    d = json.loads(CliRunner().invoke(main, ["estimate", "--ds-config", str(path), "--json"]).output)
    assert d["precision"] == "bf16" and any(i["name"] == "optimizer states (adamw8bit-sr)" for i in d["items"])
    d = json.loads(CliRunner().invoke(main, ["estimate", "--lora-rank", "32", "--ema", "bf16", "--json"]).output)
    names = {i["name"] for i in d["items"]}
    assert {"frozen base parameters (bf16)", "EMA (bf16)"} <= names


def test_fit_counts_the_optimizer_step_once_per_micro_batch():
    """Measured on one H200 (benchmarks/RESULTS.md, 2026-12-04): bf16-sr at micro batch 4 without recompute ran at
    3.18 samples/s, at 16 with every block recomputed 5.13; the proxy without the step term chose the former."""
    small = RunSpec("flux-dev", stage=0, micro_batch=4, checkpoint_every=0, optimizer_mode="bf16-sr")
    large = small.replace(micro_batch=16, checkpoint_every=1)
    assert memory.throughput_proxy(large) > memory.throughput_proxy(small)
    r, ds = fit(
        "--model",
        "flux-dev",
        "--gpu",
        "h200",
        "--host-memory",
        "128",
        "--optimizer-mode",
        "bf16-sr",
        "--checkpoint-policy",
        "full",
    )  # selective, not measured yet, takes micro batch 8
    assert (
        ds["train_micro_batch_size_per_gpu"] == 16 and ds["fluxzero"]["activation_checkpointing"]["every_k_blocks"] == 1
    )


def test_fit_with_an_ema_counts_its_memory_and_names_the_section():
    _, plain = fit("--model", "flux-dev", "--gpu", "h200", "--host-memory", "128")
    r, ds = fit("--model", "flux-dev", "--gpu", "h200", "--host-memory", "128", "--ema", "fp32")
    # bf16-kahan (66 GiB of states) leaves no room for a 44 GiB fp32 EMA beside it on one H200
    assert plain["fluxzero"]["optimizer_mode"] == "bf16-kahan"
    assert ds["fluxzero"]["optimizer_mode"] != "bf16-kahan"
    assert "ema: {dtype: fp32, device: gpu}" in r.output


@pytest.mark.parametrize(
    "gib, host, px, streamed",
    [(24, 64, 512, True), (16, 64, 512, True), (48, 96, 512, False), (80, 120, 512, False), (24, 64, 1024, True)],
)
def test_fit_chooses_the_fused_mode_on_one_card(gib, host, px, streamed):
    """One card below an H200: no AdamW mode fits without offload, and the fused mode (no gradient buffer) beats
    adafactor-sr at 48/80 GB and ZeRO-3 offload at 24/16 GB, streaming blocks from the host where the GPU is short."""
    r, cfg = fit("--gpu-memory", str(gib), "--host-memory", str(host), "--resolution", str(px))
    assert r.exit_code == 0, r.output
    fz = cfg["fluxzero"]
    assert (cfg["zero_optimization"]["stage"], fz["optimizer_mode"]) == (0, "fused-adafactor-sr")
    assert (fz["offload_blocks"] > 0) is streamed
    assert cfg["gradient_clipping"] == 0.0 and cfg["gradient_accumulation_steps"] == 1 and "bf16" not in cfg
    assert "Adafactor's trajectory" in r.stderr  # which update rule it follows, said by --fit
    if streamed:
        assert f"the last {fz['offload_blocks']} blocks streamed from host memory" in r.stderr
        assert "host -> GPU, recompute in backward" in r.stderr
    spec = memory.RunSpec(
        DEV,
        stage=0,
        optimizer_mode="fused-adafactor-sr",
        height=px,
        width=px,
        micro_batch=cfg["train_micro_batch_size_per_gpu"],
        offload_blocks=fz["offload_blocks"],
        checkpoint_every=fz["activation_checkpointing"]["every_k_blocks"],
    )
    assert (
        estimate(spec).gpu_total / memory.GiB <= gib * 0.9 and estimate(spec).host_per_node / memory.GiB <= host * 0.9
    )


def test_fused_mode_memory_items():
    """What the fused mode holds: no gradient buffer, the streamed blocks' bf16 weights on the host (pinned in
    place: no rounding), three block copies on the GPU, and what moves per micro batch."""
    plain = items(RunSpec(DEV, stage=0, optimizer_mode="adafactor-sr"))
    fused = items(RunSpec(DEV, stage=0, optimizer_mode="fused-adafactor-sr"))
    assert "gradients (full, bf16)" in plain and "gradients (full, bf16)" not in fused
    assert "allreduce bucket" not in fused and fused["parameters (full, bf16)"].bytes == 2 * P
    inv = memory.param_inventory(DEV)
    s = RunSpec(DEV, stage=0, optimizer_mode="fused-adafactor-sr", offload_blocks=40)
    it = items(s)
    streamed = 38 * inv.single_block + 2 * inv.double_block  # the LAST 40: every single block, two double ones
    assert it["streamed block weights (bf16, pinned)"].bytes == 2 * streamed
    assert it["streamed block weights (bf16, pinned)"].where == "host" and "pinned-memory rounding" not in it
    assert it["parameters (resident, bf16)"].bytes == 2 * (P - streamed)
    assert it["streamed block copies (3 blocks)"].bytes == 3 * 2 * inv.double_block
    assert memory.stream_traffic(s) == [
        ("host -> GPU, forward", 2 * streamed),
        ("host -> GPU, recompute in backward", 2 * streamed),
        ("GPU -> host, updated weights", 2 * streamed),
    ]
    assert memory.activation_bytes(s.replace(checkpoint_every=0))["checkpointed"] == 40  # streamed: recomputed
    with pytest.raises(ValueError, match="needs a fused optimizer mode"):
        RunSpec(DEV, stage=0, optimizer_mode="adafactor-sr", offload_blocks=4)
    with pytest.raises(ValueError, match="does not run at ZeRO stage 2"):
        RunSpec(DEV, stage=2, optimizer_mode="fused-adafactor-sr")


# FLUX.1-dev full fine-tunes measured on one H100 (2026-12-05, benchmarks/results/2026-12-h100/fit_full.jsonl, eager
# Adafactor step): micro batch, every k-th block checkpointed, policy, blocks streamed, px -> peak allocated GiB
MEASURED_FUSED = [
    (8, 1, "full", 44, 512, 14.87),
    (8, 8, "selective", 56, 512, 7.98),
    (16, 1, "full", 0, 512, 34.00),
    (4, 4, "selective", 0, 512, 57.52),
    (2, 1, "full", 44, 1024, 13.39),
]


@pytest.mark.parametrize("micro, every, policy, streamed, px, measured", MEASURED_FUSED)
def test_fused_mode_predicts_the_measured_peaks(micro, every, policy, streamed, px, measured):
    """Within 10% of what the GPU measured, on the safe side but for the 48 GB row (-0.3%): the step's working set
    counted beyond the block's own (both together over-predicted every row by 2.0 GiB), the streamed copies at the
    size of the blocks in flight at the backward peak (single blocks: 3 x 0.26 GiB, not 3 x 0.63)."""
    spec = RunSpec(
        DEV,
        stage=0,
        optimizer_mode="fused-adafactor-sr",
        micro_batch=micro,
        checkpoint_every=every,
        checkpoint_policy=policy,
        offload_blocks=streamed,
        height=px,
        width=px,
    )
    assert estimate(spec).gpu_allocated / memory.GiB == pytest.approx(measured, rel=0.1)
    if streamed and every == 1:
        inv = memory.param_inventory(DEV)
        assert items(spec)["streamed block copies (3 blocks)"].bytes == 3 * 2 * inv.single_block
