"""The memory-saving optimizer modes train like fp32 masters; bf16 round-to-nearest does not.

The problem: one least-squares layer, W (256 x 256) ~ N(0, 0.05), target W* = W0 + N(0, 0.01), inputs
X (512 x 256) ~ N(0, 1), loss = ||(W - W*) X^T||^2 / (512 * 256), full batch (so the only randomness is
stochastic rounding). AdamW at lr 1e-5 moves a weight ~1e-5 a step, 2e-4 of a typical |w| and under half
a bf16 ulp (1.2e-4 at 0.05): the fine-tuning regime where round-to-nearest loses most updates.

The bound: ||W_T - W_0|| and the final loss within 5% of the fp32 reference (the issue's bar). 400 steps, not
the issue's 200: torchao's bf16 m and v are rounded to nearest, v's EMA stalls (0.1% a step at beta2 0.999)
and its steps come out larger; measured +4.9% weight change at 200 steps, +4.4% at 400, too close to the bar
to make a test of. Round-to-nearest misses it by -79% (weight change) and +105% (loss) at 400 steps.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from fluxzero.config.optim_modes import MODES, get_mode  # noqa: E402
from fluxzero.train.optim.optimizers import AdafactorSR, OptimModeError, build_optimizer, stochastic_round_bf16  # noqa: E402
from tests.pure_python import ROOT, run_without_torch  # noqa: E402

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / "fluxzero-inductor"))

STEPS, LR, LR_ADAFACTOR = 400, 1e-5, 2e-4  # Adafactor's step is lr x RMS(W): 2e-4 x 0.05 = AdamW's 1e-5
BOUND = 0.05


class LeastSquares:
    """Loss and gradient of the problem above, through the Gram matrix C = X^T X / 512 (one matmul a step)."""

    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.w0 = torch.randn(256, 256, generator=g) * 0.05
        x = torch.randn(512, 256, generator=g)
        self.target = self.w0 + torch.randn(256, 256, generator=g) * 0.01
        self.gram = x.T @ x / x.shape[0]

    def loss_grad(self, w: torch.Tensor) -> tuple[float, torch.Tensor]:
        e = w.float() - self.target
        ec = e @ self.gram
        return (ec * e).sum().item() / 256, ec * (2 / 256)

    def train(self, make_opt, dtype: torch.dtype, steps: int = STEPS) -> tuple[float, float]:
        """(relative weight change ||W_T - W_0|| / ||W_0||, final loss)."""
        w = torch.nn.Parameter(self.w0.clone().to(dtype))
        torch.manual_seed(1)  # the stochastic-rounding draws
        opt = make_opt([w])
        for _ in range(steps):
            w.grad = self.loss_grad(w)[1].to(dtype)
            opt.step()
        return ((w.float() - self.w0).norm() / self.w0.norm()).item(), self.loss_grad(w)[0]


class LeastSquaresLayer(torch.nn.Module):
    """The problem as a module for DeepSpeed engines (tests/train/test_optim_deepspeed.py, test_host_optim_deepspeed
    .py): the weight is the only parameter (65536 values: a ZeRO partition torchao can quantize in 256-blocks);
    target and Gram matrix are plain attributes so DeepSpeed's bf16 cast leaves them fp32."""

    def __init__(self, problem: LeastSquares):
        super().__init__()
        self.problem = problem
        self.weight = torch.nn.Parameter(problem.w0.clone())

    def forward(self):
        e = self.weight.float() - self.problem.target
        return ((e @ self.problem.gram) * e).sum() / 256


def _within(run, ref) -> tuple[float, float]:
    return abs(run[0] / ref[0] - 1), abs(run[1] / ref[1] - 1)


@pytest.fixture(scope="module")
def problem():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CPU is shared; one thread is as fast for 256 x 256 on a busy machine
    yield LeastSquares()
    torch.set_num_threads(threads)


