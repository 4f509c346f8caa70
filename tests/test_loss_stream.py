"""Scoring while generating gives the same rewarded file as scoring afterwards, and resumes like it."""

from __future__ import annotations

import hashlib
import json
import math
import threading
from pathlib import Path

import pytest

from optima.agents.conversation import GenerationSettings
from optima.agents.generation import GenerationHooks, generate_conversations
from optima.lm_loss import StreamingLosses, conversation_texts, load_known_losses, texts_sha1
from optima.stages import RewardScorers, reward_generations
from optima.store import load_records
from tests.fake_openai import FakeOpenAIServer
from tests.helpers import arc_examples
from tests.test_layout import sft_recipe


class FakeLoss:
    """A deterministic LM loss per text, counting the texts it was asked for (from any thread)."""

    def __init__(self):
        self.texts: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, texts):
        with self.lock:
            self.texts.extend(texts)
        return [1.0 + int(hashlib.sha1(t.encode()).hexdigest()[:6], 16) / 2**24 for t in texts]


def refuse(texts):
    raise AssertionError(f"nothing should be left to score, got {len(texts)} texts")


def generate(tmp_path: Path, recipe, on_record=None) -> Path:
    out = tmp_path / "generations.jsonl"
    with FakeOpenAIServer() as server:
        generation = GenerationSettings(0, 0.3, 3)
        generate_conversations(
            recipe, arc_examples(5), [server.base_url], out, generation, GenerationHooks(on_record=on_record)
        )
    return out


def rewarded(path: Path) -> dict:
    return {line["task_id"]: line for line in load_records(path)[0]}


def without_numbers(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in ("reward", "losses", "reward_parts")}


def assert_same_rewarded(streamed: dict, after: dict) -> None:
    assert streamed.keys() == after.keys()
    for task_id, line in after.items():
        other = streamed[task_id]
        assert other["t_max"] == line["t_max"]
        for a, b in zip(other["results"], line["results"], strict=True):
            assert without_numbers(a) == without_numbers(b)
            assert a["reward"] == pytest.approx(b["reward"], abs=1e-6)
            assert a["losses"] == pytest.approx(b["losses"], abs=1e-6)
            assert a["reward_parts"] == pytest.approx(b["reward_parts"], abs=1e-6)


def test_scoring_while_generating_matches_scoring_after(tmp_path):
    recipe = sft_recipe(tmp_path, thread_count=4, max_turns=4)
    streamed_loss = FakeLoss()
    with StreamingLosses(streamed_loss, tmp_path / "losses.jsonl", "/models/base") as stream:
        generations = generate(tmp_path, recipe, stream.submit)
        summary = stream.finish()
    assert summary["scored"] == 15 and summary["reused"] == 0
    known = load_known_losses(tmp_path / "losses.jsonl", "/models/base")
    reward_generations(recipe, generations, tmp_path / "streamed.jsonl", RewardScorers(refuse, known))

    after_loss = FakeLoss()
    reward_generations(recipe, generations, tmp_path / "after.jsonl", RewardScorers(after_loss))
    assert sorted(after_loss.texts) == sorted(streamed_loss.texts)  # the same utterances, each scored once
    assert_same_rewarded(rewarded(tmp_path / "streamed.jsonl"), rewarded(tmp_path / "after.jsonl"))


def test_missing_stale_and_foreign_losses_are_scored_again(tmp_path):
    recipe = sft_recipe(tmp_path)
    generations = generate(tmp_path, recipe)
    records = load_records(generations)[0]
    losses = tmp_path / "losses.jsonl"
    with StreamingLosses(FakeLoss(), losses, "/models/base") as stream:
        for record in records[:4]:
            stream.submit(record)
        stream.finish()
    with StreamingLosses(FakeLoss(), losses, "/models/other") as stream:
        stream.submit(records[4])  # another loss model: never reused for /models/base
        stream.finish()
    # A conversation regenerated after its losses were stored (e.g. an error retried) must not reuse them.
    lines = losses.read_text().splitlines()
    changed = records[1] | {"utterances": [u | {"text": u["text"] + "!"} for u in records[1]["utterances"]]}
    known = load_known_losses(losses, "/models/base")
    assert known(records[0]) is not None and known(changed) is None and known(records[4]) is None
    assert len(lines) == 5

    loss = FakeLoss()
    reward_generations(recipe, generations, tmp_path / "rewarded.jsonl", RewardScorers(loss, known))
    assert len(loss.texts) == sum(len(r["utterances"]) for r in records[4:])
    after = FakeLoss()
    reward_generations(recipe, generations, tmp_path / "after.jsonl", RewardScorers(after))
    assert_same_rewarded(rewarded(tmp_path / "rewarded.jsonl"), rewarded(tmp_path / "after.jsonl"))


