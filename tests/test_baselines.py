"""The MAD and AutoForm baselines and ``python -m optima compare`` against scripted servers (no vLLM).

The debate's rounds, revision prompts, majority and token counts are checked on the pure loop (``run_debate``) and
through the fake OpenAI server; AutoForm's prompts on the rendered system prompts and on the requests sent; the
comparison end to end (files, rows, plot, resume). The same command on the real vLLM is in ``test_compare_vllm.py``.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from optima.__main__ import main as optima_main
from optima.agents.conversation import GenerationSettings
from optima.config import MultiSCRecipe, RecipeError
from optima.evaluation.baselines import (
    AUTOFORM_RULE,
    DebateSettings,
    autoform_prompts,
    generate_autoform,
    generate_debates,
    run_debate,
)
from optima.evaluation.metrics import AnswerMatcher, majority_answer
from optima.serving.client import ChatReply, RequestFailed
from optima.store import load_records
from optima.tasks import Example
from tests.fake_openai import FakeOpenAIServer, FakeReply, agreeing_reply
from tests.test_eval_runs import detach_driver_logs, write_arc_data  # noqa: F401  (fixture)
from tests.test_scripts import load_script

ARC = Example(
    "arc-q",
    "arc",
    "What is 2 + 2?\nOptions:\nA) 3\nB) 4\nC) 5",
    "4",
    "choice",
    options=(("A", "3"), ("B", "4"), ("C", "5")),
)


class ScriptedDebaters:
    """``generate`` for ``run_debate``: agent i's reply in round r is ``script[r][i]``; records every call."""

    def __init__(self, script: list[list[str]], tokens: int = 5, finish: str = "stop"):
        self.script, self.tokens, self.finish = script, tokens, finish
        self.calls: list[tuple[list[dict], int, int]] = []

    def __call__(self, messages: list[dict], agent: int, round_index: int) -> ChatReply:
        self.calls.append((messages, agent, round_index))
        return ChatReply(self.script[round_index][agent], self.finish, self.tokens + agent, 0)


def debate(script, settings, **kwargs):
    generate = ScriptedDebaters(script, **kwargs)
    result = run_debate(ARC, generate, settings, max_tokens=64, matcher=AnswerMatcher(ARC))
    return result, generate


def test_debate_runs_every_agent_each_round_and_shows_the_others_answers():
    script = [["<A>A) 3</A>", "<A>B) 4</A>"], ["still <A>A) 3</A>", "<A>B) 4</A>"], ["<A>B) 4</A>", "<A>B) 4</A>"]]
    result, generate = debate(script, DebateSettings(agents=2, rounds=2))
    assert [(agent, r) for _, agent, r in generate.calls] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    # Round 0: the single-agent CoT chat. Later rounds: own answers as assistant turns, the other's in a user turn.
    first, _, _ = generate.calls[0]
    assert [m["role"] for m in first] == ["system", "user"] and first[0]["content"].startswith("You answer")
    last_of_agent_0, _, _ = generate.calls[4]
    assert [m["role"] for m in last_of_agent_0] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert last_of_agent_0[2]["content"] == "<A>A) 3</A>" and "Agent 2: <A>B) 4</A>" in last_of_agent_0[3]["content"]
    assert "Agent 1" not in last_of_agent_0[3]["content"]  # an agent is not shown its own answer as another's
    assert "Agent 2: <A>B) 4</A>" in last_of_agent_0[5]["content"]
    # Six replies, each agent's tokens as the server counted them (5 and 6): 3 * 5 + 3 * 6.
    assert len(result.utterances) == 6 and result.token_count == 33
    assert [u.speaker for u in result.utterances[:2]] == ["Agent 1", "Agent 2"]
    assert result.agent_tokens()["Agent 2"] == 18
    assert result.status == "ok" and result.stop_reason == "majority" and result.final_answer == "B) 4"


def test_debate_majority_uses_the_last_round_only_and_ties_go_to_the_first_agent():
    three = DebateSettings(agents=3, rounds=1)
    script = [["<A>B) 4</A>"] * 3, ["<A>A) 3</A>", "<A>C) 5</A>", "<A>C) 5</A>"]]
    result, generate = debate(script, three)
    assert result.final_answer == "C) 5" and len(generate.calls) == 6
    tie = [["x", "y"], ["<A>A) 3</A>", "<A>B) 4</A>"]]
    assert debate(tie, DebateSettings(2, 1))[0].final_answer == "A) 3"
    # The same option written as its letter or its text votes together (the task's matcher).
    matcher = AnswerMatcher(ARC)
    assert majority_answer(["B", "A) 3", "4"], matcher) == "B" and majority_answer([None, None], matcher) == ""