def test_adamw_modes_match_fp32_masters_and_rtn_does_not(problem):
    ref = problem.train(lambda p: build_optimizer(p, "fp32", lr=LR), torch.float32)
    assert ref[1] < 0.5 * problem.loss_grad(problem.w0)[0]  # the reference really trains (0.0257 -> 0.0122)
    for mode in ("bf16-sr", "bf16-kahan", "adamw8bit-sr"):
        dw, dl = _within(problem.train(lambda p: build_optimizer(p, mode, lr=LR), torch.bfloat16), ref)
        assert dw < BOUND and dl < BOUND, (mode, dw, dl)
    rtn = problem.train(lambda p: build_optimizer(p, "bf16-rtn", lr=LR, allow_comparison_only=True), torch.bfloat16)
    dw, dl = _within(rtn, ref)
    assert dw > BOUND and dl > BOUND, ("round-to-nearest should fail the bound", dw, dl)


def test_adafactor_sr_matches_fp32_adafactor_and_rtn_does_not(problem):
    """Adafactor is another algorithm (no momentum, relative steps): its reference is torch's on fp32."""
    ref = problem.train(lambda p: torch.optim.Adafactor(p, lr=LR_ADAFACTOR, foreach=False), torch.float32)
    sr = problem.train(lambda p: build_optimizer(p, "adafactor-sr", lr=LR_ADAFACTOR), torch.bfloat16)
    dw, dl = _within(sr, ref)
    assert dw < BOUND and dl < BOUND, (dw, dl)
    # torch's own on bf16 tensors, given fp32's eps1 so that rounding is the only difference
    eps = (torch.finfo(torch.float32).eps, 1e-3)
    rtn = problem.train(lambda p: torch.optim.Adafactor(p, lr=LR_ADAFACTOR, eps=eps, foreach=False), torch.bfloat16)
    dw, dl = _within(rtn, ref)
    assert dw > BOUND and dl > BOUND, (dw, dl)


def test_fused_adafactor_sr_matches_fp32_adafactor(problem):
    """The fused mode's step happens in the gradient hook during backward (fluxzero.train.optim.fused_step): the same
    problem through autograd, each step's update applied by loss.backward() itself, held to the same reference
    (round-to-nearest misses it: the test above)."""
    from fluxzero.train.optim.optimizers import FusedAdafactorSR

    ref = problem.train(lambda p: torch.optim.Adafactor(p, lr=LR_ADAFACTOR, foreach=False), torch.float32)
    layer = LeastSquaresLayer(problem).to(torch.bfloat16)
    opt = build_optimizer(layer.parameters(), "fused-adafactor-sr", lr=LR_ADAFACTOR, noise_seed=1)
    assert isinstance(opt, FusedAdafactorSR)
    opt.attach(torch.device("cpu"))
    for _ in range(STEPS):
        layer().backward()  # the update is applied here
        assert layer.weight.grad is None
        opt.step()
    w = layer.weight.detach()
    fused = (((w.float() - problem.w0).norm() / problem.w0.norm()).item(), problem.loss_grad(w)[0])
    dw, dl = _within(fused, ref)
    assert dw < BOUND and dl < BOUND, (dw, dl)


def test_adafactor_lr_is_relative_to_the_weights_rms():
    """The lr gen-config writes for the Adafactor modes (optim_modes._ADAFACTOR_DEFAULTS: 1e-3) assumes a step of
    lr x RMS(weight): the first step's update has RMS 1 (its second moment is g^2), so the weights move by that."""
    for rms in (0.018, 0.2):
        w = torch.nn.Parameter(torch.randn(256, 3072, generator=torch.Generator().manual_seed(0)) * rms)
        before = w.detach().clone()
        w.grad = torch.randn_like(w)
        AdafactorSR([w], lr=1e-3).step()
        step = (w.detach() - before).pow(2).mean().sqrt() / before.pow(2).mean().sqrt()
        assert step == pytest.approx(1e-3, rel=0.02), (rms, step)


