"""Selective activation checkpointing (fluxzero.activation_checkpointing.policy selective): the same gradients as
no checkpointing, eager and compiled, and the combinations it cannot run refused in one sentence. The memory it
keeps is measured against the memory model in tests/plan/test_memory_activations.py; through the trainer in
tests/train/test_train_compile.py."""

import json

import pytest
import torch
from click.testing import CliRunner

from fluxzero.config.deepspeed import check as ds_check
from fluxzero.model import build_model
from fluxzero.model.compile import apply_compile
from fluxzero.train.distributed import TrainingError
from fluxzero.train.recompute import apply_activation_checkpointing, checkpoint_function, checkpointed_indices


def _grads(how: str, every: int = 1) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = build_model("flux-tiny")
    if how == "selective":
        assert apply_activation_checkpointing(model, every, "torch", policy="selective") == len(
            checkpointed_indices(model, every)
        )
    elif how == "compiled selective":  # aot_eager: Dynamo and AOTAutograd's partitioner, no C++ build on CPU
        apply_compile(
            model,
            backend="aot_eager",
            checkpoint=(checkpoint_function("torch", "selective", compiled=True), checkpointed_indices(model, every)),
        )
    g = torch.Generator().manual_seed(1)
    B, I, T = 2, 16, 8
    img_ids = torch.zeros(B, I, 3)
    img_ids[..., 1] = torch.arange(I)
    args = (
        torch.randn(B, I, 64, generator=g),
        img_ids,
        torch.randn(B, T, 64, generator=g),
        torch.zeros(B, T, 3),
        torch.rand(B, generator=g),
        torch.randn(B, 32, generator=g),
        torch.ones(B),
    )
    model(*args).pow(2).mean().backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("how,every", [("selective", 1), ("selective", 3), ("compiled selective", 2)])
def test_gradients_equal_no_checkpointing(how, every):
    torch._dynamo.reset()
    ref, got = _grads("none"), _grads(how, every)
    for a, b in zip(ref, got):
        if how == "selective":  # the same ops on the same values, the matmuls' outputs reused: bit-identical
            assert torch.equal(a, b)
        else:  # AOTAutograd's graph may reorder fp32 sums
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def _ds(**fac):
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 1.0,
        "fluxzero": {"activation_checkpointing": {"every_k_blocks": 1, **fac}},
    }


@pytest.mark.parametrize(
    "fac,match",
    [
        (
            {"policy": "selective", "implementation": "deepspeed"},
            "policy selective needs implementation torch .*: set implementation torch or policy full",
        ),
        ({"policy": "selective", "every_k_blocks": 0}, "policy selective takes effect only with every_k_blocks >= 1"),
        ({"policy": "some"}, 'policy must be full or selective, got "some"'),
    ],
)
def test_check_refuses_what_selective_cannot_run(fac, match):
    import re

    problems = ds_check.check(_ds(**fac))
    assert len(problems) == 1 and re.search(match, problems[0]), problems
    assert ds_check.check(_ds(policy="selective")) == []


def test_gen_config_writes_the_policy_and_refuses_the_deepspeed_implementation():
    from fluxzero.cli import main

    base = ["gen-config", "--model", "flux-tiny"]
    full = CliRunner().invoke(main, base)
    sel = CliRunner().invoke(main, base + ["--checkpoint-policy", "selective"])
    assert full.exit_code == 0 and sel.exit_code == 0, (full.output, sel.output)
    full, sel = json.loads(full.stdout), json.loads(sel.stdout)
    assert "policy" not in full["fluxzero"]["activation_checkpointing"]  # the committed configs stay as they are
    assert sel["fluxzero"]["activation_checkpointing"] == {
        "every_k_blocks": 1,
        "implementation": "torch",
        "policy": "selective",
    }
    bad = CliRunner().invoke(main, base + ["--checkpoint-policy", "selective", "--checkpoint-impl", "deepspeed"])
    assert bad.exit_code == 2 and "--checkpoint-policy selective needs --checkpoint-impl torch" in bad.output
    assert "Traceback" not in bad.output


def test_the_engine_refuses_deepspeed_implementation_with_selective():
    with pytest.raises(TrainingError, match="policy selective needs implementation torch"):
        checkpoint_function("deepspeed", "selective")
