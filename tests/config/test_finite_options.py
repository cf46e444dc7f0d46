"""nan and inf are refused where they entered silently: the run file's flow options, and `fluxzero estimate`'s
(and `gen-config --fit`'s) memory sizes and margins, which printed FITS for nan."""

import math

import pytest
import yaml
from click.testing import CliRunner

from fluxzero.cli import main
from fluxzero.config import FlowConfig, TrainConfig

FLOW_FLOATS = {"logit_mean": 0.0, "logit_std": 1.0, "shift_value": 3.0, "guidance": 1.0}


@pytest.mark.parametrize("name", sorted(FLOW_FLOATS))
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_flow_options_must_be_finite(name, value):
    with pytest.raises(ValueError) as e:
        FlowConfig(**{name: value})
    assert str(e.value) == (
        f"flow.{name} must be a finite number, got {value}; remove it to use the default {FLOW_FLOATS[name]}"
    )


def test_a_run_file_with_yaml_infinity_is_refused():
    d = yaml.safe_load("deepspeed: ds.json\ndata: d\noutput_dir: o\nflow:\n  logit_mean: .inf\n")
    assert d["flow"]["logit_mean"] == math.inf  # YAML's spelling of infinity reaches the dataclass as a float
    with pytest.raises(ValueError, match=r"^flow.logit_mean must be a finite number, got inf; remove it"):
        TrainConfig.from_dict(d)
    assert TrainConfig.from_dict({**d, "flow": {"logit_mean": -0.5}}).flow.logit_mean == -0.5  # finite still fine


@pytest.mark.parametrize(
    "args, option, example",
    [
        (["--margin", "nan"], "--margin", "a fraction in [0, 1) such as 0.1"),
        (["--gpu-memory", "nan"], "--gpu-memory", "a size in GiB such as 80"),
        (["--gpu-memory", "inf"], "--gpu-memory", "a size in GiB such as 80"),
        (["--gpu-memory", "80", "--host-memory", "inf"], "--host-memory", "a size in GiB such as 80"),
    ],
)
def test_estimate_refuses_non_finite_numbers(args, option, example):
    r = CliRunner().invoke(main, ["estimate", "--model", "flux-tiny", *args])
    assert r.exit_code == 2, r.output
    value = args[args.index(option) + 1]
    assert f"Invalid value for '{option}': '{value}' is not a finite number; give {example}." in r.output, r.output
    assert "FITS" not in r.output and "Traceback" not in r.output


def test_estimate_with_finite_numbers_still_answers():
    r = CliRunner().invoke(main, ["estimate", "--model", "flux-tiny", "--gpu-memory", "80", "--margin", "0.2"])
    assert r.exit_code == 0, r.output
    assert "FITS" in r.output, r.output


@pytest.mark.parametrize(
    "args, option",
    [(["--gpu-memory", "inf"], "--gpu-memory"), (["--gpu-memory", "80", "--fit-margin", "nan"], "--fit-margin")],
)
def test_gen_config_fit_refuses_non_finite_numbers(tmp_path, args, option):
    r = CliRunner().invoke(main, ["gen-config", "--fit", "--model", "flux-tiny", *args, "-o", str(tmp_path / "d.json")])
    assert r.exit_code == 2, r.output
    assert f"Invalid value for '{option}'" in r.output and "is not a finite number" in r.output, r.output
    assert not (tmp_path / "d.json").exists()
