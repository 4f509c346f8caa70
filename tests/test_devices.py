"""The original's GPU flags keep their meaning: recipe ``devices`` and the evaluation scripts' ``--device``."""

from __future__ import annotations

import sys

import pytest

from optima.config import SC_DEVICE_SPAN, SWEEP_DEVICE_SPAN, RecipeError, expand_device_flag, parse_devices
from optima.hardware.placement import place_replicas
from tests.test_scripts import load_script

EIGHT = [str(i) for i in range(8)]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),  # every visible GPU
        (7, [0, 1, 2, 3, 4, 5, 6, 7]),  # the original's devices: 7 = GPU 7 plus GPUs 0..6
        (0, [0]),
        (3, [0, 1, 2, 3]),
        ([7], [7]),  # a list names GPUs exactly
        ([0, 3], [0, 3]),
        ("3", [3]),  # so does a string
        ("0, 2,5", [0, 2, 5]),
    ],
)
def test_recipe_devices(value, expected):
    assert parse_devices(value) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [(-1, ">= 0"), ([1, 1], "twice"), ("0,x", "got '0,x'"), ("", "got ''"), (True, "got True"), ([-2], ">= 0")],
)
def test_bad_recipe_devices(value, message):
    with pytest.raises(RecipeError, match=message) as error:
        parse_devices(value)
    assert error.value.field == "devices"


@pytest.mark.parametrize(
    ("flag", "span", "expected"),
    [
        ("0", SWEEP_DEVICE_SPAN, [0, 1, 2, 3]),  # inference_script.py --device 0: four servers
        ("4", SWEEP_DEVICE_SPAN, [4, 5, 6, 7]),
        ("0", SC_DEVICE_SPAN, [0, 1, 2, 3, 4, 5, 6, 7]),  # multi_sc_data_generate_script.py: eight
        ("0,3", SWEEP_DEVICE_SPAN, [0, 3]),  # a list: exactly those
        ("5,", SC_DEVICE_SPAN, [5]),
    ],
)
def test_device_flag(flag, span, expected):
    assert expand_device_flag(flag, span) == expected


@pytest.mark.parametrize(("flag", "message"), [("x", "got 'x'"), ("1,1", "twice"), ("-1", "got '-1'")])
def test_bad_device_flag(flag, message):
    with pytest.raises(RecipeError, match=message) as error:
        expand_device_flag(flag, SWEEP_DEVICE_SPAN)
    assert error.value.field == "--device"


@pytest.mark.parametrize(
    ("devices", "gpus", "replicas"),
    [
        (7, EIGHT, [(g,) for g in EIGHT]),  # the original's 8-GPU layout
        (3, ["4", "5", "6", "7"], [("4",), ("5",), ("6",), ("7",)]),  # CUDA_VISIBLE_DEVICES=4,5,6,7
        ([7], EIGHT, [("7",)]),
    ],
)
def test_recipe_devices_pick_replicas(make_recipe, devices, gpus, replicas):
    assert [p.gpus for p in place_replicas(make_recipe(devices=devices), gpus, [0])] == replicas


def test_original_eight_gpu_recipe_on_four_gpus_names_the_fix(make_recipe):
    with pytest.raises(RecipeError, match=r"GPU 4 of \[0, 1, 2, 3, 4, 5, 6, 7\] is not visible.*as a list"):
        place_replicas(make_recipe(devices=7), ["0", "1", "2", "3"], [0])


@pytest.mark.parametrize(
    ("script", "flag", "shown"),
    [
        ("inference_script", "2", "GPUs [2, 3, 4, 5]"),
        ("inference_script", "1,6", "GPUs [1, 6]"),
        ("multi_sc_data_generate_script", "0", "GPUs [0, 1, 2, 3, 4, 5, 6, 7]"),
        ("multi_sc_data_generate_script", None, "GPUs all visible"),
    ],
)
def test_eval_scripts_read_device_as_the_original(script, flag, shown, tmp_path, capsys):
    (tmp_path / "iteration_0").mkdir()
    (tmp_path / "config.json").write_text("{}")
    model = ["--model_path", str(tmp_path)] if script.startswith("multi") else ["--model_root_path", str(tmp_path)]
    argv = [*model, "--dataset_type", "arc", "--vllm_env", sys.executable, "--dry-run"]
    assert load_script(script).main(argv + (["--device", flag] if flag else [])) == 0
    assert f"serving: {shown}," in capsys.readouterr().out


def test_eval_script_rejects_a_bad_device(tmp_path, capsys):
    argv = ["--model_root_path", str(tmp_path), "--vllm_env", sys.executable, "--device", "two", "--dry-run"]
    assert load_script("inference_script").main(argv) == 2


@pytest.mark.parametrize("script", ["inference_script", "multi_sc_data_generate_script"])
def test_help_explains_device(script, capsys):
    with pytest.raises(SystemExit):
        load_script(script).main(["--help"])
    span = SC_DEVICE_SPAN if script.startswith("multi") else SWEEP_DEVICE_SPAN
    assert f"GPUs d..d+{span - 1}" in " ".join(capsys.readouterr().out.split())
