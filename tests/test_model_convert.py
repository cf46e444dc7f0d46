"""`fluxzero convert` through Click: layouts chain losslessly, dtype conversion, user mistakes exit 2."""
import torch
from click.testing import CliRunner

from fluxzero.cli import main
from fluxzero.model import build_model
from fluxzero.model import weights as W


def run(*args):
    return CliRunner().invoke(main, ["convert", *map(str, args)])


def test_convert_chain_is_lossless(tmp_path):
    torch.manual_seed(0)
    sd = build_model("flux-tiny").state_dict()
    W.save_weights(sd, tmp_path / "a.safetensors", layout="bfl")
    r = run(tmp_path / "a.safetensors", tmp_path / "d", "--to", "diffusers", "--max-shard-gb", "0.0002")
    assert r.exit_code == 0, r.output
    assert "diffusers" in r.output and f"{sum(t.numel() for t in sd.values()):,} parameters" in r.output
    assert len(list((tmp_path / "d").glob("diffusion_pytorch_model-*.safetensors"))) > 1
    assert run(tmp_path / "d", tmp_path / "c.safetensors", "--to", "comfyui").exit_code == 0
    assert W.detect_layout(tmp_path / "c.safetensors") == "comfyui"
    assert run(tmp_path / "c.safetensors", tmp_path / "b.safetensors", "--to", "bfl", "--model", "flux-tiny").exit_code == 0
    back = W.load_weights(tmp_path / "b.safetensors")
    assert all(torch.equal(back[k], sd[k]) for k in sd) and list(back) == list(sd)

    r = run(tmp_path / "b.safetensors", tmp_path / "h.safetensors", "--to", "bfl", "--dtype", "bf16")
    assert r.exit_code == 0, r.output
    half = W.load_weights(tmp_path / "h.safetensors")
    assert all(v.dtype == torch.bfloat16 and torch.equal(v, sd[k].bfloat16()) for k, v in half.items())


def test_convert_user_mistakes_exit_2_without_traceback(tmp_path):
    sd = build_model("flux-tiny").state_dict()
    W.save_weights(sd, tmp_path / "a.safetensors")
    cases = [
        ((tmp_path / "a.safetensors", tmp_path / "a.safetensors", "--to", "bfl"), "exists; pass --overwrite"),
        ((tmp_path / "a.safetensors", tmp_path / "out", "--to", "comfyui"), "give OUT a .safetensors name"),
        ((tmp_path / "a.safetensors", tmp_path / "x.safetensors", "--to", "bfl", "--model", "flux-schnell"),
         "missing"),
        ((tmp_path / "a.safetensors", tmp_path / "x.safetensors", "--to", "bfl", "--model", "nope"), "unknown model preset"),
        ((tmp_path / "a.safetensors", tmp_path / "x", "--to", "onnx"), "Invalid value for '--to'"),
    ]
    (tmp_path / "w.ckpt").write_bytes(b"\x80\x04pickle")
    cases.append(((tmp_path / "w.ckpt", tmp_path / "x.safetensors", "--to", "bfl"), "only .safetensors"))
    (tmp_path / "t.safetensors").write_bytes((tmp_path / "a.safetensors").read_bytes()[:2000])  # truncated copy
    cases.append(((tmp_path / "t.safetensors", tmp_path / "x.safetensors", "--to", "bfl"), "not a readable safetensors"))
    for dst, layout in [(tmp_path / "a.safetensors" / "x.safetensors", "bfl"), (tmp_path / "a.safetensors" / "d", "diffusers")]:
        cases.append(((tmp_path / "a.safetensors", dst, "--to", layout), f"cannot write {dst}"))  # under a file
    for args, text in cases:
        r = run(*args)
        assert r.exit_code == 2, (args, r.output)
        assert text in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "x.safetensors").exists()
