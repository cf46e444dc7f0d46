"""Facts written once: the quantized LoRA bases the run file accepts are the ones the memory model and --fit model,
the Adam(W) implementation table agrees with what gen-config writes and what the checker and the view read back,
`estimate` / `gen-config` share their options (names, choices, defaults; renamed ones keep their old name), and the
run file's sections reach the memory model through one conversion. Pure Python; CliRunner."""

import json

import pytest
from click.testing import CliRunner

from fluxzero import plan as memory
from fluxzero.cli import main
from fluxzero.commands import config as config_cmd
from fluxzero.commands import estimate as estimate_cmd
from fluxzero.config.deepspeed import adam_impl
from fluxzero.config.deepspeed import build as ds_config
from fluxzero.config.deepspeed import check as ds_check
from fluxzero.config.deepspeed import view as ds_view
from fluxzero.config.ema import EMA_DEVICES, EMA_DTYPES, EmaConfig
from fluxzero.config.lora import BASE_QUANTS, DEFAULT_TARGETS, LoraConfig
from fluxzero.plan import RunSpec


# ---------------------------------------------------------------------------------------------------------
# One BASE_QUANTS: the run file's kinds are the ones estimate and --fit model
# ---------------------------------------------------------------------------------------------------------
def test_every_base_quant_the_run_file_accepts_is_modelled():
    quantized = [q for q in BASE_QUANTS if q != "none"]
    assert set(memory.BASE_QUANT_BYTES) == set(quantized)
    assert ("auto", *BASE_QUANTS) == memory.BASE_QUANT_CHOICES
    for q in BASE_QUANTS:
        LoraConfig(rank=4, base_quant=q)  # the run file takes it
    bf16 = memory.base_bytes(RunSpec("flux-dev", lora_rank=16))
    for q in quantized:  # a quantized base is about half the bf16 one: 1 B a linear weight plus row scales
        b = memory.base_bytes(RunSpec("flux-dev", lora_rank=16, base_quant=q))
        assert 0.45 * bf16 < b < 0.55 * bf16, q