def test_debate_without_a_last_answer_because_of_length_is_too_long():
    script = [["<A>B) 4</A>", "<A>B) 4</A>"], ["cut off", "cut off"]]
    generate = ScriptedDebaters(script)
    result = run_debate(ARC, generate, DebateSettings(2, 1), max_tokens=5, matcher=AnswerMatcher(ARC))
    assert result.status == "too_long" and result.final_answer == "" and result.token_count == 22
    assert result.cut_replies == 4  # 5 and 6 tokens: every reply reached max_tokens=5, and all of them count


def test_a_debate_with_a_cut_reply_still_answers_and_says_it_was_cut():
    script = [["<A>B) 4</A>", "<A>B) 4</A>"], ["<A>B) 4</A>", "cut off"]]
    # Agent 1 writes 6 tokens per reply: cut at max_tokens=6 in both rounds; agent 0 (5 tokens) is not.
    result = run_debate(ARC, ScriptedDebaters(script), DebateSettings(2, 1), 6, AnswerMatcher(ARC))
    assert result.status == "ok" and result.final_answer == "B) 4"
    assert result.cut_replies == 2 and result.token_count == 22


def test_debate_request_failure_is_an_error_record():
    def failing(messages, agent, round_index):
        if round_index == 1:
            raise RequestFailed("server gone")
        return ChatReply("<A>B) 4</A>", "stop", 3, 0)

    result = run_debate(ARC, failing, DebateSettings(), max_tokens=64, matcher=AnswerMatcher(ARC))
    assert result.status == "error" and "server gone" in result.error


@pytest.mark.parametrize(("agents", "rounds"), [(1, 2), (2, 0)])
def test_debate_settings_are_checked(agents, rounds):
    with pytest.raises(RecipeError, match="mad_"):
        DebateSettings(agents, rounds)


def eval_recipe(tmp_path: Path, server: FakeOpenAIServer, **values) -> MultiSCRecipe:
    data = write_arc_data(tmp_path / "data")
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    fields = {"model_root_path": str(model), "dataset_type": "arc", "data_dir": str(data), "limit": 2}
    return MultiSCRecipe(**fields, endpoints=[server.base_url], **values)


def debating_reply(body: dict) -> FakeReply:
    """First answers differ by the system prompt's position in the debate; revisions converge on B."""
    last = body["messages"][-1]["content"]
    if last.startswith("The other agents answered"):
        return FakeReply("agreed: 2 + 2 = 4 <A>B) 4</A>")
    return FakeReply("guess <A>A) 3</A>" if body["seed"] % 2 else "sum <A>B) 4</A>")


def test_debates_through_the_fake_server_record_every_reply_and_its_tokens(tmp_path):
    with FakeOpenAIServer(respond=debating_reply) as server:
        recipe = eval_recipe(tmp_path, server)
        from optima.evaluation.runs import load_eval_examples

        examples = load_eval_examples(recipe)
        out = tmp_path / "mad.jsonl"
        generation = GenerationSettings(-1, 0.7, 1, stage="mad")
        stats = generate_debates(recipe, examples, [server.base_url], out, generation, DebateSettings(2, 2))
        bodies = server.bodies()
    assert stats.written == 2 and len(bodies) == 2 * 2 * 3
    assert {b["temperature"] for b in bodies} == {0.7} and len({b["seed"] for b in bodies}) == len(bodies)
    records, _ = load_records(out)
    for record in records:
        assert record["status"] == "ok" and record["final_answer"] == "B) 4" and len(record["utterances"]) == 6
        # token_count: the server's completion tokens (one per word here) of all six replies.
        words = sum(len(u["text"].split()) for u in record["utterances"])
        assert record["token_count"] == words == sum(u["tokens"] for u in record["utterances"])
        shape = {"agents": 2, "rounds": 2, "context": "whole", "final_cut": [False, False]}
        assert record["debate"] == shape and record["stage"] == "mad"
    # Rerun: complete, nothing sent.
    with FakeOpenAIServer(respond=debating_reply) as again:
        generate_debates(recipe, examples, [again.base_url], out, generation, DebateSettings(2, 2))
        assert again.requests == []


def test_autoform_prompts_add_the_format_rule_to_the_conversation():
    alice, bob = autoform_prompts("arc")
    assert alice.startswith("You are Alice") and bob.startswith("You are Bob")
    assert "not write in natural language" in alice and "what Bob needs" in alice and "what Alice needs" in bob
    assert "${" not in alice + bob and AUTOFORM_RULE.split(".")[0] in bob
    # The base rules (answer format, critic never answering) stay.
    assert "<A>" in alice and "Never state the final answer" in bob


