"""A run folder holds one lineage: stop, change a setting, rerun, and no row of the old settings is left.

A 2-iteration iSFT loop runs its real generate, score and select stages against a scripted server (no vLLM); the
LM loss and the trainer are stand-ins that write what depends on their inputs (the loss on the loss model's name,
the checkpoint's marker on the training rows and the trainer fields). The scripted replies carry the temperature,
token limit and seed of each request and the training rows of the checkpoint being "served", so a row sampled under
other settings or from another checkpoint differs from a fresh run's. Each case stops the run at a random row of a
random stage (or just before the stage records its end), changes one setting that a stage key holds, reruns, and
compares every output with a fresh run under the final settings: generations, rewards, selections, report rows, the
checkpoints a sweep evaluates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import random
import re
from pathlib import Path

import pytest

import optima.loop as loop_module
from optima import stages
from optima.config import SFTRecipe, load_recipe, stage_fields
from optima.config.rules import loss_model, train_start
from optima.identity import COMPLETE_MARKER, new_weights_id, read_marker
from optima.lineage import lineage_checkpoints
from optima.methods import SFT, TRAINER_STAGES
from optima.reporting import collect_rows
from optima.run import build_run
from optima.serving.holder import ServerHolder
from optima.store import JsonlWriter, load_records, write_json
from tests.fake_openai import FakeOpenAIServer, FakeReply, question_of, speaker_of, turn_of
from tests.test_stage_table import RECIPES, TRAIN_ENV


class Killed(BaseException):
    """A kill: a BaseException, as KeyboardInterrupt, so no ``except Exception`` of a stage swallows it."""


@dataclasses.dataclass
class Budget:
    """Rows that may still be written before the kill (None: no kill planned)."""

    left: int | None = None

    def spend(self) -> None:
        if self.left is not None:
            if self.left <= 0:
                raise Killed
            self.left -= 1


def write_data(root: Path, shift: int = 0) -> Path:
    """An ARC data root with six training questions (``shift`` changes which option is right)."""
    folder = root / "arc_challenge"
    folder.mkdir(parents=True)
    rows = [
        {
            "id": f"arc-{i}",
            "question": f"Question {i}: what is {i} + 2?",
            "choices": {"text": [str(i + 1), str(i + 2), str(i + 3)], "label": ["A", "B", "C"]},
            "answerKey": "ABC"[(i + shift) % 3],
        }
        for i in range(6)
    ]
    (folder / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


def tag(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:8]


class Script:
    """The scripted server's replies: they name the request's settings and the model being served."""

    def __init__(self):
        self.model = "none"

    def __call__(self, body: dict) -> FakeReply:
        if speaker_of(body) == "Bob":
            return FakeReply("Bob: I agree" + (" Alice: yes" if "B" in self.model[:3] else ""))
        question = int(re.search(r"Question (\d+)", question_of(body)).group(1))
        letter = "ABC"[int(tag(self.model, question, body.get("seed"), body.get("temperature")), 16) % 3]
        words = " ".join(["step"] * (int(tag(self.model, question, body.get("seed")), 16) % 7))
        settings = f"t={body.get('temperature')} m={body.get('max_tokens')} on {self.model}"
        return FakeReply(f"Alice: {words} {settings} <A>{letter}</A>" + (" again" if turn_of(body) else ""))


def model_tag(model: str) -> str:
    """What the scripted server is serving: a checkpoint's training rows, or the base model's folder name."""
    marker = read_marker(model) or {}
    return marker.get("rows_tag") or Path(model).name


def fake_train(budget: Budget):
    def train(part, settings) -> dict:
        out, recipe = part.out, part.recipe
        if (out / COMPLETE_MARKER).is_file():  # as ``stages.train``: a finished checkpoint is reused
            return json.loads((out / COMPLETE_MARKER).read_text()) | {
                "model": train_start(recipe, part.model, part.name)
            }
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text("{}")  # a save under way: no completion marker yet
        budget.spend()
        from datasets import load_from_disk

        data = load_from_disk(str(part.sp.dataset))
        rows = {name: sorted(json.dumps(row, sort_keys=True) for row in split) for name, split in data.items()}
        start = model_tag(train_start(recipe, part.model, part.name))
        yaml_text = Path(recipe.origin_yaml_path).read_text()
        rows_tag = tag(rows, start, recipe.trainer_overrides, yaml_text, recipe.accelerate_config)
        marker = {"weights_id": new_weights_id(), "rows_tag": rows_tag, "train_loss": int(rows_tag, 16) / 1e9}
        (out / COMPLETE_MARKER).write_text(json.dumps(marker))
        return marker | {"model": str(train_start(recipe, part.model, part.name))}

    return train


def killable(run, name: str, budget: Budget, kill_at: dict):
    """``run`` of stage ``name``, killed at ``kill_at`` (iteration, stage, rows): at a row, or just before its end is
    recorded."""

    def stage(part, settings, *more):
        if kill_at.get("where") != (part.iteration, name):
            return run(part, settings, *more)
        kill_at.pop("where")
        budget.left = kill_at["rows"]
        try:
            run(part, settings, *more)
        finally:
            budget.left = None
        raise Killed  # its work is done, but the kill came before the manifest recorded it

    return stage


@pytest.fixture
def loop(tmp_path, monkeypatch):
    """``loop(folder, kill_at=None, **settings)`` runs the 2-iteration iSFT loop into ``tmp_path/folder``."""
    budget, kill_at, script = Budget(), {}, Script()
    write_fields = JsonlWriter.write

    def write(self, record):
        budget.spend()
        write_fields(self, record)

    monkeypatch.setattr(JsonlWriter, "write", write)
    for name in ("write_jsonl", "save_splits"):
        original = getattr(stages, name)
        monkeypatch.setattr(stages, name, lambda *a, _original=original: (budget.spend(), _original(*a))[1])

    def serve(self, model, sp):
        script.model = model_tag(model)
        return [server.base_url]

    monkeypatch.setattr(ServerHolder, "serve", serve)
    monkeypatch.setattr(
        stages,
        "loss_scorer",
        lambda run, route, sp: contextlib.nullcontext(fake_losses(run) if route.where != "off" else None),
    )
    monkeypatch.setattr(loop_module, "check_env", lambda env, role: None)
    monkeypatch.setattr(
        loop_module,
        "write_iteration_report",
        lambda part, trained: write_json(
            part.sp.metrics, {"iteration": part.iteration} | loop_module.iteration_metrics(part.manifest)
        ),
    )
    for name in TRAINER_STAGES[SFT]:
        run = fake_train(budget) if name == "train" else getattr(stages, name)
        monkeypatch.setattr(stages, name, killable(run, name, budget, kill_at))
    base = {
        "dataset_type": "arc",
        "data_dir": str(write_data(tmp_path / "data")),
        "initial_model_path": str(write_model(tmp_path / "base")),
        "origin_yaml_path": str(RECIPES / "arc_sft" / "base.yaml"),
        "iteration_times": 2,
        "sample_count": 3,
        "explore_count": 2,
        "max_turns": 4,
        "max_tokens": 32,
        "thread_count": 2,
        "initial_epsilon": -10.0,
        "on_empty_selection": "carry_forward",
        "min_tokens": 5,
        "report_to": "none",
        "loss_placement": "after",  # no loss server here: the stand-in losses are scored by the score stage
        "preflight": False,  # its trainer is a fake (fake_train)
    }

    def run_loop(folder: str, where: tuple | None = None, rows: int = 0, **settings) -> Path:
        kill_at.clear()
        if where is not None:
            kill_at.update(where=where, rows=rows)
        values = base | {"output_dir": str(tmp_path / folder)} | settings
        recipe = load_recipe(SFTRecipe, None, values, check_paths=False)
        try:
            loop_module.run_loop(build_run(recipe, {"train": TRAIN_ENV}, gpu=False))
        except Killed:
            assert where is not None
        return tmp_path / folder

    with FakeOpenAIServer(script) as server:
        yield run_loop


def fake_losses(ctx):
    offset = len(str(loss_model(ctx.recipe))) / 1000  # another loss model, other losses
    return lambda texts: [1.0 + offset + len(text) / 100 for text in texts]


def write_model(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"name": folder.name}))
    return folder


VOLATILE = re.compile(r"elapsed|_s$|seconds|time|_at$|weights_id|model$|started|finished|path|output_dir|lineage")


def canonical(value):
    """``value`` without what differs between two runs of the same settings (times, ids, the run's own paths)."""
    if isinstance(value, dict):
        return {k: canonical(v) for k, v in sorted(value.items()) if not VOLATILE.search(k)}
    if isinstance(value, list):
        return [canonical(v) for v in value]
    return value


def rows_of(path: Path) -> list:
    records = load_records(path)[0] if path.is_file() else []
    return sorted(json.dumps(canonical(r), sort_keys=True) for r in records)


def outputs(run: Path) -> dict:
    """Every output a reader sees, made comparable across two run folders."""
    found = {}
    for iteration in (0, 1):
        folder = run / f"iteration_{iteration}"
        for name in ("generations.jsonl", "rewarded.jsonl", "selection.jsonl"):
            found[f"{iteration}/{name}"] = rows_of(folder / name)
    found["report"] = [  # without times; answers in any order (conversations finish in any order)
        {
            k: sorted(v) if k == "answers" else v
            for k, v in canonical(row).items()
            if not k.startswith(("time_", "total"))
        }
        for row in collect_rows(run)
    ]
    checkpoints = lineage_checkpoints(run / "checkpoints")
    found["sweep"] = [(name, read_marker(path)["rows_tag"]) for name, path in checkpoints]
    return found


def edited_yaml(tmp_path: Path) -> str:
    path = tmp_path / "other.yaml"
    path.write_text((RECIPES / "arc_sft" / "base.yaml").read_text() + "\n# edited\n")
    return str(path)


# Each setting that a stage key holds, with a value that changes what its stage writes (a function: a file to make).
OTHER = {
    "sample_count": 2,
    "explore_count": 3,
    "temperature": 0.9,
    "temperature_iteration0": 1.0,
    "use_prompt_pool": False,
    "answer_bootstrap": "prefill",
    "answer_bootstrap_iterations": 2,
    "max_turns": 3,
    "max_tokens": 24,
    "served_model_name": "renamed",
    "initial_model_path": lambda tmp_path: str(write_model(tmp_path / "other_base")),
    "data_dir": lambda tmp_path: str(write_data(tmp_path / "other_data", shift=1)),
    "seed": 7,
    "lambda1": -0.1,
    "lambda2": 0.3,
    "cal_ppl": False,
    "loss_model_path": "another/loss-model",
    "min_tokens": 12,
    "max_total_tokens": 40,
    "overlong_penalty": -0.5,
    "impersonation_penalty": -3.0,
    "initial_epsilon": 0.0,
    "selection_range": [0.0, 0.5],
    "sft_train_fraction": 0.5,
    "from_initial": True,
    "trainer_overrides": {"learning_rate": 1e-4},
    "origin_yaml_path": edited_yaml,
}
# Stage-key fields left out, and why: the task itself (another task is another run), the prompt pool file (the
# built-in pool is varied through use_prompt_pool), settings whose effect needs a real tokenizer or trainer.
NOT_VARIED = {"dataset_type", "prompt_pool_path", "compat", "loss_backend", "accelerate_config"}
QUICK = ("temperature_iteration0", "lambda1", "trainer_overrides")  # the stages that continue rows or checkpoints


def test_the_cases_cover_every_setting_of_a_stage_key():
    keyed = {name for stage in TRAINER_STAGES[SFT] for name in stage_fields(stage, SFTRecipe)}
    assert set(OTHER) | NOT_VARIED == keyed and not set(OTHER) & NOT_VARIED


def check_case(loop, tmp_path: Path, setting: str, stages: list[str]) -> None:
    """Kill a run at a random row of a random stage of ``stages``, rerun with ``setting`` changed: every output must
    be what a fresh run under the final settings writes."""
    rng = random.Random(f"{setting}/kill")
    value = OTHER[setting](tmp_path) if callable(OTHER[setting]) else OTHER[setting]
    where, rows = (rng.randrange(2), rng.choice(stages)), rng.randrange(1, 12)
    name = f"{setting}-{where[0]}-{where[1]}-{rows}"
    loop(name, where, rows)
    run = loop(name, **{setting: value})
    got, want = outputs(run), outputs(loop(f"{name}-fresh", **{setting: value}))
    assert len(want["report"]) == 2
    for key in want:
        assert got[key] == want[key], f"{setting} changed after a kill at {where} row {rows}: {key} differs"


@pytest.mark.parametrize("setting", QUICK)
def test_a_rerun_after_a_kill_and_a_change_holds_only_rows_of_the_final_settings(loop, tmp_path, setting):
    """One setting of each stage that continues what a killed run left (rows, a checkpoint), the run killed in that
    very stage (of either iteration): the worst case. Selection rewrites its files whole: in the slow cases."""
    stage = next(s for s in TRAINER_STAGES[SFT] if setting in stage_fields(s, SFTRecipe))
    check_case(loop, tmp_path, setting, [stage])


@pytest.mark.slow  # every other setting of a stage key: three runs each
@pytest.mark.parametrize("setting", sorted(set(OTHER) - set(QUICK)))
def test_every_setting_of_a_stage_key_after_a_kill(loop, tmp_path, setting):
    check_case(loop, tmp_path, setting, list(TRAINER_STAGES[SFT]))