def test_a_torn_losses_file_resumes_and_stored_losses_are_not_sent_again(tmp_path):
    recipe = sft_recipe(tmp_path)
    records = load_records(generate(tmp_path, recipe))[0]
    losses = tmp_path / "losses.jsonl"
    with StreamingLosses(FakeLoss(), losses, "/models/base") as stream:
        for record in records[:3]:
            stream.submit(record)
        stream.finish()
    with open(losses, "a") as f:
        f.write('{"task_id": "q9", "sampl')  # killed mid-write
    loss = FakeLoss()
    with StreamingLosses(loss, losses, "/models/base") as stream:
        for record in records:
            stream.submit(record)
        summary = stream.finish()
    assert summary["reused"] == 3 and summary["scored"] == len(records) - 3
    assert len(load_records(losses)[0]) == len(records)


def loss_line(record: dict, losses, model: str = "/models/base", sha1: str | None = None) -> str:
    texts = conversation_texts(record)
    line = {"task_id": record["task_id"], "sample_index": record["sample_index"], "loss_model": model}
    return json.dumps(line | {"texts_sha1": sha1 or texts_sha1(texts), "losses": losses}) + "\n"


def test_the_last_valid_line_wins_at_load_and_at_resume(tmp_path):
    record = load_records(generate(tmp_path, sft_recipe(tmp_path)))[0][0]
    n = len(record["utterances"])
    losses = tmp_path / "losses.jsonl"
    losses.write_text(
        loss_line(record, [1.0] * n)  # superseded by the next line
        + loss_line(record, [2.0] * n)
        + loss_line(record, "broken")  # invalid: never wins
        + loss_line(record, [9.0] * n, model="/models/other")  # another loss model: its own line
    )
    assert load_known_losses(losses, "/models/base")(record) == [2.0] * n  # load
    loss = FakeLoss()
    with StreamingLosses(loss, losses, "/models/base") as stream:  # resume
        stream.submit(record)
        summary = stream.finish()
    assert summary["reused"] == 1 and not loss.texts
    lines = [json.loads(line) for line in losses.read_text().splitlines()]
    assert [(line["loss_model"], line["losses"]) for line in lines] == [("/models/base", [2.0] * n),
                                                                       ("/models/other", [9.0] * n)]  # fmt: skip


def test_only_finished_conversations_are_streamed(tmp_path):
    records = load_records(generate(tmp_path, sft_recipe(tmp_path)))[0]
    failed, cut = records[0] | {"status": "error"}, records[1] | {"status": "too_long"}
    loss = FakeLoss()
    losses = tmp_path / "losses.jsonl"
    with StreamingLosses(loss, losses, "/models/base") as stream:
        for record in (failed, cut, records[2]):
            stream.submit(record)
        summary = stream.finish()
    assert summary == summary | {"scored": 1, "skipped": 2, "failed": 0}
    assert [json.loads(line)["task_id"] for line in losses.read_text().splitlines()] == [records[2]["task_id"]]
    assert loss.texts == conversation_texts(records[2])


def test_a_nan_loss_is_stored_as_json_null(tmp_path):
    record = load_records(generate(tmp_path, sft_recipe(tmp_path)))[0][0]
    n = len(record["utterances"])
    losses = tmp_path / "losses.jsonl"
    with StreamingLosses(lambda texts: [math.nan] + [1.5] * (len(texts) - 1), losses, "/models/base") as stream:
        stream.submit(record)
        stream.finish()

    def refuse_constant(name):
        raise AssertionError(f"{name} is not JSON")

    line = json.loads(losses.read_text(), parse_constant=refuse_constant)
    assert line["losses"] == [None] + [1.5] * (n - 1)
    read = load_known_losses(losses, "/models/base")(record)
    assert math.isnan(read[0]) and read[1:] == [1.5] * (n - 1)


def test_a_failed_request_is_logged_and_left_to_the_score_stage(tmp_path, caplog):
    recipe = sft_recipe(tmp_path)
    generations = generate(tmp_path, recipe)
    records = load_records(generations)[0]
    calls = []

    def flaky(texts):
        calls.append(texts)
        if len(calls) == 1:
            raise ConnectionError("loss server gone")
        return FakeLoss()(texts)

    losses = tmp_path / "losses.jsonl"
    with StreamingLosses(flaky, losses, "/models/base", workers=1) as stream:
        for record in records[:2]:
            stream.submit(record)
        summary = stream.finish()  # does not raise: generation is done and kept
    assert summary["failed"] == 1 and summary["scored"] == 1
    assert "loss server gone" in caplog.text
    assert len(losses.read_text().splitlines()) == 1  # the failure is not written
    known = load_known_losses(losses, "/models/base")
    after = FakeLoss()
    reward_generations(recipe, generations, tmp_path / "rewarded.jsonl", RewardScorers(after, known))
    scored_later = [r for r in records if r["status"] == "ok" and known(r) is None]
    assert len(after.texts) == sum(len(r["utterances"]) for r in scored_later)
    assert records[0] in scored_later or records[1] in scored_later
