"""The two evaluation scripts end to end against a scripted OpenAI server (recipe ``endpoints``: nothing launched).

Covers the sweep (files, summaries, table, plot, resume per checkpoint and per question), the self-consistency run
with the CoT baselines, the CoT prompt, and the flags' validation. The same flows on the real vLLM are in
``test_eval_vllm.py``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path

import pytest

from optima.evaluation.baselines import build_cot_messages
from optima.store import load_records
from optima.tasks import Example
from tests.fake_openai import FakeOpenAIServer, FakeReply, agreeing_reply
from tests.helpers import mark_finished
from tests.test_scripts import load_script

ARC_ROWS = [
    {
        "id": f"arc-{i}",
        "question": f"Question {i}: what is 2 + 2?",
        "choices": {"text": ["3", "4", "5"], "label": ["A", "B", "C"]},
        "answerKey": "B" if i % 2 == 0 else "A",  # half of the questions are answered right by "B"
    }
    for i in range(4)
]


def write_arc_data(root: Path) -> Path:
    """A local data root with a four-question ARC test split."""
    folder = root / "arc_challenge"
    folder.mkdir(parents=True)
    (folder / "test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ARC_ROWS))
    return root


def reply_with_cot(body: dict) -> FakeReply:
    """Single-agent CoT requests answer B at once; two-agent conversations agree on B (3 utterances)."""
    if body["messages"][0]["content"].startswith("You answer"):
        return FakeReply("2 + 2 = 4, option B. <A>B) 4</A>")
    return agreeing_reply(body)


@pytest.fixture
def server():
    with FakeOpenAIServer(respond=reply_with_cot) as fake:
        yield fake


@pytest.fixture(autouse=True)
def detach_driver_logs():
    """The scripts add a driver-log handler to the root logger; remove the ones a test added."""
    root = logging.getLogger()
    before = list(root.handlers)
    yield
    for handler in [h for h in root.handlers if h not in before]:
        root.removeHandler(handler)
        handler.close()


def common_flags(tmp_path: Path, server: FakeOpenAIServer) -> list[str]:
    data = write_arc_data(tmp_path / "data")
    return ["--dataset_type", "arc", "--data_dir", str(data), "--set", f"endpoints=[{server.base_url}]"]


def sweep_argv(tmp_path: Path, server: FakeOpenAIServer) -> list[str]:
    root = tmp_path / "checkpoints"
    for k in (1, 0):
        mark_finished(root / f"iteration_{k}")
    return ["--model_root_path", str(root), "--limit", "3", *common_flags(tmp_path, server)]


def test_sweep_writes_results_summaries_and_plot(tmp_path, server, capsys):
    assert load_script("inference_script").main(sweep_argv(tmp_path, server)) == 0
    out = tmp_path / "checkpoints" / "eval"
    for name in ("iteration_0", "iteration_1"):
        records, _ = load_records(out / f"{name}.jsonl")
        assert len(records) == 3 and {r["temperature"] for r in records} == {0.0}
        assert all(r["stage"] == "eval" and not r["prompt_pool"] for r in records)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["metric"] == "accuracy" and summary["original_metric"] == "accuracy_original"
    rows = summary["models"]
    assert [r["model"] for r in rows] == ["iteration_0", "iteration_1"] and [r["iteration"] for r in rows] == [0, 1]
    assert [r["checkpoint"] for r in rows] == ["after iteration 1", "after iteration 2"]
    assert (
        rows[0]["accuracy"] == pytest.approx(2 / 3, abs=1e-4) and rows[0]["accuracy_original"] == 0.0
    )  # "B" is no text
    assert rows[0]["mean_tokens"] > 0 and rows[0]["no_answer_rate"] == 0.0 and rows[0]["questions"] == 3
    csv_lines = (out / "summary.csv").read_text().splitlines()
    assert csv_lines[0].startswith("model,iteration,questions") and len(csv_lines) == 3
    assert (out / "summary.png").read_bytes()[:4] == b"\x89PNG"
    page = (out / "conversations.html").read_text()
    assert "<h2>Optima · after iteration 1</h2>" in page and "<h2>Optima · after iteration 2</h2>" in page
    table = capsys.readouterr().out
    assert "accuracy_original" in table and "iteration_1" in table


def test_a_second_sweep_into_the_same_folder_stops_at_its_lock(tmp_path, server, capsys):
    from optima.lineage import LOCK_FILE

    out = tmp_path / "checkpoints" / "eval"
    out.mkdir(parents=True)
    (out / LOCK_FILE).write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname()}))  # a live one
    assert load_script("inference_script").main(sweep_argv(tmp_path, server)) == 1
    assert f"{out} is being written by another run (pid {os.getppid()}" in capsys.readouterr().err
    assert not server.requests and not (out / "iteration_0.jsonl").exists()


def test_sweep_resumes_per_checkpoint_and_per_question(tmp_path, server):
    argv = sweep_argv(tmp_path, server)
    script = load_script("inference_script")
    assert script.main(argv) == 0
    first = len(server.requests)
    out = tmp_path / "checkpoints" / "eval"
    done = out / "iteration_0.jsonl"
    stamp = done.stat().st_mtime_ns
    # Lose the last conversation of iteration_1: only that one is redone.
    partial = out / "iteration_1.jsonl"
    partial.write_text("".join(partial.read_text().splitlines(keepends=True)[:-1]))
    assert script.main(argv) == 0
    assert len(server.requests) - first == 3  # one conversation of three utterances
    assert done.stat().st_mtime_ns == stamp
    log = (out / "logs" / "driver.log").read_text()  # the scripts reset the root logger: read the run's own log
    assert log.count("iteration_0 | skip: 1 result files complete, no server started") == 1
    assert len(load_records(partial)[0]) == 3


def test_self_consistency_with_the_cot_baselines(tmp_path, server, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    argv = ["--model_path", str(model), "--num_samples", "3", "--baseline", "cot", "--max_k", "2"]
    assert load_script("multi_sc_data_generate_script").main(argv + common_flags(tmp_path, server)) == 0
    out = model / "eval"
    counts = {
        name: len(load_records(out / name)[0]) for name in ("model.sc.jsonl", "model.cot.jsonl", "model.cot_sc.jsonl")
    }
    assert counts == {"model.sc.jsonl": 12, "model.cot.jsonl": 4, "model.cot_sc.jsonl": 12}
    cot, _ = load_records(out / "model.cot.jsonl")
    assert all(r["final_answer"] == "B) 4" and len(r["utterances"]) == 1 for r in cot)
    assert {r["temperature"] for r in cot} == {0.0}
    analysis = json.loads((out / "sc_analysis.json").read_text())
    methods = analysis["models"]["model"]
    assert [row["k"] for row in methods["optima_sc"]] == [1, 2] and [row["k"] for row in methods["cot_sc"]] == [1, 2]
    assert methods["optima_sc"][1] == {
        "k": 2,
        "majority_vote": 0.5,
        "coverage": 0.5,
        "tokens": 38.0,
        "cut_rate": 0.0,
        "questions": 4,
    }
    # The original's exact match reads the text after the prompt's label: "B) 4" matches the gold text "4".
    assert methods["cot"]["accuracy"] == methods["cot"]["accuracy_original"] == 0.5
    assert (out / "sc_analysis.csv").read_text().count("\n") == 1 + 2 + 1 + 2
    assert (out / "sc_analysis.png").is_file()
    assert "cot_sc" in capsys.readouterr().out
    # The CoT requests are single-agent chats: a system prompt and the question with the format line.
    cot_bodies = [b for b in server.bodies() if b["messages"][0]["content"].startswith("You answer")]
    assert len(cot_bodies) == 16 and all(len(b["messages"]) == 2 for b in cot_bodies)
    assert cot_bodies[0]["messages"][1]["content"].startswith("Problem:\nQuestion")


def test_cot_prompt_gives_one_agent_all_of_the_context():
    example = Example("h1", "hotpot_qa", "Where?", "Paris", "f1", ("Alice knows A.",), ("Bob knows B.",))
    system, user = build_cot_messages(example)
    assert system["role"] == "system" and "<A>" in system["content"]
    assert "Alice knows A.\nBob knows B." in user["content"] and user["content"].endswith("<A>{your answer}</A>.")


def test_dry_run_mentions_the_baseline(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    argv = ["--model_path", str(tmp_path), "--dataset_type", "arc", "--baseline", "cot", "--dry-run"]
    assert load_script("multi_sc_data_generate_script").main(argv) == 0
    assert "baseline: cot, cot-SC" in capsys.readouterr().out


def test_bad_max_k_is_a_clear_error(tmp_path, server, capsys):
    (tmp_path / "config.json").write_text("{}")
    argv = ["--model_path", str(tmp_path), "--max_k", "0", *common_flags(tmp_path, server)]
    assert load_script("multi_sc_data_generate_script").main(argv) == 2
    assert "max_k: must be >= 1, got 0" in capsys.readouterr().err


REPO_DATA = Path(__file__).resolve().parents[1] / "data"


def test_limit_samples_every_mmlu_subject_of_the_repo_data(tmp_path, server):
    """``inference_script.py --limit 40`` on MMLU from ``data/``: every subject with 3+ questions is evaluated.

    The first 40 rows of the subject-sorted split cover 8 of its 16 subjects; the stratified sample covers all.
    """
    mark_finished(tmp_path / "checkpoints" / "iteration_0")
    flags = ["--dataset_type", "mmlu", "--data_dir", str(REPO_DATA), "--set", f"endpoints=[{server.base_url}]"]
    argv = ["--model_root_path", str(tmp_path / "checkpoints"), "--limit", "40", *flags]
    assert load_script("inference_script").main(argv) == 0
    out = tmp_path / "checkpoints" / "eval"
    records, _ = load_records(out / "iteration_0.jsonl")
    subjects = [json.loads(line)["subject"] for line in (REPO_DATA / "mmlu" / "test.jsonl").read_text().splitlines()]
    wanted = {s for s in subjects if subjects.count(s) >= 3}
    assert len(records) == 40 and len(wanted) == 14
    assert wanted <= {r["example"]["group"] for r in records}
    assert "a debugging aid, not a benchmark result" in (out / "logs" / "driver.log").read_text()


def test_limit_mode_first_keeps_the_first_questions_and_the_sample_is_fixed(tmp_path):
    from optima.config import InferenceRecipe
    from optima.evaluation.runs import load_eval_examples

    def ids(**values):
        recipe = InferenceRecipe(dataset_type="math", model_root_path=str(tmp_path), data_dir=str(REPO_DATA), **values)
        return [example.id for example in load_eval_examples(recipe)]

    first, sample = ids(limit=10, limit_mode="first"), ids(limit=10)
    assert first == ids()[:10] and sample != first and len(sample) == 10
    assert sample == ids(limit=10) and ids(limit=10, seed=7) != sample  # seeded: fixed for a seed
