"""The GPU checks of ``make gpu-check`` (``dev.gpu_stages``) on a machine without a GPU.

What can be shown here: each check refuses clearly when torch sees no CUDA device (this machine's torch is the CPU
build), the recipes and plans they run with (a kept policy replica; the loss server beside it on one GPU), the
memory estimate and skip reason of the 2-rank ZeRO-3 save, the reading of a gloo refusal, and the sleep's memory
test. The servers, the wake and the ZeRO-3 ranks themselves run only on a GPU (never run here).
"""

from __future__ import annotations

import re

import pytest

from dev import gpu_stages
from optima.hardware.allocation import allocate_hardware
from optima.hardware.machine import parse_hardware

GIB = 2**30


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    """The recipes name their files relative to the repository, as the check runs them (cwd: the repository)."""
    monkeypatch.chdir(gpu_stages.REPO)


@pytest.mark.parametrize("check", sorted(gpu_stages.CHECKS))
def test_every_check_refuses_clearly_when_torch_sees_no_cuda_device(check, tmp_path, capsys):
    import torch

    assert torch.cuda.device_count() == 0  # this machine: the CPU build of torch
    assert gpu_stages.CHECKS[check](tmp_path) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAIL: torch in the training environment sees no CUDA device"), out
    assert not any(tmp_path.iterdir())  # refused before anything started or was written


def test_cuda_refusal_only_without_devices():
    assert gpu_stages.cuda_refusal(1) is None and "CUDA_VISIBLE_DEVICES" in gpu_stages.cuda_refusal(0)


def test_the_wake_check_serves_a_kept_replica_that_the_plan_accepts_on_one_gpu(tmp_path):
    recipe = gpu_stages.check_recipe(tmp_path, "wake_reload")
    allocation = gpu_stages.server_allocation(recipe, parse_hardware("1x80GB"))
    assert allocation.problems == [] and allocation.layout.policy[0].gpus == ("0",)
    assert (
        allocation.layout.policy[0].carry_over and allocation.layout.loss is None
    )  # sleep mode on; iSFT: no loss server
    assert any("sleeps during training" in line for line in allocation.lines)
    assert allocate_hardware(recipe, parse_hardware("1x80GB"), [0]).problems == []  # the whole run's allocation agrees
    assert recipe.vllm_extra_args == ["--dtype", "bfloat16"] and recipe.output_dir == str(tmp_path / "wake_reload")


@pytest.mark.parametrize("hardware", ["1x80GB", "1x141GB", "1x24GB"])
def test_the_loss_check_plans_a_resident_loss_server_beside_the_policy_on_gpu_0(hardware, tmp_path):
    recipe = gpu_stages.check_recipe(tmp_path, "loss_beside", loss_placement="beside")
    allocation = gpu_stages.server_allocation(recipe, parse_hardware(hardware))
    assert allocation.problems == []
    policy, loss = allocation.layout.policy[0], allocation.layout.loss
    assert loss is not None and allocation.layout.loss_resident and loss.gpus == policy.gpus == ("0",)
    # The loss server's share comes out of the policy's: together they take gpu_memory_utilization.
    assert loss.gpu_memory_utilization > 0
    assert policy.gpu_memory_utilization + loss.gpu_memory_utilization == pytest.approx(recipe.gpu_memory_utilization)
    assert any(
        line.startswith("loss server: GPUs 0") and "stays up through training" in line for line in allocation.lines
    )


def test_the_loss_check_reports_an_unknown_gpu_memory_as_a_problem(tmp_path):
    from optima.hardware.machine import Hardware

    recipe = gpu_stages.check_recipe(tmp_path, "loss_beside", loss_placement="beside")
    allocation = gpu_stages.server_allocation(recipe, Hardware(1, 1, 0.0, gpu_ids=("0",), source="test"))
    assert allocation.layout is None and "memory is unknown" in allocation.problems[0]


