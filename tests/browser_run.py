"""A small iSFT-DPO run directory written by the real writers, for the conversation browser's tests.

``iteration_0/sft``: conversations generated against a scripted OpenAI server (``generate_conversations``), scored
(``reward_generations``, a fake LM-loss function), selected by the SFT select stage itself. ``iteration_0/dpo``: a
token probe (``generate_conversations``), tree searches over a scripted model (``search_question`` with the real
rollout scorer), pairs mined by ``save_pairs``. The script varies by question and sample: a right answer, a wrong
one, replies cut for length, and text that needs HTML escaping.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

from optima.agents.conversation import GenerationSettings
from optima.agents.generation import generate_conversations
from optima.config import SFTDPORecipe, load_recipe
from optima.loop import planned_parts
from optima.paths import RunPaths
from optima.reward import build_rollout_scorer
from optima.run import build_run, stage_settings
from optima.selection.dpo import save_pairs
from optima.selection.mcts import search_question
from optima.selection.tree import Reply
from optima.stages import RewardScorers, reward_generations, select
from optima.store import JsonlWriter
from tests.fake_openai import FakeOpenAIServer, FakeReply, question_of, speaker_of, turn_of
from tests.helpers import arc_examples
from tests.test_pipeline import TRAIN_ENV

REPO = Path(__file__).resolve().parent.parent
HOSTILE = 'Careful: <script>alert("x")</script> & 1 < 2'  # must reach the page escaped
QUESTIONS = 4


def scripted_reply(body: dict) -> FakeReply:
    """Question 0: both samples right; 1: right or wrong by sample; 2: always cut for length; 3: hostile text."""
    index = int(re.search(r"Question (\d+)", question_of(body)).group(1))
    right = index == 0 or (index in (1, 3) and body.get("seed", 0) % 2 == 0)
    if index == 2:
        return FakeReply("Alice: let me think " + "very " * 40, finish_reason="length", completion_tokens=32)
    if speaker_of(body) == "Bob":
        return FakeReply("Bob: " + (HOSTILE if index == 3 else "I agree, looks right"))
    answer = "<A>B</A>" if right else "<A>C</A>"
    return FakeReply(f"Alice: 2 + 2 = {4 if right else 5} so {answer}" + (" again" if turn_of(body) else ""))


def fake_losses(texts: list[str]) -> list[float]:
    """A deterministic stand-in for the LM loss (longer utterances cost more)."""
    return [1.0 + len(text) / 100 for text in texts]


def build_recipe(run: Path, port: int):
    overrides = {
        "output_dir": str(run),
        "initial_model_path": str(REPO / "models/SmolLM2-135M-Instruct"),
        "explore_count": 2,
        "max_turns": 4,
        "max_tokens": 32,
        "thread_count": 2,
        "port": port,
        "initial_epsilon": -10.0,
        "initial_dpo_epsilon": -10.0,
        "initial_dpo_min_value": 0.0,
        "dpo_keep_fraction": 0.5,
    }
    return load_recipe(SFTDPORecipe, REPO / "train/sft_dpo_recipes/arc.yaml", overrides, check_paths=False)


class TreeScript:
    """A seeded scripted model for the tree search: short replies, some answers, one hostile text."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def __call__(self, messages, speaker):
        answer = self.rng.choice(["", "<A>B</A>", "<A>C</A>"])
        text = self.rng.choice([f"idea {self.rng.randint(0, 3)}", HOSTILE])
        return Reply(f"{text} {answer}".strip(), self.rng.randint(5, 20))


def write_sft_stage(recipe, paths: RunPaths, url: str) -> None:
    sp = paths.stage(0, "sft")
    examples = arc_examples(QUESTIONS)
    generate_conversations(recipe, examples, [url], sp.generations, GenerationSettings(0, 1.0, 2))
    reward_generations(recipe, sp.generations, sp.rewarded, RewardScorers(score_texts=fake_losses))
    sft_part = planned_parts(build_run(recipe, {"train": TRAIN_ENV}, gpu=False))[0]  # iteration 0's SFT part
    assert sft_part.sp.root == sp.root
    select(sft_part, stage_settings(sft_part)["select"])


def write_dpo_stage(recipe, paths: RunPaths, url: str) -> None:
    sp = paths.stage(0, "dpo")
    examples = arc_examples(2)
    generate_conversations(recipe, examples, [url], sp.probe, GenerationSettings(0, 1.0, 1, stage="probe"))
    with JsonlWriter(sp.rollouts) as writer:
        for position, example in enumerate(examples):
            score = build_rollout_scorer(example, recipe, 60.0, fake_losses)
            result = search_question(example, TreeScript(position), score, recipe, random.Random(position))
            writer.write(result.to_dict() | {"sample_index": 0})
    from optima.store import load_records

    save_pairs(load_records(sp.rollouts)[0], recipe, sp.dataset, sp.selection_record, 0)


def build_browser_run(run: Path) -> Path:
    """Write the run directory ``run`` (iSFT-DPO, one iteration, no checkpoint) and return it."""
    with FakeOpenAIServer(scripted_reply) as server:
        recipe = build_recipe(run, server.port)
        paths = RunPaths(run)
        write_sft_stage(recipe, paths, server.base_url)
        write_dpo_stage(recipe, paths, server.base_url)
    return run