def test_adafactor_sr_is_torchs_adafactor_on_fp32():
    """On fp32 tensors nothing is rounded: ours must be torch.optim.Adafactor (2-D factored, 1-D full).

    Tolerance 1e-6 relative: the same operations in the same order; only torch.norm's reductions may differ.
    """
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(32, 48)), torch.nn.Parameter(torch.randn(48))]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    a = AdafactorSR(ours, lr=1e-2, weight_decay=0.1)
    b = torch.optim.Adafactor(theirs, lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(20):
        grads = [torch.randn_like(p) for p in ours]
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        a.step()
        b.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_stochastic_rounding_is_unbiased():
    lo = torch.tensor(1.0, dtype=torch.bfloat16)
    ulp = 2.0**-7
    x = torch.full((200_000,), 1.0 + 0.3 * ulp)
    r = stochastic_round_bf16(x, generator=torch.Generator().manual_seed(0)).float()
    assert set(r.unique().tolist()) == {1.0, 1.0 + ulp}
    # mean of 200k Bernoulli(0.3) draws: sigma = sqrt(0.21 / 2e5) = 1e-3 ulp; 5 sigma
    assert abs((r.mean().item() - lo.item()) / ulp - 0.3) < 5e-3
    assert stochastic_round_bf16(torch.tensor([float("inf"), 2.0])).tolist() == [float("inf"), 2.0]


def test_bf16_modes_refuse_to_step_fp32_tensors():
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = build_optimizer([p], "bf16-kahan", lr=1e-3)
    p.grad = torch.randn_like(p)
    with pytest.raises(OptimModeError, match="bf16_master_weights_and_grads"):
        opt.step()


def test_rtn_is_refused_for_training_and_unknown_modes_name_the_choices():
    with pytest.raises(OptimModeError, match="comparison only"):
        build_optimizer([torch.nn.Parameter(torch.zeros(2))], "bf16-rtn", lr=1e-3)
    with pytest.raises(ValueError, match="choose one of: fp32, bf16-rtn"):
        build_optimizer([torch.nn.Parameter(torch.zeros(2))], "sgd", lr=1e-3)


def test_missing_torchao_is_one_sentence_naming_the_extra():
    code = textwrap.dedent("""
        import sys
        class _Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "torchao":
                    raise ImportError("blocked")
        sys.meta_path.insert(0, _Block())
        import torch
        from fluxzero.train.optim.optimizers import build_optimizer, OptimModeError
        try:
            build_optimizer([torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))], "bf16-sr", lr=1e-3)
        except OptimModeError as e:
            print(e)
        build_optimizer([torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))], "bf16-kahan", lr=1e-3)
    """)
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == (
        "optimizer mode 'bf16-sr' needs torchao: pip install -e '.[lowmem]' in the fluxzero checkout"
    )


def test_registry_is_pure_and_adds_up():
    r = run_without_torch("""
        from fluxzero.config.optim_modes import MODES
        print({n: m.total for n, m in MODES.items()})
    """)
    assert r.returncode == 0, r.stderr
    assert MODES["fp32"].total == 16 and MODES["bf16-sr"].total == 10 and MODES["bf16-kahan"].total == 12
    assert MODES["fp32"].master + MODES["fp32"].states == 12  # the 12 B/param
    assert get_mode("bf16-sr").ds_bf16_section(2)["bf16_master_weights_and_grads"] is True
    assert get_mode("bf16-sr").ds_bf16_section(0) == {}
    with pytest.raises(ValueError, match="unknown optimizer mode"):
        get_mode("adam")
    for m in MODES.values():
        assert m.extra in (None, "lowmem") and m.caveat
        # DeepSpeed refuses bf16 masters without its CPU Adam; the host modes are let through by the trainer
        assert m.offload_ok == (m.name == "fp32" or m.needs_offload)
    assert MODES["adafactor-sr"].bytes_at(0)["states"] == 0 and MODES["adafactor-sr"].bytes_at(2)["states"] == 2
    assert MODES["bf16-sr"].bytes_at(0)["master"] == 0  # ZeRO 0, bf16 off: the weights are the master


def test_adamw8bit_warns_when_a_tensor_cannot_be_quantized():
    p = torch.nn.Parameter(torch.zeros(5000, dtype=torch.bfloat16))  # >= 4096 values, not a multiple of 256
    opt = build_optimizer([p], "adamw8bit-sr", lr=1e-3)
    p.grad = torch.ones_like(p)
    with pytest.warns(UserWarning, match="keeps bf16 states for 5000 values"):
        opt.step()
