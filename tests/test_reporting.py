"""Run reports and iteration tracking from metrics.json files written by the same code as a real run."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from optima.__main__ import main as optima_main
from optima.config import parse_report_to
from optima.lineage import Manifest
from optima.loop import iteration_metrics
from optima.reporting import collect_rows, write_run_report
from optima.stages import reward_stats, verifier_stats
from optima.tasks import Example
from optima.tracking import (
    resolve_report_to,
    scalars_of,
    trainer_env,
    trainer_overrides,
    write_tensorboard_scalars,
)


def rewarded_line(scores: list[float], tokens: list[int]) -> dict:
    """One rewarded question as the score stage writes it (parts: task, token, loss terms; no penalty)."""
    results = []
    for score, count in zip(scores, tokens, strict=True):
        parts = {"task_score": score, "token_term": -0.6 * count / 100, "loss_term": 0.5, "penalty": 0.0}
        parts["reward"] = sum(parts.values())
        results.append({"final_answer": "x" if score else "", "token_count": count, "reward_parts": parts,
                        "reward": parts["reward"]})  # fmt: skip
    return {"task_id": "q", "results": results}


def write_metrics(folder: Path, iteration: int, stages: dict[str, tuple[dict, float]]) -> None:
    """metrics.json of one stage folder through the manifest, as ``write_iteration_report`` writes it."""
    manifest = Manifest(folder / "manifest.json", dict.fromkeys(stages, "h"))
    for name, (result, seconds) in stages.items():
        manifest.record(name, result, seconds)
    (folder / "metrics.json").write_text(json.dumps({"iteration": iteration} | iteration_metrics(manifest)))


def sft_stages(scores: list[float], tokens: list[int], kept: int, loss: float) -> dict[str, tuple[dict, float]]:
    return {
        "generate": ({"written": len(scores)}, 10.0),
        "score": (reward_stats([rewarded_line(scores, tokens)]), 2.0),
        "select": ({"kept_conversations": kept, "rows": {"train": 2 * kept}}, 0.5),
        "train": ({"train_loss": loss, "train_rows": 2 * kept}, 30.0),
    }


DPO_STAGES = {
    "probe": ({"conversations": 4, "t_max": 120}, 5.0),
    "search": ({"questions": 2, "rollouts": 12, "failed_rollouts": 1, "failed_requests": 3, "t_max": 120,
                "answer_rate": 0.75, "accuracy": 0.5,
                "mean_tokens": 80.0, "mean_reward_parts": {"task_score": 0.5, "token_term": -0.4, "loss_term": 0.3,
                                                           "penalty": 0.0, "reward": 0.4}}, 40.0),
    "pairs": ({"questions": 2, "questions_with_pairs": 1, "pairs_found": 6, "pairs_kept": 3}, 1.0),
    "train": ({"train_loss": 0.69, "train_rows": 3}, 20.0),
}  # fmt: skip


@pytest.fixture
def sft_run(tmp_path: Path) -> Path:
    run = tmp_path / "run_sft"
    write_metrics(run / "iteration_0", 0, sft_stages([1.0, 0.0, 1.0, 0.0], [100, 200, 100, 200], 2, 2.5))
    write_metrics(run / "iteration_1", 1, sft_stages([1.0, 1.0, 1.0, 0.0], [50, 50, 50, 50], 3, 1.25))
    (run / "recipe.yaml").write_text("dataset_type: arc\ninitial_model_path: m\niteration_times: 3\n")
    return run


def test_report_rows_hold_the_iteration_numbers(sft_run):
    rows = collect_rows(sft_run)
    assert [row["label"] for row in rows] == ["1", "2"]  # counted from 1, as the logs and the README count them
    first, second = rows
    assert first["answer_rate"] == 0.5 and first["task_score"] == 0.5 and first["mean_tokens"] == 150.0
    assert second["answer_rate"] == 0.75 and second["mean_tokens"] == 50.0
    assert first["kept"] == 2 and second["train_loss"] == 1.25
    # mean token term over the 4 conversations: -0.6 * 150 / 100
    assert first["part_token_term"] == pytest.approx(-0.9) and first["part_loss_term"] == 0.5
    assert first["time_generate"] == 10.0 and first["total_s"] == 42.5


def test_report_files_are_written_and_redrawn_by_the_command(sft_run, capsys):
    markdown, image = write_run_report(sft_run)
    text = markdown.read_text()
    assert "method iSFT, task `arc`" in text
    # per-iteration table, second row: answer rate and task score, strict then flexible, tokens, cut, copies, ...
    assert "| 2 | 0.75 | 0.75 | 0.75 | 0.75 | 50.0 | 0 | 0 | 4 | 3 | 1.25 | 42.5 |" in text
    assert "| 1 | 0.5 | -0.9 | 0.5 | 0 | 0.1 |" in text  # mean reward parts of the first iteration
    assert "## DPO pairs" not in text
    assert image.read_bytes().startswith(b"\x89PNG")
    image.unlink()
    assert optima_main(["report", str(sft_run)]) == 0
    assert image.exists() and "## Stage times (s)" in capsys.readouterr().out


def test_the_score_stage_counts_answers_named_in_words():
    example = Example("q", "arc", "?", "sand", "choice", options=(("A", "water"), ("C", "sand"))).to_dict()
    parts = {"task_score": 0.0, "token_term": 0.0, "loss_term": 0.0, "penalty": 0.0, "reward": 0.0}

    def result(final: str, status: str, reply: str) -> dict:
        utterances = [{"speaker": "Alice", "text": reply, "tokens": 4}]
        return {"final_answer": final, "status": status, "token_count": 4, "reward_parts": parts, "reward": 0.0,
                "example": example, "utterances": utterances}  # fmt: skip

    numbers = reward_stats([{"task_id": "q", "results": [
        result("", "ok", "<A>{letter}) {option text}</A> The answer is C."),  # right, in words only
        result("", "too_long", "The answer is C."),  # cut: no answer either way
        result("A", "ok", "<A>A</A>"),  # a strict answer (wrong) is also the flexible one
    ]}])  # fmt: skip
    assert numbers["answer_rate"] == round(1 / 3, 4) and numbers["accuracy"] == 0.0
    assert numbers["flexible_answer_rate"] == round(2 / 3, 4) and numbers["flexible_accuracy"] == round(1 / 3, 4)


def test_a_math_run_report_counts_the_verifier_timeouts(tmp_path):
    run = tmp_path / "run_math"
    stages = sft_stages([1.0, 0.0], [100, 100], 1, 2.0)
    stages["score"] = (stages["score"][0] | {"verifier_timeouts": 3}, 2.0)  # what a MATH score stage adds
    write_metrics(run / "iteration_0", 0, stages)
    assert collect_rows(run)[0]["verifier_timeouts"] == 3
    text = write_run_report(run)[0].read_text()
    assert "| time (s) | verifier_timeouts |" in text and "| 42.5 | 3 |" in text
    assert scalars_of(collect_rows(run)[0])["conversations/verifier_timeouts"] == 3.0


def test_a_stage_counts_its_verifiers_timeouts():
    assert verifier_stats(None) == {}  # not a MATH run: no verifier, no column
    assert verifier_stats(SimpleNamespace(timeouts=2)) == {"verifier_timeouts": 2}


EXAMPLE = Example("q", "arc", "?", "4", "choice", options=(("A", "3"), ("B", "4"))).to_dict()


def test_the_report_counts_placeholder_copies_per_iteration(tmp_path):
    """A conversation that states a copied placeholder (any variant) counts once, however many times it copies."""
    texts = [["<A>{letter}) {option text}</A>", "<A>X) option text</A>"], ["<A>B) 4</A>"], ["<A>[your answer]</A>"]]
    line = rewarded_line([0.0, 1.0, 0.0], [10, 10, 10])
    for result, utterances in zip(line["results"], texts, strict=True):
        result |= {"example": EXAMPLE, "status": "ok", "utterances": [{"speaker": "A", "text": t} for t in utterances]}
    stats = reward_stats([line])
    assert stats["placeholder_copies"] == 2
    write_metrics(tmp_path / "run" / "iteration_0", 0, {"score": (stats, 1.0)})
    (row,) = collect_rows(tmp_path / "run")
    assert row["placeholder_copies"] == 2
    assert "| cut share | placeholder copies |" in write_run_report(tmp_path / "run")[0].read_text()


def write_generations(folder: Path, answers: list[str], cut: int = 0) -> None:
    """generations.jsonl with one conversation per answer ("" states none); the first ``cut`` ones were cut."""
    records = [{"task_id": f"q{i}", "sample_index": 0, "final_answer": answer, "status": "too_long" if i < cut
                else "ok", "cut_replies": int(i < cut)} for i, answer in enumerate(answers)]  # fmt: skip
    (folder / "generations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_report_lists_the_most_frequent_final_answers_per_iteration(sft_run):
    write_generations(sft_run / "iteration_0", ["B) adding heat"] * 14 + ["answer"] * 2 + ["C) 4"] + [""] * 3)
    many = [f"answer {i}" for i in range(12) for _ in range(12 - i)]  # 12 distinct answers, 12 down to 1 times
    write_generations(sft_run / "iteration_1", many + ["Wide | answer\nwith a newline"])
    markdown, _ = write_run_report(sft_run)
    text = markdown.read_text()
    section = text.split("## Most frequent final answers")[1].split("\n## ")[0]
    assert "| 1 | 1 | `B) adding heat` | 14 | 0.7 |" in section  # 14 of the 20 conversations
    assert "| 1 | 2 | `answer` | 2 | 0.1 |" in section and "| 1 | 3 | `C) 4` | 1 | 0.05 |" in section
    assert "| 1 | 4 |" not in section  # conversations without an answer are not an answer
    assert "| 2 | 10 | `answer 9` | 3 |" in section and "| 2 | 11 |" not in section  # ten per iteration
    assert "`Wide" not in section  # (one occurrence: below the top ten)


def test_a_report_answer_cannot_break_its_table(tmp_path):
    run = tmp_path / "run"
    write_metrics(run / "iteration_0", 0, sft_stages([1.0], [10], 1, 1.0))
    write_generations(run / "iteration_0", ["a | b\nc"])
    text = write_run_report(run)[0].read_text()
    assert "| 1 | 1 | `a \\| b c` | 1 | 1 |" in text


def test_report_of_an_sft_dpo_run_has_pair_and_rollout_stats(tmp_path):
    run = tmp_path / "run_sft_dpo"
    write_metrics(run / "iteration_0" / "sft", 0, sft_stages([1.0, 0.0], [100, 100], 1, 2.0))
    write_metrics(run / "iteration_0" / "dpo", 0, DPO_STAGES)
    rows = collect_rows(run)
    assert [(row["label"], row["kind"]) for row in rows] == [("1 sft", "sft"), ("1 dpo", "dpo")]
    dpo = rows[1]
    assert (dpo["answer_rate"], dpo["conversations"], dpo["kept"], dpo["pairs_found"]) == (0.75, 12, 3, 6)
    text = write_run_report(run)[0].read_text()
    assert "method iSFT-DPO" in text
    # DPO table: T_max, questions, rollouts, failed rollouts and requests (left out of the trees), pairs
    assert "| 1 dpo | 120 | 2 | 12 | 1 | 3 | 6 | 3 | 1 |" in text


def test_missing_run_directory_is_a_clear_error(tmp_path, capfd):
    assert optima_main(["report", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capfd.readouterr().err


def test_tensorboard_scalars_one_step_per_iteration(sft_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = write_tensorboard_scalars(sft_run, collect_rows(sft_run))
    write_tensorboard_scalars(sft_run, collect_rows(sft_run))  # a resumed run rewrites, never duplicates
    assert len(list(folder.glob("events.out.tfevents.*"))) == 1
    events = EventAccumulator(str(folder))
    events.Reload()
    tokens = events.Scalars("conversations/mean_tokens")
    assert [(e.step, e.value) for e in tokens] == [(0, 150.0), (1, 50.0)]
    assert [e.value for e in events.Scalars("train/train_loss")] == [2.5, 1.25]
    assert "reward_parts/token_term" in events.Tags()["scalars"]


class FakeEnv:
    def __init__(self, missing: list[str]):
        self.missing = missing

    def missing_modules(self, modules):
        return [m for m in modules if m in self.missing]


def test_report_to_resolution_and_trainer_keys(tmp_path):
    assert resolve_report_to("auto", FakeEnv([])) == ["tensorboard"]
    assert resolve_report_to("auto", FakeEnv(["tensorboard"])) == []
    assert resolve_report_to("none", FakeEnv([])) == []
    assert resolve_report_to(["tensorboard", "wandb"], FakeEnv([])) == ["tensorboard", "wandb"]
    with pytest.raises(ValueError, match="wandb"):
        resolve_report_to("wandb", FakeEnv(["wandb"]))
    with pytest.raises(ValueError, match="report_to"):
        parse_report_to("mlflow")
    run = tmp_path / "demo"
    keys = trainer_overrides(["tensorboard"], run, run / "iteration_1" / "dpo")
    assert keys == {"report_to": ["tensorboard"], "run_name": "demo/iteration_1/dpo"}
    assert trainer_overrides([], run, run / "iteration_0")["report_to"] == "none"
    env = trainer_env(["tensorboard"], run, run / "iteration_0")
    assert env == {"TENSORBOARD_LOGGING_DIR": str(run / "tensorboard" / "iteration_0")}
    assert trainer_env([], run, run / "iteration_0") == {}
