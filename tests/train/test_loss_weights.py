"""Per-token loss weights (cached masks, flow.mask_floor) and per-dataset loss weights in flow.loss, on flux-tiny."""

import pytest
import torch
import torch.nn.functional as F

from fluxzero.config import FlowConfig
from fluxzero.model import build_model
from fluxzero.model.packing import pack
from fluxzero.train import flow

CFG = FlowConfig()


def _batch(mask=None, loss_weight=None):
    g = torch.Generator().manual_seed(3)
    batch = {
        "latents": torch.randn(2, 16, 8, 8, generator=g),
        "t5": torch.randn(2, 4, 64, generator=g),
        "clip": torch.randn(2, 32, generator=g),
        "index": torch.tensor([0, 1]),
    }
    if mask is not None:
        batch["mask"] = mask
    if loss_weight is not None:
        batch["loss_weight"] = loss_weight
    return batch


def _left_half_mask():
    mask = torch.zeros(2, 4, 4)  # 8x8 latents -> 4x4 tokens
    mask[:, :, :2] = 1.0
    return mask


def _grads(model, batch, cfg=CFG, target_edit=None):
    """(loss, d loss / d prediction, parameter gradients) of one flux-tiny forward on `batch`."""
    model.zero_grad()
    inputs, target = flow.prepare_batch(batch, cfg, seed=0, epoch=0, guidance_embed=True)
    if target_edit is not None:
        target = target_edit(target)
    pred = model(**inputs)
    pred.retain_grad()
    loss = flow.loss(pred, target, flow.loss_weights(batch, cfg.mask_floor))
    loss.backward()
    return loss.detach(), pred.grad, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_masked_out_region_gives_no_gradient():
    torch.manual_seed(0)
    model = build_model("flux-tiny")
    mask = _left_half_mask()
    # the masked-out tokens as pack orders them (not as loss_weights reads the mask): pack a latent-sized copy
    latent_mask = mask.repeat_interleave(2, 1).repeat_interleave(2, 2)  # (B, 8, 8): each token's 2x2 patch
    out = pack(1 - latent_mask[:, None])[..., 0] > 0  # (B, 16)
    assert out.sum() == 16  # the right half of each sample: 8 of its 16 tokens
    loss, dpred, grads = _grads(model, _batch(mask))
    assert torch.count_nonzero(dpred[out]) == 0 and torch.count_nonzero(dpred[~out]) == dpred[~out].numel()

    # whatever the target is in the masked-out region, the loss and every parameter's gradient are the same
    def scramble(target):
        t = target.clone()
        t[out] = torch.randn(int(out.sum()), t.shape[-1]) * 100
        return t

    loss2, _, grads2 = _grads(model, _batch(mask), target_edit=scramble)
    assert torch.equal(loss, loss2) and all(torch.equal(grads[n], grads2[n]) for n in grads)

    # mask_floor keeps that share of the masked-out tokens' gradient
    floor = FlowConfig(mask_floor=0.1)
    _, dpred_floor, _ = _grads(model, _batch(mask), floor)
    _, dpred_plain, _ = _grads(model, _batch())
    torch.testing.assert_close(dpred_floor[out], 0.1 * dpred_plain[out], rtol=1e-5, atol=0)
    torch.testing.assert_close(dpred_floor[~out], dpred_plain[~out], rtol=1e-5, atol=0)


def test_without_masks_or_weights_the_loss_is_the_plain_mean_bit_for_bit():
    pred, tgt = torch.randn(2, 16, 64).bfloat16(), torch.randn(2, 16, 64)
    assert flow.loss_weights(_batch(), 0.3) is None
    assert torch.equal(flow.loss(pred, tgt, None), F.mse_loss(pred.float(), tgt))
    # an all-ones mask and weight 1 are the same loss up to float rounding (the plain path is taken without them)
    ones = flow.loss_weights(_batch(torch.ones(2, 4, 4), torch.ones(2)), 0.0)
    torch.testing.assert_close(flow.loss(pred, tgt, ones), F.mse_loss(pred.float(), tgt), rtol=1e-6, atol=0)


def test_a_datasets_loss_weight_scales_its_samples():
    pred, tgt = torch.randn(2, 16, 64), torch.randn(2, 16, 64)
    w = flow.loss_weights(_batch(loss_weight=torch.tensor([0.5, 2.0])), 0.0)
    per_sample = flow.sample_losses(pred, tgt)
    torch.testing.assert_close(flow.loss(pred, tgt, w), (0.5 * per_sample[0] + 2.0 * per_sample[1]) / 2)
    # with a mask too: the weights multiply
    w = flow.loss_weights(_batch(_left_half_mask(), torch.tensor([0.5, 2.0])), 0.0)
    assert w.shape == (2, 16) and set(w[0].tolist()) == {0.0, 0.5} and set(w[1].tolist()) == {0.0, 2.0}


@pytest.mark.parametrize("floor", [-0.1, 1.5, float("nan")])
def test_mask_floor_is_a_share(floor):
    with pytest.raises(ValueError, match="mask_floor"):
        FlowConfig(mask_floor=floor)
