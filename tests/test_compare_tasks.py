"""The paper's table from one command: ``compare --tasks a,b`` (methods x tasks), Optima SC rows, the paper's
defaults, MAD's context on information-exchange tasks, and the baselines of the self-consistency script on the base
model. Against the scripted server (no vLLM); the same command on the demo checkpoint is the slow test at the end.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest

from optima.__main__ import main as optima_main
from optima.evaluation.baselines import DebateSettings, debate_prompts, debater_messages
from optima.evaluation.runs import read_producer
from optima.identity import COMPLETE_MARKER, model_identity
from optima.store import load_records
from optima.tasks import Example, get_task
from tests._task_fixtures import resolve_test_data_dir
from tests.fake_openai import FakeOpenAIServer, FakeReply, speaker_of
from tests.test_eval_runs import detach_driver_logs, write_arc_data  # noqa: F401  (fixture)
from tests.test_scripts import load_script

REPO = Path(__file__).resolve().parent.parent
DEMO_CHECKPOINT = REPO / "runs" / "demo_arc_sft" / "checkpoints" / "iteration_1"
SMOLLM2 = REPO / "models" / "SmolLM2-135M-Instruct"


def write_data(root: Path) -> Path:
    """ARC (4 questions, half answered right by B) and GSM8K (4 questions, answer 4)."""
    write_arc_data(root)
    rows = [{"question": f"Question {i}: what is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"} for i in range(4)]
    (root / "gsm8k").mkdir()
    (root / "gsm8k" / "test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


def reply(body: dict) -> FakeReply:
    """Every method answers 4 in both formats (ARC reads the tag, GSM8K the box)."""
    if not body["messages"][0]["content"].startswith("You are"):  # one agent (CoT, MAD): no name, no partner
        return FakeReply("2 + 2 = 4. <A>B) 4</A> \\boxed{4}")
    if speaker_of(body) == "Alice":
        return FakeReply("Alice: 2 + 2 = 4 <A>B) 4</A> \\boxed{4}")
    return FakeReply("Bob: looks right")


def model_folder(path: Path, weights_id: str | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    if weights_id:
        (path / COMPLETE_MARKER).write_text(json.dumps({"weights_id": weights_id}))
    return path


def test_compare_over_tasks_writes_the_methods_by_tasks_table_with_optima_sc(tmp_path, capsys):
    base, ckpt = model_folder(tmp_path / "base"), model_folder(tmp_path / "ckpt", "w1")
    out = tmp_path / "table"
    with FakeOpenAIServer(respond=reply) as server:
        argv = ["compare", "--model", str(base), "--tasks", "arc,gsm8k", "--limit", "2", "--output_path", str(out)]
        argv += ["--data_dir", str(write_data(tmp_path / "data")), "--set", f"endpoints=[{server.base_url}]"]
        argv += ["--methods", "cot", "cot_sc", "mad", "--samples", "2", "--mad_agents", "2", "--mad_rounds", "1"]
        argv += ["--optima", f"Opt={ckpt}", "--optima_sc", "3"]
        assert optima_main(argv) == 0
        sent = len(server.requests)
        assert optima_main(argv) == 0 and len(server.requests) == sent  # both tasks complete: nothing sent
    for task in ("arc", "gsm8k"):
        rows = list(csv.DictReader((out / task / "comparison.csv").open()))
        assert [r["method"] for r in rows] == ["CoT", "CoT-SC", "MAD", "Opt", "Opt SC"]
        sc, _ = load_records(out / task / "Opt.optima_sc.jsonl")
        assert len(sc) == 2 * 3 and {r["temperature"] for r in sc} == {0.5}  # K samples per question, sampled
        assert read_producer(out / task / "Opt.optima_sc.jsonl")["generation"]["samples"] == 3
    markdown = (out / "table.md").read_text()
    assert markdown.startswith("| method | arc | gsm8k |")
    assert "| Opt SC | 0.500 / " in markdown and "| CoT | " in markdown  # ARC: B is right for one of two
    wide = {r["method"]: r for r in csv.DictReader((out / "table.csv").open())}
    assert list(wide) == ["CoT", "CoT-SC", "MAD", "Opt", "Opt SC"]
    assert float(wide["CoT"]["gsm8k_accuracy"]) == 1.0 and float(wide["CoT"]["arc_accuracy"]) == 0.5
    assert float(wide["CoT-SC"]["arc_tokens"]) == 2 * float(wide["CoT"]["arc_tokens"])
    assert {"arc_cut", "gsm8k_answer_rate"} <= set(wide["MAD"])
    assert (out / "table.png").read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((out / "table.json").read_text())
    assert saved["settings"]["optima_sc"] == 3 and saved["producers"]["gsm8k"]["Opt"]["model"] == "w1"
    assert "Methods x tasks" in capsys.readouterr().out


def test_a_task_prefixed_optima_row_appears_in_its_task_only(tmp_path, capsys):
    ckpt = model_folder(tmp_path / "ckpt")
    argv = ["compare", "--model", str(tmp_path), "--tasks", "arc,gsm8k", "--optima", f"arc:Opt={ckpt}"]
    assert optima_main([*argv, "--output_path", str(tmp_path / "out"), "--dry-run"]) == 0
    plans = capsys.readouterr().out.split("Optima comparison plan: ")[1:]
    assert [p.split(",")[0] for p in plans] == ["arc", "gsm8k"]
    assert "[Opt] serve" in plans[0] and "[Opt]" not in plans[1]
    assert optima_main(["compare", "--model", str(tmp_path), "--tasks", "arc,arc", "--dry-run"]) == 2


def test_the_defaults_are_the_papers(tmp_path, capsys):
    argv = ["compare", "--model", str(tmp_path), "--dataset_type", "hotpot_qa", "--dry-run"]
    assert optima_main([*argv, "--output_path", str(tmp_path / "out")]) == 0
    plan = capsys.readouterr().out
    assert "CoT-SC: 8 samples" in plan and "MAD: 3 agents, 2 rounds" in plan and "whole context" in plan
    assert DebateSettings() == DebateSettings(3, 2, "whole")


def test_mad_context_on_information_exchange_tasks_is_whole_or_split():
    example = Example("h1", "hotpot_qa", "Where?", "Paris", "f1", ("Alice knows A.",), ("Bob knows B.",))
    task = get_task("hotpot_qa")
    whole = [debater_messages(example, task, DebateSettings(3, 2, "whole"), a)[1]["content"] for a in range(3)]
    assert all("Alice knows A.\nBob knows B." in text for text in whole)
    split = [debater_messages(example, task, DebateSettings(3, 2, "split"), a)[1]["content"] for a in range(3)]
    assert "Alice knows A." in split[0] and "Bob knows B." not in split[0]
    assert "Bob knows B." in split[1] and "Alice knows A." not in split[1]
    assert split[2] == split[0]  # agent i reads half i mod 2
    # The context is part of the prompt version (a split debate is another producer); a debate task has no context.
    assert debate_prompts(example, DebateSettings(context="split")) != debate_prompts(example, DebateSettings())
    arc = Example("a", "arc", "Q?\nOptions:\nA) x\nB) y", "x", "choice", options=(("A", "x"), ("B", "y")))
    assert debate_prompts(arc, DebateSettings(context="split")) == debate_prompts(arc, DebateSettings())


def test_the_self_consistency_baselines_run_on_the_base_model(tmp_path):
    base = model_folder(tmp_path / "base")
    run = tmp_path / "run"
    ckpt = model_folder(run / "checkpoints" / "iteration_1", "w-trained")
    (run / "recipe.yaml").write_text(f"initial_model_path: {base}\n")
    with FakeOpenAIServer(respond=reply) as server:
        flags = ["--dataset_type", "arc", "--data_dir", str(write_arc_data(tmp_path / "data")), "--limit", "2"]
        flags += ["--set", f"endpoints=[{server.base_url}]", "--output_path", str(tmp_path / "sc")]
        argv = ["--model_path", str(ckpt), "--num_samples", "2", "--baseline", "cot", *flags]
        assert load_script("multi_sc_data_generate_script").main(argv) == 0
        assert server.reloads[-1] == str(base)  # the base model was loaded last: for CoT and CoT-SC
    out = tmp_path / "sc"
    assert read_producer(out / "iteration_1.sc.jsonl")["model"] == "w-trained"
    for method in ("cot", "cot_sc"):
        assert read_producer(out / f"base.{method}.jsonl")["model"] == model_identity(base)
        assert not (out / f"iteration_1.{method}.jsonl").exists()
    methods = json.loads((out / "sc_analysis.json").read_text())["models"]
    assert set(methods) == {"iteration_1", "base"} and set(methods["base"]) == {"cot", "cot_sc"}


def test_a_checkpoint_without_its_run_asks_for_the_base_model(tmp_path, capsys):
    ckpt = model_folder(tmp_path / "lonely", "w1")
    with FakeOpenAIServer(respond=reply) as server:
        argv = ["--model_path", str(ckpt), "--baseline", "cot", "--dataset_type", "arc", "--limit", "1"]
        argv += ["--data_dir", str(write_arc_data(tmp_path / "data")), "--set", f"endpoints=[{server.base_url}]"]
        assert load_script("multi_sc_data_generate_script").main(argv) == 2
    assert "--base_model_path" in capsys.readouterr().err


@pytest.mark.slow
def test_the_papers_table_on_the_demo_checkpoint(tmp_path):
    """``compare --tasks arc,gsm8k --limit 10`` with the real vLLM, the base model and the demo's checkpoint.

    Run with ``--basetemp DIR`` to keep its ``table.md`` (the README's methods x tasks table comes from it).
    """
    if not (DEMO_CHECKPOINT / COMPLETE_MARKER).is_file():
        reason = f"no demo checkpoint {DEMO_CHECKPOINT} (run `make demo` first)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    out = tmp_path / "table"
    argv = ["compare", "--model", str(SMOLLM2), "--tasks", "arc,gsm8k", "--limit", "10", "--output_path", str(out)]
    argv += ["--optima", f"Optima-iSFT={DEMO_CHECKPOINT}", "--optima_sc", "4"]
    # the demo's settings (256 tokens, 6 turns): the run stays in minutes
    argv += ["--data_dir", str(resolve_test_data_dir()), "--set", "max_tokens=256", "--set", "max_turns=6"]
    assert optima_main(argv) == 0
    wide = {r["method"]: r for r in csv.DictReader((out / "table.csv").open())}
    assert list(wide) == ["CoT", "CoT-SC", "MAD", "AutoForm", "Optima-iSFT", "Optima-iSFT SC"]
    for row in wide.values():
        for task in ("arc", "gsm8k"):
            assert 0.0 <= float(row[f"{task}_accuracy"]) <= 1.0 and float(row[f"{task}_tokens"]) > 0
            # the flexible answer is the strict one where there is one: never answered less often
            assert 0.0 <= float(row[f"{task}_accuracy_flexible"]) <= 1.0
            assert float(row[f"{task}_flexible_answer_rate"]) >= float(row[f"{task}_answer_rate"])
    assert (out / "table.md").read_text().startswith("| method | arc | gsm8k |")
    assert (out / "table.png").stat().st_size > 0


def test_the_cut_column_is_the_share_of_cut_replies_not_of_unanswered_records():
    """A MAD debate may have a cut reply and still answer: ``cut_rate`` counts it, ``too_long_rate`` does not."""
    from optima.evaluation.compare import wide_rows

    row = {"method": "MAD", "accuracy": 0.5, "mean_tokens": 80, "answer_rate": 1.0}
    wide = wide_rows({"arc": [row | {"cut_rate": 0.25, "too_long_rate": 0.0}]})
    assert wide[0]["arc_cut"] == 0.25
    assert wide_rows({"arc": [row | {"too_long_rate": 0.5}]})[0]["arc_cut"] == 0.5  # an older summary