@pytest.mark.parametrize("quant", [q for q in BASE_QUANTS if q != "none"])
def test_estimate_and_fit_take_every_quantized_base(tmp_path, quant):
    r = CliRunner().invoke(main, ["estimate", "--lora-rank", "16", "--base-quant", quant, "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert any(i["name"] == f"frozen base parameters ({quant})" for i in d["items"])
    out = tmp_path / "ds.json"
    r = CliRunner().invoke(
        main, ["gen-config", "--fit", "--gpu", "rtx4090", "--lora-rank", "16", "--base-quant", quant, "-o", str(out)]
    )
    assert r.exit_code == 0, r.output
    assert f"base_quant: {quant}" in r.stderr and out.exists()


# ---------------------------------------------------------------------------------------------------------
# One Adam(W) implementation table
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", adam_impl.ADAM_IMPLS)
@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_adam_impl_round_trips_through_the_written_config(impl, offload):
    """What gen-config writes for --adam-impl is what the checker, the view and the memory model read back."""
    impl_ok = adam_impl.impl_for_offload(impl, offload)
    assert impl_ok == impl or (impl, offload) in (("fused", "cpu"), ("cpu", "none"))
    cfg = ds_config.build(ds_config.options_from(None, model="flux-tiny", adam_impl=impl_ok, offload_optimizer=offload))
    params = cfg["optimizer"]["params"]
    assert adam_impl.impl_of_params(params, offload) == impl_ok
    assert ds_view.view(cfg).optimizer_impl == adam_impl.optimizer_impl(impl_ok)
    assert memory.run_options_from_ds_config(cfg, 1)["optimizer_impl"] == adam_impl.optimizer_impl(impl_ok)
    assert ds_check.check(cfg, 1) == []
    opts = ds_config.options_from(None, model="flux-tiny", adam_impl=impl_ok, offload_optimizer=offload)
    assert ds_config.options_view(opts).optimizer_impl == ds_view.view(cfg).optimizer_impl


def test_a_hand_written_torch_adam_without_fused_is_the_foreach_one():
    assert adam_impl.optimizer_impl_of_params({"torch_adam": True}) == "torch"
    assert adam_impl.optimizer_impl_of_params({}) == "fused"
    assert set(adam_impl.OPTIMIZER_IMPLS) >= {adam_impl.optimizer_impl(i) for i in adam_impl.ADAM_IMPLS}


# ---------------------------------------------------------------------------------------------------------
# Shared CLI options: one name, one list of choices, one default
# ---------------------------------------------------------------------------------------------------------
def _params(cmd) -> dict:
    return {p.name: p for p in cmd.params}


def test_estimate_and_gen_config_share_names_choices_and_defaults():
    est, gen = _params(estimate_cmd.estimate), _params(config_cmd.gen_config)
    for name in (
        "hostfile",
        "nodes",
        "gpus_per_node",
        "gpu",
        "gpu_memory",
        "host_memory",
        "resolution",
        "txt_len",
        "margin",
        "lora_targets",
        "lora_type",
        "lora_factor",
        "adam_impl",
        "precision",
        "offload_optimizer",
        "offload_param",
    ):
        assert est[name].opts == gen[name].opts, name
        assert getattr(est[name].type, "choices", None) == getattr(gen[name].type, "choices", None), name
        assert est[name].default == gen[name].default or name in ("precision", "adam_impl"), name
    assert est["lora_targets"].default == gen["lora_targets"].default == DEFAULT_TARGETS == LoraConfig().targets
    assert est["margin"].default == gen["margin"].default
    assert tuple(est["precision"].type.choices) == ds_check.PRECISIONS
    assert tuple(est["adam_impl"].type.choices) == adam_impl.ADAM_IMPLS
    assert tuple(est["offload_param"].type.choices) == ds_check.OFFLOAD_DEVICES
    assert tuple(est["attention"].type.choices) == memory.ATTENTION_KERNELS
    assert tuple(est["base_quant"].type.choices) == BASE_QUANTS
    assert tuple(gen["base_quant"].type.choices) == memory.BASE_QUANT_CHOICES
    assert tuple(est["ema"].type.choices) == tuple(gen["fit_ema"].type.choices) == ("none", *EMA_DTYPES)
    assert tuple(est["ema_device"].type.choices) == tuple(gen["fit_ema_device"].type.choices) == EMA_DEVICES
    assert est["ds_path"].opts == ["--ds-config"]
    hidden = {p.opts[0] for p in (*estimate_cmd.estimate.params, *config_cmd.gen_config.params) if p.hidden}
    assert hidden == {"--config", "--fit-margin"}


def test_old_option_names_still_work_with_one_sentence(tmp_path):
    ds = tmp_path / "ds.json"
    assert CliRunner().invoke(main, ["gen-config", "--model", "flux-tiny", "-o", str(ds)]).exit_code == 0
    new = CliRunner().invoke(main, ["estimate", "--model", "flux-tiny", "--ds-config", str(ds), "--json"])
    old = CliRunner().invoke(main, ["estimate", "--model", "flux-tiny", "--config", str(ds), "--json"])
    assert new.exit_code == old.exit_code == 0 and json.loads(new.stdout) == json.loads(old.stdout)
    assert (
        old.stderr.strip()
        == (
            "note: --config is now --ds-config (--config is the run file in `fluxzero train`); "
            "the old name still works."
        )
        and not new.stderr
    )
    both = CliRunner().invoke(main, ["estimate", "--ds-config", str(ds), "--config", str(ds)])
    assert both.exit_code == 2 and "give --ds-config only" in both.output and "Traceback" not in both.output

    fit = ["gen-config", "--fit", "--model", "flux-tiny", "--gpu-memory", "4"]
    new = CliRunner().invoke(main, [*fit, "--margin", "0.3", "-o", str(tmp_path / "a.json")])
    old = CliRunner().invoke(main, [*fit, "--fit-margin", "0.3", "-o", str(tmp_path / "b.json")])
    assert new.exit_code == old.exit_code == 0, old.output
    assert (tmp_path / "a.json").read_text() == (tmp_path / "b.json").read_text()
    assert "30% margin" in new.stderr and "30% margin" in old.stderr
    assert "note: --fit-margin is now --margin; the old name still works." in old.stderr


# ---------------------------------------------------------------------------------------------------------
# One description of a run: the run file's sections -> RunSpec in one function, the way back in another
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "lora",
    [
        LoraConfig(rank=4, targets=["double_blocks.*.img_attn.qkv"], type="lokr", factor=4),
        LoraConfig(rank=8, targets="all-linear", type="lokr", decompose_both=True),
        LoraConfig(rank=8, dropout=0.1, type="dora"),
        LoraConfig(rank=16, base_quant="int8"),
    ],
)
def test_the_run_file_s_lora_and_ema_sections_reach_the_memory_model_whole(lora):
    """RunSpec.from_run carries every key of the sections the memory model reads (lora_config is the way back),
    and the trainer's host check reads a run through it, so a DoRA or LoKr is counted as one, as `estimate` does."""
    from fluxzero.train import host_memory

    ema = EmaConfig(dtype="bf16", device="cpu")
    spec = RunSpec.from_run("flux-dev", lora=lora, ema=ema, weights=False, stage=2, offload_optimizer="cpu")
    assert memory.lora_config(spec) == lora and (spec.ema, spec.ema_device, spec.load_bytes) == ("bf16", "cpu", 0)
    ds = ds_config.build(ds_config.options_from(model="flux-dev", lora=True, zero_stage=2, offload_optimizer="cpu"))

    def host_need(section: LoraConfig) -> int:
        return host_memory.run_host_need(
            spec.model, ds, ds_view.view(ds), world=1, local_world=1, ema=ema, lora=section
        )[0]

    plain = LoraConfig(rank=lora.rank, targets=lora.targets, dropout=lora.dropout, base_quant=lora.base_quant)
    if lora.type != "lora":  # the adapters' offloaded states and the EMA of them differ by type
        assert host_need(lora) != host_need(plain)
