"""Hardening (issue 8): kills and SIGTERM mid-stage, bad input, broken model output (security: test_security.py).

Runs of ``sft_script.py`` here talk to a scripted OpenAI server through the recipe's ``endpoints`` (no vLLM
starts), score with the HF backend on the tiny model and, in the slow tests, train for real (accelerate + TRL,
``max_steps: 1``). What the fast tests prove without TRL, with a fake ``accelerate`` that starts a worker process:
the trainer's whole process group stops when the driver is killed (``kill -9`` included) or interrupted.
What the slow tests prove: a driver killed inside the score or train stage and rerun with the same command ends
with exactly what an uninterrupted run produces (nothing lost, nothing duplicated), and a SIGTERM mid-stage exits
with 143 and leaves no process behind.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import venv
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import requests
import yaml

from optima.agents.conversation import GenerationSettings
from optima.agents.generation import generate_conversations
from optima.config import SFTRecipe, load_recipe
from optima.environments import PythonEnv
from optima.paths import RunPaths
from optima.serving.client import ReplicaPool, RequestFailed, Sampling
from optima.serving.processes import group_members
from optima.serving.vllm_server import find_free_port, serve
from optima.stages import reward_generations
from optima.store import load_records
from optima.tasks import get_task
from optima.tasks import select_questions as slice_questions
from optima.training.common import is_complete
from tests._task_fixtures import resolve_test_data_dir
from tests.conftest import requires_vllm
from tests.fake_openai import FakeOpenAIServer, FakeReply, agreeing_reply
from tests.helpers import arc_examples, child_groups, count_lines, finished_stages, wait_for, with_default_signals

REPO = Path(__file__).resolve().parent.parent
DATA = resolve_test_data_dir()
VLLM_ENV = REPO / ".venvs" / "vllm"
SFT_BASE = REPO / "alignment-handbook/recipes/smollm2-135m/arc_sft/base.yaml"
FAKE_ENV = PythonEnv("fake", "python", (sys.executable, str(Path(__file__).with_name("fake_vllm.py"))))
requires_data = pytest.mark.skipif(not (DATA / "arc_challenge").is_dir(), reason=f"no ARC data under {DATA}")


# ---------------------------------------------------------------- sft_script.py against a scripted server


def write_sft_recipe(folder: Path, model: Path, endpoint: str, **overrides) -> Path:
    """An iSFT recipe over ``endpoint`` writing to ``folder/run``; one iteration, one training step."""
    folder.mkdir(parents=True, exist_ok=True)
    trainer = yaml.safe_load(SFT_BASE.read_text())
    trainer |= {"max_steps": 1, "per_device_train_batch_size": 2, "max_length": 256, "learning_rate": 1e-3}
    (folder / "sft_base.yaml").write_text(yaml.safe_dump(trainer))
    recipe = {
        "dataset_type": "arc",
        "initial_model_path": str(model),
        "data_dir": str(DATA),
        "output_dir": str(folder / "run"),
        "origin_yaml_path": str(folder / "sft_base.yaml"),
        "accelerate_config": "cpu",
        "endpoints": [endpoint],
        "sample_count": 8,
        "explore_count": 1,
        "max_turns": 4,
        "max_tokens": 64,
        "thread_count": 4,
        "use_prompt_pool": False,
        "initial_epsilon": -10.0,
        "selection_range": [0.0, 1.0],
        "loss_backend": "hf",
        "request_timeout_s": 30.0,
        "max_retries": 1,
    }
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe | overrides))
    return path


def sft_command(recipe: Path) -> list[str]:
    envs = ["--vllm_env", str(VLLM_ENV), "--alignment_env", sys.executable]
    return [sys.executable, str(REPO / "sft_script.py"), "--train_config_path", str(recipe), *envs]


def run_sft(recipe: Path) -> subprocess.CompletedProcess:
    return subprocess.run(sft_command(recipe), capture_output=True, text=True, cwd=REPO, timeout=600)


def start_sft(recipe: Path) -> subprocess.Popen:
    with (recipe.parent / "driver.out").open("ab") as log:
        argv = with_default_signals(sft_command(recipe))  # the tests interrupt it
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


def stages_done(run: Path) -> list[str]:
    return finished_stages(run / "iteration_0" / "manifest.json")


# ---------------------------------------------------------------- broken model output and server errors


def broken(content: str = "", **fields) -> Callable[[dict], FakeReply]:
    """A responder that answers every turn with the same (broken) reply."""
    return lambda body: FakeReply(content, **fields)


# Per question (in slice order): what the server answers to every turn, and the status the record must get.
BROKEN_OUTPUTS = [
    ("tag", agreeing_reply, "ok"),
    ("no_tag", broken("I am not sure, let us think again."), "ok"),
    ("unbalanced", broken("\\boxed{ {{ <A>B} </A \\frac{1"), "ok"),
    ("empty", broken("", completion_tokens=0), "ok"),
    ("ramble_10k_tokens", broken("so " * 10_000), "too_long"),
    ("lone_surrogates", broken("answer \udc80\ud800 <A>B</A>"), "ok"),
    ("non_utf8_bytes", broken(raw=b'{"choices": [{"message": {"content": "\xff\xfe\xc3("}}]}'), "error"),
    ("not_json", broken(raw=b'{"choices": [{"mess'), "error"),
    ("http_400", broken(status=400), "error"),
    ("http_500", broken(status=500), "error"),
]


class ScriptedByQuestion:
    """Answers each question of ``questions`` with its own responder (the question is found in the task turn)."""

    def __init__(self, questions: list[str], responders: list):
        self.behaviour = dict(zip(questions, responders, strict=True))

    def __call__(self, body: dict) -> FakeReply:
        turn = body["messages"][1]["content"]
        question = max((q for q in self.behaviour if q in turn), key=len)
        return self.behaviour[question](body)


@requires_vllm
@requires_data
def test_broken_outputs_and_server_errors_are_recorded_and_counted(tiny_model, tmp_path):
    count = len(BROKEN_OUTPUTS)
    examples = slice_questions(get_task("arc").load_train(data_dir=str(DATA), seed=42), count, 42, 0, "sft")
    questions = [e.question for e in examples]
    with FakeOpenAIServer(ScriptedByQuestion(questions, [r for _, r, _ in BROKEN_OUTPUTS])) as server:
        # Nothing can pass epsilon 10: the iteration ends after selection (carry_forward) and writes metrics.json.
        overrides = {"sample_count": count, "cal_ppl": False, "initial_epsilon": 10.0}
        recipe = write_sft_recipe(
            tmp_path, tiny_model, server.base_url, on_empty_selection="carry_forward", **overrides
        )
        result = run_sft(recipe)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    records = {r["question"]: r for r in load_records(tmp_path / "run" / "iteration_0" / "generations.jsonl")[0]}
    assert len(records) == count
    by_name = {name: records[question] for question, (name, _, _) in zip(questions, BROKEN_OUTPUTS, strict=True)}
    for name, _, status in BROKEN_OUTPUTS:
        record = by_name[name]
        assert record["status"] == status, (name, record["status"], record["error"])
        assert (record["error"] is not None) == (status == "error"), name
    assert "400" in by_name["http_400"]["error"] and "500" in by_name["http_500"]["error"]
    assert "unreadable reply" in by_name["non_utf8_bytes"]["error"] and "unreadable" in by_name["not_json"]["error"]
    assert by_name["ramble_10k_tokens"]["utterances"] == []  # a too-long utterance is not stored
    assert by_name["lone_surrogates"]["utterances"][0]["text"] == "answer ?? <A>B</A>"  # stored as valid UTF-8
    assert by_name["no_tag"]["final_answer"] == by_name["unbalanced"]["final_answer"] == ""
    metrics = json.loads((tmp_path / "run" / "iteration_0" / "metrics.json").read_text())
    assert metrics["stages"]["generate"]["statuses"] == dict(Counter(status for _, _, status in BROKEN_OUTPUTS))
    assert metrics["stages"]["score"]["conversations"] == count
    assert metrics["stages"]["select"]["kept_conversations"] == 0 and "train" not in metrics["stages"]


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b'{"choices": [{"message": {"content": "\xff"}}]}', "unreadable reply"),
        (b"<html>502 Bad Gateway</html>", "unreadable reply"),
        (
            json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": []}).encode(),
            "not a chat completion",
        ),
    ],
    ids=["non_utf8", "html", "no_choice"],
)
def test_an_unreadable_reply_fails_its_request_only(make_recipe, raw, fragment):
    with FakeOpenAIServer(broken(raw=raw)) as server:
        pool = ReplicaPool([server.base_url], make_recipe(max_retries=0))
        with pytest.raises(RequestFailed, match=fragment):
            pool.chat(0, [{"role": "user", "content": "hi"}], Sampling(0.5, 8))
        assert pool.dead == set()  # the replica answered: it is not failed over


def test_a_torn_score_stage_resumes_without_loss_or_duplicates(fake_server, tmp_path):
    values = {"dataset_type": "arc", "initial_model_path": "m", "origin_yaml_path": "t.yaml", "cal_ppl": False}
    recipe = load_recipe(SFTRecipe, None, values | {"output_dir": str(tmp_path)}, check_paths=False)
    generations = tmp_path / "generations.jsonl"
    generate_conversations(recipe, arc_examples(5), [fake_server.base_url], generations, GenerationSettings(1, 0.7, 2))
    whole = reward_generations(recipe, generations, tmp_path / "whole.jsonl")
    lines = (tmp_path / "whole.jsonl").read_bytes().splitlines(keepends=True)
    torn = tmp_path / "rewarded.jsonl"
    torn.write_bytes(lines[0] + lines[1] + lines[2][:25])  # killed while writing the third question
    resumed = reward_generations(recipe, generations, torn)
    by_question = sorted(load_records(torn)[0], key=lambda line: line["task_id"])
    assert by_question == sorted(load_records(tmp_path / "whole.jsonl")[0], key=lambda line: line["task_id"])
    assert resumed == whole and resumed["questions"] == 5


# ---------------------------------------------------------------- the trainer's process group

# A fake ``accelerate launch``: starts a worker (as accelerate starts the training script) and waits for it. The
# worker starts as alignment-handbook/scripts/run_sft.py does (it asks to be killed when its launcher dies), then
# says so: the pids are written once it is armed, as a real trainer is long before its first step.
FAKE_WORKER = (
    "import signal, time; from optima.serving.processes import set_pdeathsig; set_pdeathsig(signal.SIGKILL); "
    "print('armed', flush=True); time.sleep(600)"
)
FAKE_ACCELERATE = """
import os, subprocess, sys
worker = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE)
worker.stdout.readline()
pids = os.environ["FAKE_TRAINER_PIDS"]
with open(pids + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {worker.pid}")
os.replace(pids + ".tmp", pids)
sys.exit(worker.wait())
""".replace("WORKER", repr(FAKE_WORKER))
# A training "environment": the real Python for the environment check (python -c ...), else the fake accelerate.
FAKE_TRAIN_ENV = """#!/bin/sh
if [ "$1" = "-c" ]; then exec {python} "$@"; fi
exec {python} {fake_accelerate} "$@"
"""


def read_pids(path: Path) -> tuple[int, int] | None:
    return tuple(int(p) for p in path.read_text().split()) if path.exists() else None


@requires_vllm
@requires_data
@pytest.mark.parametrize(
    ("sig", "code"), [(signal.SIGKILL, -9), (signal.SIGTERM, 143), (signal.SIGINT, None)], ids=["kill", "term", "int"]
)
def test_stopping_the_driver_in_training_stops_the_trainer_and_its_workers(tmp_path, fake_server, sig, code):
    (tmp_path / "fake_accelerate.py").write_text(FAKE_ACCELERATE)
    env = tmp_path / "train_python"
    env.write_text(FAKE_TRAIN_ENV.format(python=sys.executable, fake_accelerate=tmp_path / "fake_accelerate.py"))
    env.chmod(0o755)
    (tmp_path / "model").mkdir()
    recipe = write_sft_recipe(
        tmp_path, tmp_path / "model", fake_server.base_url, sample_count=4, cal_ppl=False, preflight=False
    )
    command = [*sft_command(recipe)[:-1], str(env)]  # --alignment_env: the fake
    pids = tmp_path / "pids"
    env = os.environ | {"FAKE_TRAINER_PIDS": str(pids)}
    driver = subprocess.Popen(with_default_signals(command), cwd=REPO, env=env)
    try:
        trainer, worker = wait_for(lambda: read_pids(pids), 120, "the fake trainer and its worker")
        group = os.getpgid(trainer)
        assert group in child_groups(driver.pid) and group != os.getpgid(driver.pid)  # its own group: accelerate's
        assert group == trainer and set(group_members(group)) == {trainer, worker}
        driver.send_signal(sig)
        returncode = driver.wait(timeout=60)
    finally:
        driver.kill()
    assert returncode != 0 and returncode == (code or returncode)
    if sig == signal.SIGKILL:  # nobody is left to clean up: accelerate, then the worker, see their parent die
        wait_for(lambda: group_members(group) == [], 30, "the orphaned trainer group to stop")
    else:  # the driver stopped the group before it exited
        assert group_members(group) == []
    assert stages_done(tmp_path / "run") == ["generate", "score", "select"]


# ---------------------------------------------------------------- bad input: one clear message, nothing started


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory) -> Path:
    """A virtualenv without vllm, trl or torch."""
    path = tmp_path_factory.mktemp("envs") / "bare"
    venv.EnvBuilder(with_pip=False).create(path)
    return path


def bad_input_cases(tmp_path: Path, bare: Path) -> dict[str, tuple[dict, list[str], str]]:
    """name -> (recipe overrides, extra flags, the message expected)."""
    (tmp_path / "a_file").write_text("")
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    read_only.chmod(0o500)
    missing = tmp_path / "no_such_model"
    return {
        "model_missing": (
            {"initial_model_path": str(missing)},
            [],
            f"initial_model_path: input path does not exist: {missing}",
        ),
        "output_under_a_file": (
            {"output_dir": str(tmp_path / "a_file" / "run")},
            [],
            f"output_dir: cannot write the run directory {tmp_path / 'a_file' / 'run'}",
        ),
        "output_read_only": (
            {"output_dir": str(read_only / "run")},
            [],
            f"output_dir: cannot write the run directory {read_only / 'run'}: Permission denied",
        ),
        "vllm_env_without_vllm": ({}, ["--vllm_env", str(bare)], "cannot import vllm, needed as the --vllm_env"),
        "train_env_without_trl": (
            {},
            ["--alignment_env", str(bare)],
            "cannot import torch, transformers, trl, accelerate, datasets, needed as the --alignment_env",
        ),
    }


@requires_vllm
@pytest.mark.parametrize(
    "case",
    ["model_missing", "output_under_a_file", "output_read_only", "vllm_env_without_vllm", "train_env_without_trl"],
)
def test_bad_input_stops_before_any_work_with_one_message(tmp_path, bare_venv, capsys, case):
    if case == "output_read_only" and os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    import sft_script

    (tmp_path / "model").mkdir()
    overrides, flags, message = bad_input_cases(tmp_path, bare_venv)[case]
    recipe = write_sft_recipe(tmp_path, tmp_path / "model", "http://127.0.0.1:9/v1", **{"data_dir": None} | overrides)
    argv = ["--train_config_path", str(recipe), "--vllm_env", str(VLLM_ENV), "--alignment_env", sys.executable, *flags]
    assert sft_script.main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and message in errors[0], err
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists()  # nothing was started: not even the run directory


def test_a_taken_port_is_skipped_and_the_port_used_is_reported(make_recipe, caplog):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", find_free_port("127.0.0.1", 23000 + os.getpid() % 5000)))
        busy.listen()
        taken = busy.getsockname()[1]
        recipe = make_recipe(port=taken)
        stage = RunPaths.from_recipe(recipe).stage(0)
        with caplog.at_level(logging.INFO), serve(recipe, "model", FAKE_ENV, stage) as urls:
            port = int(urls[0].rsplit(":", 1)[1].split("/")[0])
            assert port > taken
            assert requests.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    assert f"replicas on ports {port}" in caplog.text and f"starting on http://127.0.0.1:{port}/v1" in caplog.text


# ---------------------------------------------------------------- kill -9 and SIGTERM mid-stage (slow)

# Enough questions for several score chunks (32 questions each), so that the driver can be caught between them.
FAULT_RUN = {"sample_count": 64, "explore_count": 2, "loss_batch_size": 8}


@pytest.fixture(scope="module")
def scripted_server():
    with FakeOpenAIServer() as server:
        yield server


def summarize(run: Path) -> dict:
    """What an iteration produced, in a form two runs can be compared by."""
    folder = run / "iteration_0"
    stages = {
        name: entry["result"] for name, entry in json.loads((folder / "manifest.json").read_text())["stages"].items()
    }
    rewarded = load_records(folder / "rewarded.jsonl")[0]
    return {
        "stages": list(stages),
        "generations": sorted(json.dumps(r, sort_keys=True) for r in load_records(folder / "generations.jsonl")[0]),
        "rewarded_questions": sorted(line["task_id"] for line in rewarded),
        "conversations": sorted((r["task_id"], r["sample_index"]) for line in rewarded for r in line["results"]),
        "rewards": {(r["task_id"], r["sample_index"]): r["reward"] for line in rewarded for r in line["results"]},
        "score": stages["score"],
        "select": {
            k: stages["select"][k] for k in ("questions", "conversations", "kept_conversations", "rows", "reasons")
        },
        "trained": is_complete(run / "checkpoints" / "iteration_0"),
        "metrics": list(json.loads((folder / "metrics.json").read_text())["stages"]),
    }


def assert_same_outputs(resumed: dict, baseline: dict) -> None:
    assert resumed["stages"] == baseline["stages"] == ["generate", "score", "select", "train"]
    assert resumed["generations"] == baseline["generations"]
    # One rewarded line per question, one result per conversation: nothing lost, nothing duplicated.
    assert resumed["rewarded_questions"] == baseline["rewarded_questions"]
    assert len(set(resumed["rewarded_questions"])) == FAULT_RUN["sample_count"]
    assert resumed["conversations"] == baseline["conversations"]
    assert resumed["rewards"] == pytest.approx(baseline["rewards"], rel=1e-5)  # LM losses may batch differently
    score, expected = dict(resumed["score"]), dict(baseline["score"])  # approx compares flat mappings only
    parts, expected_parts = score.pop("mean_reward_parts", None), expected.pop("mean_reward_parts", None)
    assert score == pytest.approx(expected, rel=1e-5)
    assert parts is not None and parts == pytest.approx(expected_parts, rel=1e-5)
    assert resumed["select"] == baseline["select"]
    assert resumed["trained"] and baseline["trained"] and resumed["metrics"] == baseline["metrics"]


@pytest.fixture(scope="module")
def baseline(tiny_model, tmp_path_factory, scripted_server) -> dict:
    """An uninterrupted run of the fault-test recipe."""
    recipe = write_sft_recipe(tmp_path_factory.mktemp("baseline"), tiny_model, scripted_server.base_url, **FAULT_RUN)
    result = run_sft(recipe)
    assert result.returncode == 0, result.stderr[-3000:]
    return summarize(recipe.parent / "run")


def trainer_started(driver: subprocess.Popen) -> int | None:
    """The trainer's process group once a stage runs in it: ``accelerate launch`` and the trainer script (a tiny
    stage is over within seconds, so the test cannot wait for the first step)."""
    groups = child_groups(driver.pid)  # with endpoints, the trainer's is the only child with its own group
    return groups[0] if groups and len(group_members(groups[0])) >= 2 else None


def wait_for_stage(driver: subprocess.Popen, run: Path, stage: str) -> int | None:
    """Block until the driver is inside ``stage`` (``score``: some questions rewarded; ``train``: trainer up)."""
    if stage == "score":
        rewarded = run / "iteration_0" / "rewarded.jsonl"
        wait_for(lambda: count_lines(rewarded) >= 1, 300, "the first rewarded questions", interval_s=0.02)
        return None
    return wait_for(lambda: trainer_started(driver), 300, "the trainer", interval_s=0.02)


@pytest.mark.slow
@requires_vllm
@requires_data
@pytest.mark.parametrize("stage", ["score", "train"])
def test_kill_9_mid_stage_then_the_same_command_matches_an_uninterrupted_run(
    tiny_model, tmp_path, scripted_server, baseline, stage
):
    recipe = write_sft_recipe(tmp_path, tiny_model, scripted_server.base_url, **FAULT_RUN)
    run = tmp_path / "run"
    driver = start_sft(recipe)
    try:
        group = wait_for_stage(driver, run, stage)
        driver.kill()
        driver.wait(timeout=30)
    finally:
        driver.kill()
    assert stage not in stages_done(run)  # killed inside the stage
    if group is not None:  # the orphaned trainer stops by itself instead of racing the rerun for its checkpoint
        wait_for(lambda: group_members(group) == [], 60, "the orphaned trainer to stop")
        assert not is_complete(run / "checkpoints" / "iteration_0")
    rewarded = count_lines(run / "iteration_0" / "rewarded.jsonl")

    result = run_sft(recipe)
    assert result.returncode == 0, result.stderr[-3000:]
    if stage == "score":
        assert 1 <= rewarded < FAULT_RUN["sample_count"]
        assert f"{FAULT_RUN['sample_count']} questions ({rewarded} already rewarded)" in result.stderr
    assert_same_outputs(summarize(run), baseline)


@pytest.mark.slow
@requires_vllm
@requires_data
@pytest.mark.parametrize("stage", ["score", "train"])
def test_sigterm_mid_stage_exits_143_and_leaves_no_process(tiny_model, tmp_path, scripted_server, stage):
    recipe = write_sft_recipe(tmp_path, tiny_model, scripted_server.base_url, **FAULT_RUN)
    driver = start_sft(recipe)
    try:
        group = wait_for_stage(driver, tmp_path / "run", stage)
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=120) == 143
    finally:
        driver.kill()
    assert stage not in stages_done(tmp_path / "run")
    assert group is None or group_members(group) == []  # the trainer was stopped before the driver exited
    assert "signal 15: stopping" in (tmp_path / "driver.out").read_text()