def test_autoform_conversations_send_the_autoform_prompts(tmp_path):
    with FakeOpenAIServer(respond=agreeing_reply) as server:
        recipe = eval_recipe(tmp_path, server)
        from optima.evaluation.runs import load_eval_examples

        out = tmp_path / "autoform.jsonl"
        generate_autoform(recipe, load_eval_examples(recipe), [server.base_url], out, GenerationSettings(-1, 0.0, 1))
        bodies = server.bodies()
    assert len(bodies) == 6  # two conversations of three utterances: the ordinary loop and stop rule
    assert all("not write in natural language" in b["messages"][0]["content"] for b in bodies)
    records, _ = load_records(out)
    assert all(r["final_answer"] == "B" and "not write" in r["system_prompts"]["Bob"] for r in records)


def method_reply(body: dict) -> FakeReply:
    """CoT answers B; debaters revise to B; two-agent conversations (Optima, AutoForm) agree on B."""
    first = body["messages"][0]["content"]
    if first.startswith("You answer"):
        return FakeReply("2 + 2 = 4, option B. <A>B) 4</A>")
    return agreeing_reply(body)


def test_compare_writes_one_table_plot_and_csv_and_resumes(tmp_path, capsys):
    checkpoint = tmp_path / "iteration_1"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    out = tmp_path / "cmp"
    with FakeOpenAIServer(respond=method_reply) as server:
        data = write_arc_data(tmp_path / "data")
        argv = ["compare", "--model", str(tmp_path / "base"), "--dataset_type", "arc", "--limit", "4"]
        argv += ["--data_dir", str(data), "--output_path", str(out), "--samples", "3"]
        argv += ["--optima", f"Optima-iSFT={checkpoint}", "--set", f"endpoints=[{server.base_url}]"]
        (tmp_path / "base").mkdir()
        assert optima_main(argv) == 0
        sent = len(server.requests)
        # 4 questions: CoT 1 + CoT-SC 3 answers, MAD 3 agents x 3 replies, AutoForm and Optima 3 utterances each.
        assert sent == 4 * (1 + 3 + 9 + 3 + 3)
        assert optima_main(argv) == 0  # every file complete: nothing sent again
        assert len(server.requests) == sent
    table = capsys.readouterr().out
    for label in ("CoT", "CoT-SC", "MAD", "AutoForm", "Optima-iSFT"):
        assert label in table
    rows = {row["method"]: row for row in csv.DictReader((out / "comparison.csv").open())}
    assert list(rows) == ["CoT", "CoT-SC", "MAD", "AutoForm", "Optima-iSFT"]
    assert rows["Optima-iSFT"]["model"] == "iteration_1" and rows["CoT"]["model"] == "base"
    # ARC rows: "B) 4" is right for half of the questions; CoT-SC costs its three answers' tokens.
    assert float(rows["CoT"]["accuracy"]) == 0.5 and float(rows["CoT"]["answer_rate"]) == 1.0
    assert float(rows["CoT-SC"]["mean_tokens"]) == 3 * float(rows["CoT"]["mean_tokens"])
    assert float(rows["MAD"]["mean_tokens"]) == 9 * float(rows["CoT"]["mean_tokens"])
    summary = json.loads((out / "comparison.json").read_text())
    assert summary["metric"] == "accuracy" and summary["settings"]["samples"] == 3 and summary["questions"] == 4
    assert (out / "comparison.md").read_text().startswith("| method | model | questions | accuracy |")
    assert (out / "comparison.png").read_bytes()[:4] == b"\x89PNG"
    for name in ("base.cot", "base.cot_sc", "base.mad", "base.autoform", "Optima-iSFT.optima"):
        assert (out / f"{name}.jsonl").is_file()
    page = (out / "conversations.html").read_text()  # every answer behind the table, one section per file
    for title in ("CoT · base", "CoT-SC · base", "MAD · base", "AutoForm · base", "Optima · Optima-iSFT"):
        assert f"<h2>{title}</h2>" in page


def test_compare_rejects_a_bad_optima_row(tmp_path, capsys):
    argv = ["compare", "--model", str(tmp_path), "--dataset_type", "arc", "--optima", "nameless", "--dry-run"]
    assert optima_main(argv) == 2
    assert "expected [TASK:]NAME=CHECKPOINT" in capsys.readouterr().err
    argv[-2] = f"X={tmp_path / 'missing'}"
    assert optima_main(argv) == 2
    assert "not a model folder" in capsys.readouterr().err


