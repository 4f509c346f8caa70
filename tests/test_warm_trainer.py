"""The warm trainer (``optima.training.warm`` and ``warm_server``): one process per run, one forked child per stage.

Fast tests drive the server with plain scripts standing in for the handbook scripts (nothing preloaded, no
accelerate flags): each stage is a fresh fork with its own environment, arguments and log; a failed stage is a
``TrainingError`` naming the stage and the log, and the server goes on; a server killed mid-stage takes its child
along; a driver stopped by SIGTERM or Ctrl-C, or killed by ``kill -9``, leaves no process (``tests/warm_driver.py``).
Slow tests train the tiny model for real: the warm trainer's checkpoint equals ``accelerate launch``'s, tensor for
tensor, and a child killed by ``kill -9`` mid-training leaves a stage that resumes from its trainer checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from optima.environments import resolve_env
from optima.hardware.accelerate import ACCELERATE_CONFIGS
from optima.hardware.placement import NodeRanks, TrainingPlacement
from optima.serving.processes import group_members
from optima.training.errors import TrainingError
from optima.training.launch import run_training
from optima.training.launch_config import CPU_ALLOCATOR_ENV, TrainLaunch
from optima.training.warm import WarmTrainer, warm_trainer_for
from tests.helpers import child_groups, read_stat, wait_for, with_default_signals
from tests.warm_driver import ScriptLaunch

REPO = Path(__file__).resolve().parent.parent
DRIVER = Path(__file__).with_name("warm_driver.py")
ENV = resolve_env(sys.executable, "train")

# A stage: reports what it sees (pid, parent, argv, whether an earlier stage's change to a preloaded module is
# visible), prints to both streams, exits with $STAGE_EXIT.
STAGE = """
import json, os, sys
seen = hasattr(json, "_touched_by_a_stage")
json._touched_by_a_stage = True
print("stage says hello", flush=True)
print("stage warns", file=sys.stderr)
with open(os.environ["STAGE_OUT"], "w") as f:
    json.dump({"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv, "seen": seen, "cwd": os.getcwd()}, f)
sys.exit(int(os.environ.get("STAGE_EXIT", "0")))
"""
# A stage that says it runs (its pid in $STAGE_PID) and then trains forever.
SLEEPER = """
import os, threading
with open(os.environ["STAGE_PID"] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(os.environ["STAGE_PID"] + ".tmp", os.environ["STAGE_PID"])
threading.Event().wait()
"""


def write_script(folder: Path, name: str, source: str) -> Path:
    path = folder / name
    path.write_text(source)
    return path


def gone(pid: int) -> bool:
    stat = read_stat(pid)
    return stat is None or stat[0] == "Z"


def test_each_stage_is_a_fresh_fork_with_its_env_argv_and_log(tmp_path):
    script = write_script(tmp_path, "stage.py", STAGE)
    with WarmTrainer(ENV, tmp_path / "warm.log", preload=("json",)) as warm:
        for i in range(2):
            out = {"STAGE_OUT": str(tmp_path / f"out{i}.json")}
            run_training(ScriptLaunch(script, ENV), tmp_path / f"train{i}.log", out, desc=f"stage {i}", warm=warm)
        server = warm.proc.pid
    first, second = (json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(2))
    assert first["ppid"] == second["ppid"] == server and first["pid"] != second["pid"]
    assert not first["seen"] and not second["seen"]  # the second fork does not see what the first one changed
    assert first["argv"] == [str(script), "--config", "unused.yaml"] and first["cwd"] == str(REPO)
    log = (tmp_path / "train0.log").read_text()
    assert "stage says hello" in log and "stage warns" in log
    assert warm.import_s is not None and "stage stage 1" in (tmp_path / "warm.log").read_text()
    assert warm.proc.returncode is not None and group_members(server) == []  # closed with the run


def test_the_warm_trainer_starts_with_the_cpu_allocator_settings(tmp_path, monkeypatch):
    """glibc reads them when the process starts: the server's own environment must have them, not only the child's."""
    for name in CPU_ALLOCATOR_ENV:
        monkeypatch.delenv(name, raising=False)
    with WarmTrainer(ENV, tmp_path / "warm.log", preload=()) as warm:
        environ = Path(f"/proc/{warm.proc.pid}/environ").read_bytes().split(b"\0")
    assert {f"{k}={v}".encode() for k, v in CPU_ALLOCATOR_ENV.items()} <= set(environ)


@pytest.mark.parametrize(
    ("body", "code", "shown"),
    [
        ("raise ZeroDivisionError('lost a step')", 1, "ZeroDivisionError: lost a step"),
        ("import sys; print('bad config'); sys.exit(3)", 3, "bad config"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -9, ""),
    ],
    ids=["exception", "exit_3", "kill_9"],
)
def test_a_failed_stage_names_the_stage_and_its_log_and_the_next_stage_runs(tmp_path, body, code, shown):
    bad, good = write_script(tmp_path, "bad.py", body), write_script(tmp_path, "good.py", STAGE)
    log = tmp_path / "logs" / "train.log"
    with WarmTrainer(ENV, tmp_path / "warm.log", preload=()) as warm:
        with pytest.raises(TrainingError) as info:
            run_training(ScriptLaunch(bad, ENV), log, desc="train iteration 2 sft", warm=warm)
        message = str(info.value)
        assert message.startswith(f"train iteration 2 sft: sft training exited with {code}; log: {log}")
        assert shown in message
        run_training(
            ScriptLaunch(good, ENV), tmp_path / "next.log", {"STAGE_OUT": str(tmp_path / "o.json")}, warm=warm
        )
    assert json.loads((tmp_path / "o.json").read_text())["argv"][0] == str(good)


def test_a_server_killed_mid_stage_takes_its_child_along(tmp_path, monkeypatch):
    script, pid_file = write_script(tmp_path, "sleeper.py", SLEEPER), tmp_path / "stage.pid"
    monkeypatch.setenv("STAGE_PID", str(pid_file))
    with WarmTrainer(ENV, tmp_path / "warm.log", preload=()) as warm:

        def kill_server():
            wait_for(pid_file.exists, 60, "the stage to start")
            os.kill(warm.proc.pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_server)
        killer.start()
        with pytest.raises(TrainingError) as info:
            run_training(ScriptLaunch(script, ENV), tmp_path / "train.log", desc="train iteration 1", warm=warm)
        killer.join()
    message = str(info.value)
    assert f"train iteration 1: training failed; log: {tmp_path / 'train.log'}" in message
    assert f"the warm trainer exited with -9; log: {tmp_path / 'warm.log'}" in message
    child = int(pid_file.read_text())
    wait_for(lambda: gone(child), 30, "the orphaned stage to die with its server")


@pytest.mark.parametrize(
    ("sig", "when"),
    [(signal.SIGTERM, "stage"), (signal.SIGINT, "stage"), (signal.SIGKILL, "stage"), (signal.SIGKILL, "idle")],
    ids=["term", "int", "kill_9", "kill_9_idle"],
)
def test_stopping_the_driver_stops_the_warm_trainer_and_its_stage(tmp_path, sig, when):
    pid_file = tmp_path / "stage.pid"
    script = write_script(tmp_path, "stage.py", SLEEPER if when == "stage" else STAGE)
    argv = [sys.executable, str(DRIVER), str(tmp_path), str(script)] + (["--then-wait"] if when == "idle" else [])
    env = os.environ | {"STAGE_PID": str(pid_file), "STAGE_OUT": str(tmp_path / "out.json")}
    driver = subprocess.Popen(with_default_signals(argv), env=env, cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        if when == "stage":
            stage = wait_for(lambda: pid_file.exists() and int(pid_file.read_text()), 60, "the stage to start")
            server = os.getpgid(stage)
        else:
            assert driver.stdout.readline().strip() == "IDLE"
            stage = json.loads((tmp_path / "out.json").read_text())["pid"]
            server = child_groups(driver.pid)[0]
        assert server in child_groups(driver.pid) and server != os.getpgid(driver.pid)  # its own process group
        driver.send_signal(sig)
        returncode = driver.wait(timeout=60)
    finally:
        driver.kill()
        driver.stdout.close()
    assert returncode != 0
    if sig == signal.SIGTERM:
        assert returncode == 143
    if sig == signal.SIGKILL:  # nobody is left to clean up: the server sees its driver die and stops its stage
        wait_for(lambda: group_members(server) == [], 30, "the orphaned warm trainer to stop")
    else:  # the driver stopped the server and its stage before it exited
        assert group_members(server) == []
    assert gone(stage)


# ---------------------------------------------------------------- when the warm trainer is used


def placement(nodes: int, processes: int, gpus: tuple[str, ...] = ()) -> TrainingPlacement:
    return TrainingPlacement(tuple(NodeRanks(f"h{i}", i, gpus) for i in range(nodes)), processes)


@pytest.mark.parametrize(
    ("config", "processes", "where", "single"),
    [
        ("cpu", None, None, True),
        ("cpu", 1, placement(1, 1), True),
        ("cpu", 2, None, False),
        ("cpu", None, placement(1, 2), False),
        ("cpu", None, placement(2, 1), False),
        ("cpu", None, placement(1, 1, ("0",)), False),
        ("single_gpu", None, None, False),
        ("multi_gpu", 1, None, False),
        ("fsdp", 1, None, False),
        ("deepspeed_zero3", 1, None, False),
    ],
)
def test_only_a_single_cpu_process_runs_warm(config, processes, where, single):
    path = ACCELERATE_CONFIGS / f"{config}.yaml"
    if not path.is_file():
        pytest.skip(f"no {config}.yaml shipped")
    launch = TrainLaunch("sft", ENV, path, Path("t.yaml"), processes, (), where)
    assert launch.single_cpu_process() is single
    assert WarmTrainer(ENV, Path("unused.log")).serves(launch) is single
    assert WarmTrainer(ENV, Path("unused.log"), enabled=False).serves(launch) is False


@pytest.mark.parametrize(("flag", "gpu", "enabled"), [(True, False, True), (False, False, False), (True, True, False)])
def test_the_recipe_flag_and_a_gpu_decide(tmp_path, flag, gpu, enabled):
    recipe = SimpleNamespace(warm_trainer=flag, accelerate_config="cpu", num_processes=None, accelerate_extra_args=[])
    warm = warm_trainer_for(recipe, ENV, gpu, None, tmp_path)
    assert warm.enabled is enabled and warm.log_path == tmp_path / "warm_trainer.log"
    if not enabled:
        with warm:
            assert warm.proc is None  # nothing is started for accelerate-launch runs


def test_the_child_gets_what_accelerate_launch_sets(monkeypatch):
    pytest.importorskip("accelerate")
    from optima.training.warm_server import SimpleLaunchOnly, accelerate_env

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    script = ["run_sft.py", "--config", "t.yaml"]
    env = accelerate_env(["--config_file", str(ACCELERATE_CONFIGS / "cpu.yaml"), "--num_processes", "1"], script)
    assert (env["ACCELERATE_USE_CPU"], env["ACCELERATE_MIXED_PRECISION"]) == ("True", "no")
    assert int(env["OMP_NUM_THREADS"]) >= 1 and env["ACCELERATE_DYNAMO_BACKEND"] == "NO"
    with pytest.raises(SimpleLaunchOnly, match="several processes"):
        accelerate_env(["--config_file", str(ACCELERATE_CONFIGS / "cpu.yaml"), "--num_processes", "2"], script)


# ---------------------------------------------------------------- real training on the tiny model (slow)


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory) -> Path:
    from optima.selection.io import save_splits
    from tests.test_eval_split import SFT_ROWS

    path = tmp_path_factory.mktemp("warm_sft") / "data"
    save_splits({"train": SFT_ROWS, "test": []}, path)
    return path


def cpu_launch(trainer_yaml: Path) -> TrainLaunch:
    """A stage as the CPU demo launches it (the plan's one process: ``--num_processes 1``)."""
    return TrainLaunch("sft", ENV, ACCELERATE_CONFIGS / "cpu.yaml", trainer_yaml, None, (), placement(1, 1))


@pytest.mark.slow
def test_the_warm_trainer_saves_what_accelerate_launch_saves(tiny_model, sft_data, tmp_path):
    from safetensors.torch import load_file

    from optima.training.common import read_completion
    from optima.weights_probe import read_probe
    from tests.helpers import tiny_trainer_yaml

    with WarmTrainer(ENV, tmp_path / "server.log") as warm:
        for side in ("warm", "accelerate"):
            config = tiny_trainer_yaml(tmp_path / f"{side}.yaml", tiny_model, sft_data, tmp_path / side, packing=False)
            run_training(
                cpu_launch(config), tmp_path / f"{side}.log", desc=side, warm=warm if side == "warm" else None
            )
    warm_weights, launched = (
        load_file(tmp_path / "warm" / "model.safetensors"),
        load_file(tmp_path / "accelerate" / "model.safetensors"),
    )
    start = load_file(tiny_model / "model.safetensors")
    assert set(warm_weights) == set(launched) and warm_weights
    for name, tensor in launched.items():
        assert torch_equal(warm_weights[name], tensor), name  # bit for bit
    assert any(not torch_equal(warm_weights[name], start[name]) for name in start)  # it did train
    metrics = [read_completion(tmp_path / side) for side in ("warm", "accelerate")]
    assert metrics[0]["train_loss"] == metrics[1]["train_loss"] and metrics[0]["tensors"] == metrics[1]["tensors"]
    assert read_probe(tmp_path / "warm") == read_probe(tmp_path / "accelerate")
    assert "sft | 4 train rows" in (tmp_path / "warm.log").read_text()  # the stage's output is in its log
    assert "warm trainer | stage warm | child" in (tmp_path / "server.log").read_text()


def torch_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.slow
def test_a_stage_killed_mid_training_resumes_from_its_trainer_checkpoint(tiny_model, sft_data, tmp_path):
    from optima.training.checkpoint import clear_partial_output, trainer_checkpoints
    from optima.training.common import is_complete
    from tests.helpers import tiny_trainer_yaml

    out, log = tmp_path / "out", tmp_path / "logs" / "train.log"
    resumable = {"save_strategy": "steps", "save_steps": 1, "resume_from_checkpoint": True, "save_total_limit": 2}
    config = tiny_trainer_yaml(
        tmp_path / "t.yaml", tiny_model, sft_data, out, packing=False, max_steps=40, **resumable
    )
    with WarmTrainer(ENV, tmp_path / "warm.log") as warm:

        def kill_the_child():
            saved = lambda: [c for c in trainer_checkpoints(out) if (c / "trainer_state.json").is_file()]  # noqa: E731
            wait_for(saved, 300, "a trainer checkpoint")
            (child,) = [pid for pid in group_members(warm.proc.pid) if pid != warm.proc.pid]
            os.kill(child, signal.SIGKILL)

        killer = threading.Thread(target=kill_the_child)
        killer.start()
        with pytest.raises(TrainingError, match=f"train iteration 1: sft training exited with -9; log: {log}"):
            run_training(cpu_launch(config), log, desc="train iteration 1", warm=warm)
        killer.join()
        assert not is_complete(out) and warm.proc.poll() is None  # the server outlives its killed stage
        kept = clear_partial_output(out)  # what the train stage does before it runs again
        assert kept
        run_training(cpu_launch(config), log, desc="train iteration 1", warm=warm)
    assert is_complete(out) and f"resuming from {kept[-1]}" in log.read_text()
    assert trainer_checkpoints(out) == []  # removed once the final checkpoint is complete
