"""FLUX.1's input format (fluxzero.model.packing): 2x2 packing and position ids, by hand and against diffusers."""

import pytest
import torch

from fluxzero.model import packing


def test_pack_unpack_round_trip_and_layout():
    x = torch.randn(2, 16, 6, 8)
    packed = packing.pack(x)
    assert packed.shape == (2, 12, 64)
    assert torch.equal(packing.unpack(packed, 6, 8), x)
    # token (row 1, col 2) holds latent pixels [2:4, 4:6] of every channel, channel-major, then ph, pw
    expected = x[0, :, 2:4, 4:6].reshape(-1)
    assert torch.equal(packed[0, 1 * 4 + 2], expected)


def test_pack_rejects_odd_sizes():
    with pytest.raises(ValueError, match="even"):
        packing.pack(torch.zeros(1, 16, 5, 8))


def test_ids():
    ids = packing.img_ids(2, 4, 6)
    assert ids.shape == (2, 6, 3)
    assert ids[0].tolist() == [[0, r, c] for r in range(2) for c in range(3)]
    t = packing.txt_ids(2, 5)
    assert t.shape == (2, 5, 3) and not t.any()


def test_packing_and_ids_match_diffusers_flux_pipeline():
    """diffusers' FluxPipeline is an independent implementation of the same conventions."""
    pipe = pytest.importorskip("diffusers.pipelines.flux.pipeline_flux")
    FluxPipeline = pipe.FluxPipeline
    x = torch.randn(2, 16, 6, 10)
    assert torch.equal(packing.pack(x), FluxPipeline._pack_latents(x, 2, 16, 6, 10))
    # diffusers unpacks from pixel sizes with the VAE's factor 8
    assert torch.equal(packing.unpack(packing.pack(x), 6, 10), FluxPipeline._unpack_latents(packing.pack(x), 48, 80, 8))
    ids = FluxPipeline._prepare_latent_image_ids(2, 3, 5, "cpu", torch.float32)  # (h/2 * w/2, 3)
    assert torch.equal(packing.img_ids(2, 6, 10)[0], ids)
