"""`fluxzero convert` through Click: layouts chain losslessly, dtype conversion, user mistakes exit 2."""

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from fluxzero.cli import main
from fluxzero.config import get_model_config
from fluxzero.model import build_model, layouts
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
    assert W._raw_files(tmp_path / "c.safetensors")[0] == "comfyui"
    assert (
        run(tmp_path / "c.safetensors", tmp_path / "b.safetensors", "--to", "bfl", "--model", "flux-tiny").exit_code
        == 0
    )
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
        ((tmp_path / "a.safetensors", tmp_path / "x.safetensors", "--to", "bfl", "--model", "flux-schnell"), "missing"),
        (
            (tmp_path / "a.safetensors", tmp_path / "x.safetensors", "--to", "bfl", "--model", "nope"),
            "unknown model preset",
        ),
        ((tmp_path / "a.safetensors", tmp_path / "x", "--to", "onnx"), "Invalid value for '--to'"),
    ]
    (tmp_path / "w.ckpt").write_bytes(b"\x80\x04pickle")
    cases.append(((tmp_path / "w.ckpt", tmp_path / "x.safetensors", "--to", "bfl"), "only .safetensors"))
    (tmp_path / "t.safetensors").write_bytes((tmp_path / "a.safetensors").read_bytes()[:2000])  # truncated copy
    cases.append(
        ((tmp_path / "t.safetensors", tmp_path / "x.safetensors", "--to", "bfl"), "not a readable safetensors")
    )
    for dst, layout in [
        (tmp_path / "a.safetensors" / "x.safetensors", "bfl"),
        (tmp_path / "a.safetensors" / "d", "diffusers"),
    ]:
        cases.append(((tmp_path / "a.safetensors", dst, "--to", layout), f"cannot write {dst}"))  # under a file
    for args, text in cases:
        r = run(*args)
        assert r.exit_code == 2, (args, r.output)
        assert text in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "x.safetensors").exists()


def _diffusers_folder(tmp_path, name, change):
    """A sharded diffusers folder of flux-tiny, then `change(folder)` breaks it."""
    d = tmp_path / name
    W.save_weights(build_model("flux-tiny").state_dict(), d, layout="diffusers", max_shard_bytes=400_000)
    change(d)
    return d


def _edit_index(edit):
    def change(d):
        index = d / layouts.DIFFUSERS_INDEX
        index.write_text(json.dumps(edit(json.loads(index.read_text()))))

    return change


def _move_to_other_shard(index):
    shards = sorted(set(index["weight_map"].values()))
    here = index["weight_map"]["x_embedder.weight"]
    index["weight_map"]["x_embedder.weight"] = next(s for s in shards if s != here)
    return index


def _one_int_tensor(d):
    shard = sorted(d.glob("diffusion_pytorch_model-*.safetensors"))[0]
    sd = load_file(str(shard))
    key = sorted(sd)[0]
    sd[key] = sd[key].to(torch.int32)
    save_file(sd, str(shard))


@pytest.mark.parametrize(
    "change, text",
    [
        (
            _edit_index(lambda i: {**i, "weight_map": list(i["weight_map"])}),
            'index.json: not a valid index file (it needs "weight_map"',
        ),
        (_edit_index(lambda i: list(i["weight_map"])), "index.json: not a valid index file (it needs"),
        (_edit_index(lambda i: {**i, "weight_map": {k: 1 for k in i["weight_map"]}}), "not a valid index file"),
        (
            _edit_index(_move_to_other_shard),
            "index.json: weight_map names shards that do not hold these tensors: "
            "x_embedder.weight -> diffusion_pytorch_model-000",
        ),
        (_one_int_tensor, "1 not floating point: "),
        (lambda d: (d / "config.json").write_text('{"axes_dims_rope": 56}'), "config.json: axes_dims_rope must be"),
        (
            lambda d: (d / "config.json").write_text('{"axes_dims_rope": [4, 4]}'),
            "RoPE axes (4, 4) do not sum to the head dim 16 of the tensors; fix axes_dims_rope",
        ),
    ],
    ids=[
        "weight_map-list",
        "index-list",
        "weight_map-numbers",
        "wrong-shard",
        "int-dtype",
        "axes-not-list",
        "axes-wrong-sum",
    ],
)
def test_convert_malformed_diffusers_folder_is_one_sentence(tmp_path, change, text):
    d = _diffusers_folder(tmp_path, "d", change)
    r = run(d, tmp_path / "x.safetensors", "--to", "bfl")
    assert r.exit_code == 2, r.exception  # an uncaught exception exits 1
    assert text in r.output and str(d) in r.output and "Traceback" not in r.output, r.output