def test_both_eval_scripts_run_the_new_baselines(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with FakeOpenAIServer(respond=method_reply) as server:
        flags = ["--dataset_type", "arc", "--data_dir", str(write_arc_data(tmp_path / "data")), "--limit", "2"]
        flags += ["--set", f"endpoints=[{server.base_url}]", "--baseline", "mad", "--baseline", "autoform"]
        sc = ["--model_path", str(model), "--num_samples", "2", "--output_path", str(tmp_path / "sc"), *flags]
        assert load_script("multi_sc_data_generate_script").main(sc) == 0
        sweep = ["--model_root_path", str(model), "--output_root_path", str(tmp_path / "sweep"), *flags]
        assert load_script("inference_script").main(sweep) == 0
    methods = json.loads((tmp_path / "sc" / "sc_analysis.json").read_text())["models"]["model"]
    assert set(methods) == {"optima_sc", "mad", "autoform_sc"} and methods["mad"]["questions"] == 2
    assert [row["k"] for row in methods["autoform_sc"]] == [1, 2]
    rows = list(csv.DictReader((tmp_path / "sweep" / "comparison.csv").open()))
    assert [r["method"] for r in rows] == ["Optima", "MAD", "AutoForm"] and (
        tmp_path / "sweep" / "comparison.png"
    ).is_file()
    assert len(load_records(tmp_path / "sweep" / "model.mad.jsonl")[0]) == 2


def test_compare_dry_run_lists_every_row_and_starts_nothing(tmp_path, capsys):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    argv = ["compare", "--model", str(tmp_path), "--dataset_type", "arc", "--methods", "cot", "mad"]
    argv += ["--optima", f"Optima-iDPO={checkpoint}", "--output_path", str(tmp_path / "out"), "--dry-run"]
    assert optima_main(argv) == 0
    plan = capsys.readouterr().out
    assert "[CoT] serve" in plan and "[MAD] serve" in plan and "[Optima-iDPO] serve" in plan
    assert "[CoT-SC]" not in plan and "MAD: 3 agents, 2 rounds" in plan
    assert not (tmp_path / "out").exists()


def test_compare_with_methods_none_runs_only_the_optima_rows(tmp_path, capsys):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    argv = ["compare", "--model", str(tmp_path), "--dataset_type", "arc", "--methods", "none"]
    argv += ["--optima", f"Optima-iSFT-DPO={checkpoint}", "--output_path", str(tmp_path / "out"), "--dry-run"]
    assert optima_main(argv) == 0
    plan = capsys.readouterr().out
    assert "[Optima-iSFT-DPO] serve" in plan
    assert not [label for label in ("[CoT]", "[CoT-SC]", "[MAD]", "[AutoForm]") if label in plan]


def cut_reply(body: dict) -> FakeReply:
    """Every reply runs into max_tokens: CoT and MAD replies are cut, two-agent conversations end at once."""
    return FakeReply("a long derivation that never ends", finish_reason="length", completion_tokens=7)


def test_cut_replies_cost_their_tokens_in_every_method_and_table(tmp_path):
    """One token rule (docs/method.md#token-count): a cut reply counts; the tables show the cut share beside it."""
    out = tmp_path / "cmp"
    (tmp_path / "base").mkdir()
    with FakeOpenAIServer(respond=cut_reply) as server:
        data = write_arc_data(tmp_path / "data")
        argv = ["compare", "--model", str(tmp_path / "base"), "--dataset_type", "arc", "--limit", "2"]
        argv += ["--data_dir", str(data), "--output_path", str(out), "--samples", "2"]
        argv += ["--set", f"endpoints=[{server.base_url}]"]
        assert optima_main(argv) == 0
    rows = {row["method"]: row for row in csv.DictReader((out / "comparison.csv").open())}
    # CoT: one cut reply (7 tokens); CoT-SC: two; MAD: 3 agents x 3 rounds (the paper default), all cut;
    # AutoForm: Alice's first reply.
    expected = {"CoT": 7, "CoT-SC": 14, "MAD": 63, "AutoForm": 7}
    assert {method: float(row["mean_tokens"]) for method, row in rows.items()} == expected
    assert {float(row["cut_rate"]) for row in rows.values()} == {1.0}
    assert {float(row["answer_rate"]) for row in rows.values()} == {0.0}
    assert "cut_rate" in (out / "comparison.md").read_text().splitlines()[0]
    for name in ("base.cot", "base.cot_sc", "base.mad", "base.autoform"):
        for record in load_records(out / f"{name}.jsonl")[0]:
            assert record["cut_replies"] >= 1 and record["token_count"] == 7 * record["cut_replies"]
