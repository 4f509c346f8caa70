"""Scoring while generating gives the same rewarded file as scoring afterwards, and resumes like it."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest

from optima.agents.generation import GenerationPlan, generate_conversations
from optima.loss_stream import StreamingLosses, load_known_losses
from optima.stages.reward_stage import reward_generations
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
        plan = GenerationPlan(0, 0.3, 3)
        generate_conversations(recipe, arc_examples(5), [server.base_url], out, plan, on_record=on_record)
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
    reward_generations(recipe, generations, tmp_path / "streamed.jsonl", refuse, known=known)

    after_loss = FakeLoss()
    reward_generations(recipe, generations, tmp_path / "after.jsonl", after_loss)
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
    reward_generations(recipe, generations, tmp_path / "rewarded.jsonl", loss, known=known)
    assert len(loss.texts) == sum(len(r["utterances"]) for r in records[4:])
    after = FakeLoss()
    reward_generations(recipe, generations, tmp_path / "after.jsonl", after)
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


def test_a_failed_request_fails_the_stage(tmp_path):
    recipe = sft_recipe(tmp_path)
    records = load_records(generate(tmp_path, recipe))[0]

    def broken(texts):
        raise ConnectionError("loss server gone")

    stream = StreamingLosses(broken, tmp_path / "losses.jsonl", "/models/base")
    with pytest.raises(ConnectionError, match="loss server gone"), stream:
        stream.submit(records[0])
        stream.finish()