def test_convert_malformed_files_are_one_sentence(tmp_path):
    sd = build_model("flux-tiny").state_dict()
    flat = dict(sd, **{"img_in.weight": torch.zeros(64)})  # a tensor of the wrong rank
    save_file({k: v.contiguous() for k, v in flat.items()}, str(tmp_path / "flat.safetensors"))
    (tmp_path / "folder").mkdir()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "folder" / "flux1-dev.safetensors"))
    # A diffusers folder cannot hold a model without qkv bias: refused before anything is written.
    nobias = get_model_config("flux-tiny").replace(hidden_size=128, num_heads=1, axes_dim=(16, 56, 56), qkv_bias=False)
    W.save_weights(build_model(nobias).state_dict(), tmp_path / "nobias.safetensors")
    cases = [
        (("flat.safetensors", "x.safetensors", "--to", "bfl"), "flat.safetensors: cannot infer the model shape"),
        (("folder", "x.safetensors", "--to", "bfl"), "it holds flux1-dev.safetensors: pass a file of those instead"),
        (("nobias.safetensors", "nb", "--to", "diffusers"), "nb not written: diffusers' FluxTransformer2DModel needs"),
    ]
    for (src, dst, *rest), text in cases:
        r = run(tmp_path / src, tmp_path / dst, *rest)
        assert r.exit_code == 2, r.exception
        assert text in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "nb").exists()


_FAILING_WRITES = """
import resource, sys
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))  # writes past 20 kB fail (EFBIG; Python ignores SIGXFSZ)
from fluxzero.cli import main
main(sys.argv[1:])
"""


def test_a_diffusers_folder_is_replaced_whole_or_not_at_all(tmp_path):
    import os
    import subprocess
    import sys

    from fluxzero.fsutil import remove_stale_temps
    from tests.test_bad_inputs import tree_hash

    torch.manual_seed(0)
    sd = build_model("flux-tiny").state_dict()
    W.save_weights(sd, tmp_path / "a.safetensors", layout="bfl")
    d = tmp_path / "d"
    assert run(tmp_path / "a.safetensors", d, "--to", "diffusers", "--max-shard-gb", "0.0002").exit_code == 0
    before = tree_hash(d)
    # convert DIR DIR --overwrite whose writes fail midway (a full disk): the old folder stays, nothing beside it
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            _FAILING_WRITES,
            "convert",
            str(d),
            str(d),
            "--to",
            "diffusers",
            "--dtype",
            "bf16",
            "--overwrite",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(W.__file__).rsplit("/fluxzero/", 1)[0]},
    )
    assert r.returncode == 2 and "cannot write" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert tree_hash(d) == before and sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "d"]
    # the same command with room: the new folder replaces the old one, its other shard count included
    assert run(d, d, "--to", "diffusers", "--dtype", "bf16", "--overwrite").exit_code == 0
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "diffusion_pytorch_model.safetensors"]
    assert all(torch.equal(v, sd[k].bfloat16()) for k, v in W.load_weights(d).items())
    # a writer killed between its two renames left the old folder aside and the new one beside: the old comes back
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    done = tree_hash(d)
    os.rename(d, tmp_path / f".d.old-{int(dead.stdout)}")
    (tmp_path / f".d.tmp-{int(dead.stdout)}").mkdir()
    assert sorted(remove_stale_temps(d)) == [f".d.old-{int(dead.stdout)}", f".d.tmp-{int(dead.stdout)}"]
    assert tree_hash(d) == done and sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "d"]
    # a folder holding anything else is not replaced
    (d / "notes.txt").write_text("mine")
    r = run(tmp_path / "a.safetensors", d, "--to", "diffusers", "--overwrite")
    assert r.exit_code == 2 and "holds notes.txt, which is not part of a diffusers transformer folder" in r.output
    assert (d / "notes.txt").read_text() == "mine"