def test_two_zero3_ranks_need_more_than_one_and_a_small_gpu_is_skipped_with_the_numbers():
    need = gpu_stages.zero3_need_bytes()
    assert need > gpu_stages.zero3_need_bytes(ranks=1) and 2 * GIB < need < 16 * GIB
    reason = gpu_stages.zero3_skip_reason(2048, need)
    assert reason.startswith("GPU 0 has 2.0 GiB free, two ZeRO-3 ranks of SmolLM2 need ~") and "GiB" in reason
    assert gpu_stages.zero3_skip_reason(80 * 1024, need) is None
    assert gpu_stages.zero3_skip_reason(None, need) is None  # unknown: tried (the ranks' error would say)
    assert gpu_stages.zero3_skip_reason(2048, None) is None


@pytest.mark.parametrize(
    ("line", "found"),
    [
        ("RuntimeError: ProcessGroupGloo does not support reduce_scatter", True),
        ("RuntimeError: gloo: allgather_into_tensor_coalesced: unsupported device type cuda", True),
        ("RuntimeError: No backend type associated with device type cuda", True),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", False),
        ("UserWarning: flash attention is not supported on this GPU", False),
    ],
)
def test_a_gloo_refusal_in_a_ranks_log_is_found_and_other_errors_are_not(line, found, tmp_path):
    logs = [tmp_path / "rank0.log", tmp_path / "rank1.log"]
    logs[0].write_text("loading\n")
    logs[1].write_text(f"Traceback (most recent call last):\n{line}\n")
    assert (gpu_stages.unsupported_collective(logs) == line) is found


@pytest.mark.parametrize(
    ("idle", "awake", "asleep", "problem"),
    [
        (500, 120_000, 1_500, None),  # weights and KV cache given back
        (500, 120_000, 100_000, "the sleeping server still holds 99500 MiB of the 119500 MiB it held awake"),
        (None, 120_000, 1_500, None),  # nvidia-smi could not tell: not judged
    ],
)
def test_a_sleep_must_give_back_most_of_the_servers_memory(idle, awake, asleep, problem):
    assert gpu_stages.sleep_freed_problem(idle, awake, asleep) == problem


def fake_nvidia_smi(folder, pid: int):
    """An ``nvidia-smi`` that knows two GPUs' used memory and three processes (``pid`` twice, PID 1 once)."""
    smi = folder / "nvidia-smi"
    smi.write_text(
        '#!/bin/sh\ncase "$1" in\n'
        "  --query-gpu=memory.used) printf '1200\\n80000\\n' ;;\n"
        f"  --query-compute-apps=pid,used_memory) printf '{pid}, 700\\n1, 300\\n{pid}, 50\\n' ;;\n"
        "  *) exit 1 ;;\nesac\n"
    )
    smi.chmod(0o755)
    return smi


def test_the_memory_a_server_holds_is_read_from_nvidia_smi_by_process_group(tmp_path, monkeypatch):
    import os

    smi = fake_nvidia_smi(tmp_path, os.getpid())
    used = gpu_stages.gpu_memory_used_mib
    assert used("1", str(smi)) == 80000 and used("0", str(smi)) == 1200
    assert used("GPU-3f2a", str(smi)) is None  # a UUID: which row is unknown
    assert gpu_stages.process_memory_mib(str(smi)) == {os.getpid(): 750, 1: 300}
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert gpu_stages.group_memory_mib(os.getpgid(0)) == (750, 300)  # this test's group, and PID 1 apart
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert gpu_stages.group_memory_mib(os.getpgid(0)) == (None, None)  # no nvidia-smi: not visible


def test_the_checks_call_what_the_run_s_server_holder_has():
    """The checks drive the run's own ``ServerHolder`` and never run here: a renamed verb must fail on CPU."""
    import ast
    import inspect

    from optima.serving import holder

    used = {
        node.attr
        for node in ast.walk(ast.parse(inspect.getsource(gpu_stages)))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "holder"
    }
    assigned = set(re.findall(r"self\.(\w+)(?:: [^=]+)? = ", inspect.getsource(holder.ServerHolder)))
    assert {"serve", "release_for_training", "load_in_place", "loss_urls", "asleep", "loss"} <= used
    assert not [name for name in used if not hasattr(holder.ServerHolder, name) and name not in assigned]
