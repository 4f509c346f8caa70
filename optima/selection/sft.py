"""iSFT selection: the best conversations become per-agent training rows (docs/method.md#isft-selection).

Per question the best finished conversation that copies no placeholder (ties: the lower sample index); questions
ranked by its reward (ties: by id), the `selection_range` slice kept, then those with reward >= epsilon; each
kept conversation gives Alice's and Bob's view under the base prompts. Every question gets a `selection.jsonl` line
saying why its best conversation was kept or not, and which rule dropped each other one.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from optima.agents.prompts import AGENT_NAMES, Utterance, build_agent_messages, compat_style
from optima.config.rules import selection_range
from optima.reward import placeholder_copies
from optima.tasks import Example

if TYPE_CHECKING:
    from optima.config import SFTLoopRecipe

logger = logging.getLogger(__name__)

KEPT = "kept"
BELOW_EPSILON = "below epsilon"
OUTSIDE_SLICE = "outside rank slice"
NOTHING_USABLE = "no usable conversation"
NOT_BEST = "not the question's best"
UNFINISHED = "unfinished (status {status})"  # cut for length, failed, or no utterance: never trained on
COPIES_PLACEHOLDER = "copies a placeholder"  # an answer copied from the prompt's answer slot: never trained on


@dataclass(frozen=True)
class Decision:
    """Selection's verdict on one question."""

    task_id: str
    best: dict | None
    rank: int | None
    reason: str
    dropped: dict[str, str] = field(default_factory=dict)  # the other conversations: sample index -> rule

    def to_record(self) -> dict:
        best = self.best or {}
        return {
            "task_id": self.task_id,
            "kept": self.reason == KEPT,
            "reason": self.reason,
            "rank": self.rank,
            "sample_index": best.get("sample_index"),
            "reward": best.get("reward"),
            "reward_parts": best.get("reward_parts"),
            "final_answer": best.get("final_answer"),
            "token_count": best.get("token_count"),
            "dropped": self.dropped,
        }


def is_usable(result: dict) -> bool:
    """Whether a rewarded conversation can be trained on: it ended ``ok``, has utterances and copies no placeholder."""
    return unusable_rule(result) is None


def unusable_rule(result: dict) -> str | None:
    """The rule that keeps a rewarded conversation out of training (None: it can be trained on)."""
    if result["status"] != "ok" or not result["utterances"]:
        return UNFINISHED.format(status=result["status"])
    return COPIES_PLACEHOLDER if placeholder_copies(result) else None


def best_conversation(line: dict) -> dict | None:
    """The highest-reward usable conversation of a rewarded question (None when there is none)."""
    usable = [r for r in line["results"] if is_usable(r)]
    if not usable:
        return None
    return max(usable, key=lambda r: (r["reward"], -r["sample_index"]))


def other_rules(line: dict, best: dict | None) -> dict[str, str]:
    """The rule that drops each conversation of a question other than `best` (sample index -> rule)."""
    rules = {}
    for r in line["results"]:
        if best is not None and r["sample_index"] == best["sample_index"]:
            continue
        rules[str(r["sample_index"])] = unusable_rule(r) or NOT_BEST
    return rules


def select_questions(lines: Sequence[dict], recipe: SFTLoopRecipe) -> list[Decision]:
    """Whether each rewarded question's best conversation is trained on, in question order whatever the order the
    lines were written in (timing decides it), so nothing trained on depends on it."""
    lines = sorted(lines, key=lambda line: str(line["task_id"]))
    best = [(str(line["task_id"]), best_conversation(line)) for line in lines]
    others = {task_id: other_rules(line, conv) for line, (task_id, conv) in zip(lines, best, strict=True)}
    ranked = sorted([b for b in best if b[1] is not None], key=lambda b: -b[1]["reward"])
    start, end = selection_range(recipe)
    lo, hi = int(start * len(ranked)), int(end * len(ranked))
    unusable = [task_id for task_id, conv in best if conv is None]
    decisions = {task_id: Decision(task_id, None, None, NOTHING_USABLE, others[task_id]) for task_id in unusable}
    for rank, (task_id, conv) in enumerate(ranked):
        if not lo <= rank < hi:
            reason = OUTSIDE_SLICE
        elif conv["reward"] < recipe.initial_epsilon:
            reason = BELOW_EPSILON
        else:
            reason = KEPT
        decisions[task_id] = Decision(task_id, conv, rank, reason, others[task_id])
    return [decisions[task_id] for task_id, _ in best]


def conversation_rows(record: dict, compat: str = "default") -> list[dict]:
    """Alice's and Bob's training rows of one conversation, under the base system prompts (`compat` style)."""
    example = Example.from_dict(record["example"])
    utterances = [Utterance(u["speaker"], u["text"]) for u in record["utterances"]]
    style = compat_style(compat, example.task, sft_rows=True)
    rows = []
    for speaker in AGENT_NAMES:
        if any(u.speaker == speaker for u in utterances):  # a view without own turns trains nothing
            rows.append(
                {
                    "messages": build_agent_messages(example, speaker, utterances, style=style),
                    "task_id": example.id,
                    "speaker": speaker,
                }
            )
    return rows


def split_rows(
    kept: Sequence[dict], train_fraction: float, seed: int, iteration: int, compat: str = "default"
) -> dict[str, list[dict]]:
    """A seeded shuffle of the kept conversations from (question, sample) order, split into train/test by
    conversation, expanded into per-agent rows."""
    order = sorted(kept, key=lambda r: (str(r["example"]["id"]), r.get("sample_index", 0)))
    random.Random(f"{seed}:sft-split:{iteration}").shuffle(order)
    n_test = int(round(len(order) * (1 - train_fraction)))
    if train_fraction < 1 and n_test == 0 and len(order) >= 4:
        n_test = 1  # keep an evaluation split once there is enough data for it
    test, train = order[:n_test], order[n_test:]
    return {
        "train": [row for r in train for row in conversation_rows(r, compat)],
        "test": [row for r in test for row in conversation_rows(r, compat)],
    }
