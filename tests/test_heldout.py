"""The held-out evaluation at the end of a training run (optima.evaluation.heldout, optima.loop.run_heldout_stage)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from optima.config import SFTRecipe, load_recipe
from optima.evaluation.heldout import heldout_examples, run_heldout
from optima.evaluation.metrics import wilson_interval
from optima.identity import digest
from optima.loop import heldout_models, render_plan, run_heldout_stage
from optima.reporting import write_run_report
from optima.run import build_run
from optima.tasks import get_task, select_questions
from optima.tasks.choice import normalize_question
from tests.fake_openai import FakeOpenAIServer
from tests.test_layout import sft_recipe
from tests.test_stage_table import TRAIN_ENV

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "train" / "sft_recipes" / "demo_arc.yaml"


@pytest.mark.parametrize(
    ("successes", "total", "low", "high"),
    [(0, 20, 0.0, 0.1611), (10, 20, 0.2993, 0.7007), (20, 20, 0.8389, 1.0), (0, 0, 0.0, 1.0)],
)
def test_wilson_interval(successes, total, low, high):
    assert wilson_interval(successes, total) == (pytest.approx(low, abs=1e-4), pytest.approx(high, abs=1e-4))


def demo_recipe(**overrides) -> SFTRecipe:
    return load_recipe(SFTRecipe, DEMO, {"data_dir": str(REPO / "data")} | overrides, check_paths=False)


def test_the_demo_holds_out_questions_it_never_trains_on():
    recipe = demo_recipe()
    assert recipe.heldout_size > 0  # the demo ends with the held-out table
    sample = heldout_examples(recipe)
    assert len(sample) == recipe.heldout_size and len({e.id for e in sample}) == len(sample)
    task = get_task(recipe.dataset_type)
    train = task.load_train(data_dir=recipe.data_dir, seed=recipe.seed)
    trained = [  # every question the demo's iterations sample conversations on (optima.stages)
        example
        for iteration in range(recipe.iteration_times)
        for example in select_questions(train, recipe.sample_count, recipe.seed, iteration, "sft")
    ]
    assert len(trained) == recipe.sample_count * recipe.iteration_times
    held = {e.id for e in sample}, {normalize_question(e.question) for e in sample}
    assert not held[0] & {e.id for e in trained} and not held[1] & {normalize_question(e.question) for e in trained}
    assert not held[1] & {normalize_question(e.question) for e in train}  # nor anywhere in the training split
    assert {e.id for e in task.load_eval(data_dir=recipe.data_dir)} >= held[0]  # ARC test questions
    assert [e.id for e in heldout_examples(demo_recipe())] == [e.id for e in sample]  # fixed by the seed
    assert [e.id for e in heldout_examples(demo_recipe(heldout_seed=1))] != [e.id for e in sample]


def arc_row(index: int, question: str) -> dict:
    return {"id": f"arc-{index}", "question": question, "choices": {"text": ["3", "4", "5"], "label": ["A", "B", "C"]},
            "answerKey": "B"}  # fmt: skip


def write_data(root: Path) -> Path:
    """Five test questions; the training split holds the first one's text under another id."""
    folder = root / "arc_challenge"
    folder.mkdir(parents=True)
    test = [arc_row(i, f"Question {i}: what is 2 + 2?") for i in range(5)]
    train = [arc_row(100, "Question 0: what is 2 + 2?"), arc_row(101, "A training question?")]
    for name, rows in (("test", test), ("train", train)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


def model_folder(path: Path, marker: str) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"marker": marker}))
    return path


def reply_by_model(served: list[str]):
    """The base model names option B in words only; the checkpoints write the tag."""

    def respond(body: dict):
        from tests.fake_openai import FakeReply

        if served[-1] == "base":
            return FakeReply("I think the correct answer is option B.")
        return FakeReply("<A>B) 4</A>")

    return respond


def test_every_model_answers_the_same_questions_and_a_rerun_generates_nothing(tmp_path):
    served: list[str] = []
    with FakeOpenAIServer(respond=reply_by_model(served)) as fake:
        recipe = sft_recipe(tmp_path, data_dir=str(write_data(tmp_path / "data")), endpoints=[fake.base_url],
                            heldout_size=3, iteration_times=2, max_turns=2)  # fmt: skip
        models = [("base", model_folder(tmp_path / "base", "b"))]
        models += [(f"iteration_{k}", model_folder(tmp_path / f"ck/iteration_{k}", str(k))) for k in range(2)]
        out_root = Path(recipe.output_dir) / "heldout"

        def serve_model(name: str, path: Path):
            served.append(name)
            return contextlib.nullcontext([fake.base_url])

        table = run_heldout(recipe, out_root, models, serve_model)
        assert served == ["base", "iteration_0", "iteration_1"]
        requests = len(fake.requests)
        assert run_heldout(recipe, out_root, models, serve_model).splitlines()[2:] == table.splitlines()[2:]
        assert served == ["base", "iteration_0", "iteration_1"] and len(fake.requests) == requests  # all resumed
    summary = json.loads((out_root / "summary.json").read_text())
    ids = summary["question_ids"]
    assert len(ids) == 3 and "arc-0" not in ids  # arc-0's text is in the training split
    rows = summary["models"]
    assert [row["model"] for row in rows] == ["base", "iteration_0", "iteration_1"]
    assert {row["question_ids"] for row in rows} == {digest(sorted(ids))}  # identical questions in every row
    base, last = rows[0], rows[-1]
    assert base["answer_rate"] == 0.0 and base["accuracy"] == 0.0  # no tag ...
    assert base["flexible_answer_rate"] == 1.0 and base["accuracy_flexible"] == 1.0  # ... but option B in words
    assert base["accuracy_flexible_low"] == pytest.approx(wilson_interval(3, 3)[0], abs=1e-4)
    assert last["answer_rate"] == 1.0 and last["accuracy"] == 1.0 and last["cut_rate"] == 0.0
    assert (out_root / "summary.png").read_bytes().startswith(b"\x89PNG")
    markdown, _ = write_run_report(Path(recipe.output_dir))
    report = markdown.read_text()
    assert report.rindex("## ") == report.index("## Held-out evaluation")  # the report's last table
    assert "| base | 3 | 0 | 0 | 0.00-0.56 | 1 | 1 | 0.44-1.00 |" in report


def test_the_plan_shows_the_heldout_evaluation_after_the_last_iteration(tmp_path):
    recipe = sft_recipe(tmp_path, heldout_size=5, iteration_times=2)
    run = build_run(recipe, {"train": TRAIN_ENV}, gpu=False)
    text = render_plan(run)
    assert text.index("[heldout]") > text.rindex("[train]") and "5 of the arc eval split" in text
    checkpoint = model_folder(run.paths.checkpoint(0), "0")  # iteration 2 has not trained yet
    assert heldout_models(run) == [("base", Path("/models/base")), ("iteration_0", checkpoint)]
    plain = sft_recipe(tmp_path)
    assert run_heldout_stage(build_run(plain, {}, gpu=False)) is None  # off by default
    assert "[heldout]" not in render_plan(build_run(plain, {"train": TRAIN_ENV}, gpu=False))
