"""SmolLM2-135M-Instruct served by the real vLLM on CPU: iteration-0 conversations on ARC questions (slow)."""

from __future__ import annotations

import re

import pytest

from optima.agents.conversation import GenerationSettings
from optima.agents.generation import generate_conversations, generation_settings
from optima.agents.prompts import build_agent_messages
from optima.environments import resolve_env
from optima.paths import RunPaths
from optima.serving.client import ReplicaPool, Sampling, regex_constraint
from optima.serving.vllm_server import find_free_port, serve
from optima.store import load_records
from optima.tasks import TASKS
from optima.tasks.base import reply_pattern
from tests._task_fixtures import resolve_test_data_dir
from tests.conftest import SMOLLM2, requires_smollm2, requires_vllm
from tests.helpers import build_test_recipe

DATA_DIR = resolve_test_data_dir()

pytestmark = [pytest.mark.slow, requires_vllm, requires_smollm2]


@pytest.mark.skipif(not (DATA_DIR / "arc_challenge").is_dir(), reason="no local ARC data (OPTIMA_DATA_DIR)")
def test_smollm2_talks_about_four_arc_questions(tmp_path):
    recipe = build_test_recipe(
        tmp_path,
        initial_model_path=str(SMOLLM2),
        port=find_free_port("127.0.0.1", 27000),
        explore_count=2,
        max_turns=4,
        max_tokens=256,
        thread_count=8,
        request_timeout_s=300.0,
        server_startup_timeout_s=600.0,
        cpu_kvcache_space_gb=2,
    )
    examples = TASKS["arc"].load_train(data_dir=DATA_DIR)[:4]
    stage = RunPaths.from_recipe(recipe).stage(0)
    generation = generation_settings(
        recipe, iteration=0
    )  # T=0.3 and the format pool, as SFT data generation at iteration 0
    with serve(recipe, SMOLLM2, resolve_env(None, "vllm"), stage) as endpoints:
        stats = generate_conversations(recipe, examples, endpoints, stage.generations, generation)
    records, torn = load_records(stage.generations)
    assert not torn and len(records) == 8 and stats.written == 8
    assert {r["task_id"] for r in records} == {e.id for e in examples}
    assert all(r["status"] in ("ok", "too_long") for r in records)
    assert sum(len(r["utterances"]) for r in records) >= 8
    assert all(r["token_count"] == sum(u["tokens"] for u in r["utterances"]) for r in records)
    assert stats.tokens_per_s > 0


@pytest.mark.skipif(not (DATA_DIR / "arc_challenge").is_dir(), reason="no local ARC data (OPTIMA_DATA_DIR)")
def test_smollm2_constrained_answers_are_options_of_their_questions(tmp_path):
    """answer_bootstrap: grammar through vLLM's structured outputs (xgrammar on CPU): every answering turn names one
    of its question's options as the prompt asks, and the patterns of the other tasks compile and hold too."""
    recipe = build_test_recipe(
        tmp_path,
        initial_model_path=str(SMOLLM2),
        port=find_free_port("127.0.0.1", 27100),
        explore_count=2,
        max_turns=3,
        max_tokens=256,
        thread_count=8,
        request_timeout_s=300.0,
        server_startup_timeout_s=600.0,
        cpu_kvcache_space_gb=2,
    )
    examples = TASKS["arc"].load_train(data_dir=DATA_DIR)[:6]
    others = [TASKS[name].load_train(data_dir=DATA_DIR)[0] for name in ("gsm8k", "math", "hotpot_qa")]
    stage = RunPaths.from_recipe(recipe).stage(0)
    generation = GenerationSettings(0, 0.7, 2, answer_bootstrap="grammar")
    with serve(recipe, SMOLLM2, resolve_env(None, "vllm"), stage) as endpoints:
        generate_conversations(recipe, examples, endpoints, stage.generations, generation)
        pool = ReplicaPool(endpoints, recipe)
        try:
            replies = [(example, constrained_reply(pool, example, recipe.max_tokens)) for example in others]
        finally:
            pool.close()
    records, _ = load_records(stage.generations)
    assert len(records) == 12
    for record in records:
        options = {f"{label}) {text}" for label, text in record["example"]["options"]}
        turns = [i for i, u in enumerate(record["utterances"]) if u["speaker"] == "Alice"]
        assert record["constrained_turns"] == turns  # Alice's turns, and a constrained reply (bounded) is never cut
        for turn in turns:
            assert TASKS["arc"].parse_answer(record["utterances"][turn]["text"]) in options, record["utterances"]
    for example, text in replies:
        task = TASKS[example.task]
        assert re.fullmatch(reply_pattern(task, example, "Alice"), text) and task.parse_answer(text), text


def constrained_reply(pool: ReplicaPool, example, max_tokens: int) -> str:
    """The solver's (or information-exchange agent's) first reply to ``example`` under its answer constraint."""
    task = TASKS[example.task]
    messages = build_agent_messages(example, "Alice", [], task=task)
    extra = regex_constraint(reply_pattern(task, example, "Alice"))
    return pool.chat(0, messages, Sampling(0.0, max_tokens, 0, extra)).text
