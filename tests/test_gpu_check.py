"""``make gpu-check`` (``python3 -m dev.gpu_check``): its dry run, that the loop scripts accept what it passes,
and how stage outcomes become the check's verdict.

The check itself needs an NVIDIA GPU; here only its plan is tested: the stages, their order and settings, nothing
written, each loop command validated by the script's own ``--dry-run`` (recipe overrides, trainer YAMLs), and the
PASS/FAIL/SKIP bookkeeping on fabricated stages. The GPU checks themselves: ``tests/test_gpu_stages.py``.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest

from dev import gpu_check
from tests.conftest import REPO

NAMES = [
    "setup", "trainer-yamls", "plan", "loss-beside-policy", "isft", "wake-reload", "idpo", "reload", "zero3-2proc"
]  # fmt: skip


def test_dry_run_prints_the_stages_and_starts_nothing(tmp_path, capsys):
    out = tmp_path / "gpu_check"
    assert gpu_check.main(["--dry-run", "--output-dir", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines[1:]] == NAMES
    assert "'bf16': True" in lines[0] and "'attn_implementation': 'flash_attention_2'" in lines[0]
    stage = {line.split(":")[0]: line.split(": ", 1)[1] for line in lines[1:]}
    settings = "--set iteration_times=1 --set accelerate_config=deepspeed_zero3 --set num_processes=1"
    for name in ("plan", "isft", "idpo"):
        assert settings + " --set loss_placement=after" in stage[name]
    assert stage["plan"].endswith("--dry-run") and stage["isft"] == stage["plan"].removesuffix(" --dry-run")
    assert f"initial_model_path={out}/isft/checkpoints/iteration_0" in stage["idpo"]
    assert stage["reload"].endswith(f"--reload {out}/isft/checkpoints/iteration_0 {out}/idpo/checkpoints/iteration_0")
    for name in ("loss-beside-policy", "wake-reload", "zero3-2proc"):  # the checks of dev.gpu_stages
        assert stage[name].endswith(f"-m dev.gpu_stages {name} {out}")
    assert not out.exists()


@pytest.mark.parametrize("hardware", ["1x80GB", "2x80GB", "1x2GB"])
def test_dry_run_on_given_hardware_prints_the_planners_plan(hardware, tmp_path, capsys):
    """The plan step is the planner's: one GPU is enough (loss model served after generation, not kept beside);
    whether a 2 GB card holds it is vLLM's and the preflight's to say when the check runs."""
    argv = ["--dry-run", "--hardware", hardware, "--output-dir", str(tmp_path / "o")]
    assert gpu_check.main(argv) == 0
    out = capsys.readouterr().out
    assert f"--dry-run --hardware {hardware}" in out
    assert "plan: feasible" in out and "training: zero3, 1 process(es)" in out and "left to the engines" in out


def test_skip_setup_drops_the_setup_stage(tmp_path):
    stages = gpu_check.build_stages(tmp_path, skip_setup=True)
    assert [name for name, _ in stages] == NAMES[1:]


@pytest.mark.parametrize("stage", ["isft", "idpo"])
def test_the_loop_scripts_accept_the_gpu_settings(stage, tmp_path, capsys, monkeypatch):
    assert gpu_check.main(["--write-trainer-yamls", str(tmp_path)]) == 0  # the stage before
    command = dict(gpu_check.build_stages(tmp_path, skip_setup=True))[stage]
    monkeypatch.chdir(REPO)
    monkeypatch.syspath_prepend(str(REPO))
    script = importlib.util.spec_from_file_location(stage, REPO / command[1])
    module = importlib.util.module_from_spec(script)
    script.loader.exec_module(module)
    assert module.main([*command[2:], "--dry-run"]) == 0
    plan = capsys.readouterr().out
    assert "accelerate_configs/deepspeed_zero3.yaml --num_processes 1" in plan
    assert f"trainer_{stage[1:]}_gpu.yaml" in plan


def test_the_check_starts_before_set_up_with_the_standard_library_only(tmp_path):
    """make gpu-check runs `python3 -m dev.gpu_check` before any environment exists (`-S`: no site-packages)."""
    argv = [sys.executable, "-S", "-m", "dev.gpu_check", "--dry-run", "--output-dir", str(tmp_path / "o")]
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert "trainer-yamls: " in result.stdout and "-m dev.gpu_check --write-trainer-yamls" in result.stdout


def test_stages_run_in_order_each_logged_and_a_failure_skips_what_comes_after(tmp_path, capsys):
    """Stages outside ``STAGE_NEEDS`` need every stage before them: the first failure skips the rest."""
    stages = [
        ("one", [sys.executable, "-c", "print('first')"]),
        ("two", [sys.executable, "-c", "raise SystemExit(3)"]),
        ("three", [sys.executable, "-c", "open('three-ran', 'w')"]),
    ]
    outcomes = gpu_check.run_stages(stages, tmp_path)
    assert [(o.name, o.status) for o in outcomes] == [("one", "PASS"), ("two", "FAIL"), ("three", "SKIP")]
    assert outcomes[1].reason == f"exit 3, see {tmp_path / 'two.log'}"
    assert outcomes[2].reason == "needs two, which did not pass"
    assert (tmp_path / "one.log").read_text() == "first\n" and not (REPO / "three-ran").exists()
    out = capsys.readouterr().out
    assert re.search(r"gpu-check \| two \| FAIL \(exit 3, see .*two.log\) \| \d+ s", out)
    assert "gpu-check | three | SKIP (needs two, which did not pass) | 0 s" in out


def script(text: str) -> list[str]:
    return [sys.executable, "-c", text]


def test_a_failed_isft_skips_what_needs_its_checkpoint_and_runs_the_independent_checks(tmp_path):
    stages = [
        ("plan", script("pass")),
        ("loss-beside-policy", script("print('FAIL: the loss server answered 500'); raise SystemExit(1)")),
        ("isft", script("raise SystemExit(2)")),
        ("wake-reload", script("open('wake-ran', 'w')")),
        ("idpo", script("pass")),
        ("reload", script("pass")),
        ("zero3-2proc", script(f"print('SKIP: GPU 0 has 2.0 GiB free'); raise SystemExit({gpu_check.SKIP_EXIT})")),
    ]
    outcomes = {o.name: o for o in gpu_check.run_stages(stages, tmp_path)}
    assert {name: o.status for name, o in outcomes.items()} == {
        "plan": "PASS", "loss-beside-policy": "FAIL", "isft": "FAIL", "wake-reload": "SKIP", "idpo": "SKIP",
        "reload": "SKIP", "zero3-2proc": "SKIP",
    }  # fmt: skip
    assert outcomes["loss-beside-policy"].reason.startswith("the loss server answered 500; exit 1, see ")
    assert outcomes["zero3-2proc"].reason == "GPU 0 has 2.0 GiB free"
    assert outcomes["reload"].reason == "needs isft, which did not pass" and not (REPO / "wake-ran").exists()
    assert gpu_check.summarize(list(outcomes.values())) == (
        "GPU CHECK: FAIL (failed: loss-beside-policy, isft; 1 passed, 4 skipped)",
        1,
    )


@pytest.mark.parametrize(
    ("statuses", "line", "code"),
    [
        (["PASS", "PASS", "SKIP"], "GPU CHECK: PASS (2 passed, 1 skipped, 6 s)", 0),
        (["PASS", "PASS", "PASS"], "GPU CHECK: PASS (3 passed, 0 skipped, 6 s)", 0),
        (["PASS", "FAIL", "SKIP"], "GPU CHECK: FAIL (failed: s1; 1 passed, 1 skipped)", 1),
        (["FAIL", "FAIL", "PASS"], "GPU CHECK: FAIL (failed: s0, s1; 1 passed, 0 skipped)", 1),
    ],
)
def test_the_last_line_counts_the_outcomes_and_fails_on_any_failure(statuses, line, code):
    outcomes = [gpu_check.Outcome(f"s{i}", status, 2.0) for i, status in enumerate(statuses)]
    assert gpu_check.summarize(outcomes) == (line, code)


@pytest.mark.parametrize(
    ("code", "log", "status", "reason"),
    [
        (0, "FAIL: ignored\n", "PASS", ""),
        (77, "loading\nSKIP: too small\n", "SKIP", "too small"),
        (77, "loading\n", "SKIP", "no reason given, see {log}"),
        (1, "FAIL: no probe\nTraceback...\n", "FAIL", "no probe; exit 1, see {log}"),
        (1, "x\nWeightsMismatch: server differs\n\n", "FAIL", "WeightsMismatch: server differs; exit 1, see {log}"),
        (137, "", "FAIL", "exit 137, see {log}"),
    ],
)
def test_a_stage_outcome_reads_its_exit_code_and_its_log(code, log, status, reason, tmp_path):
    path = tmp_path / "stage.log"
    path.write_text(log)
    outcome = gpu_check.stage_outcome("stage", code, 1.0, path)
    assert (outcome.status, outcome.reason) == (status, reason.format(log=path))


def test_it_deletes_only_a_folder_it_wrote(tmp_path, monkeypatch, capsys):
    """``--output-dir runs`` must not delete the runs in it: only a folder holding gpu-check's marker is replaced."""
    import optima.hardware.machine

    monkeypatch.setattr(optima.hardware.machine, "has_gpu", lambda: True)
    monkeypatch.setattr(gpu_check, "run_stages", lambda stages, out: [])
    monkeypatch.setattr(gpu_check, "summarize", lambda outcomes: ("GPU CHECK: PASS (stubbed)", 0))
    runs = tmp_path / "runs"
    (runs / "demo_arc_sft").mkdir(parents=True)
    (runs / "demo_arc_sft" / "report.md").write_text("a run")
    assert gpu_check.main(["--skip-setup", "--output-dir", str(runs)]) == 2
    assert "holds files gpu-check did not write (it deletes only its own)" in capsys.readouterr().out
    assert (runs / "demo_arc_sft" / "report.md").read_text() == "a run"
    own = tmp_path / "check"
    assert gpu_check.main(["--skip-setup", "--output-dir", str(own)]) == 0  # new: created with its marker
    (own / "old_stage.log").write_text("from the last check")
    assert gpu_check.main(["--skip-setup", "--output-dir", str(own)]) == 0  # its own: replaced
    assert sorted(p.name for p in own.iterdir()) == [gpu_check.MARKER]
