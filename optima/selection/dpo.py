"""Preference pairs from the search trees, as a TRL conversational preference dataset (docs/method.md#mining-pairs).

Every minable node (still pooled or selected) with at least two children gives a pair of its best and worst child,
read from the children's current values, when `best > initial_dpo_epsilon` and `best - worst >
initial_dpo_min_value`; per question the top `dpo_keep_fraction` by chosen value are kept (at least one). A row is
the speaking agent's view: `prompt` is its chat up to the branch, `chosen` / `rejected` one assistant turn each.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from optima.agents.prompts import (
    DEFAULT_STYLE,
    RenderStyle,
    Utterance,
    build_agent_messages,
    compat_style,
    render_utterance,
)
from optima.store import save_splits, write_jsonl
from optima.tasks import Example

if TYPE_CHECKING:
    from optima.config import DPOLoopRecipe

logger = logging.getLogger(__name__)

PAIR_KEPT = "kept"
OUTSIDE_KEEP_FRACTION = "outside dpo_keep_fraction"  # passed the pair rule, not among the question's best pairs
META_COLUMNS = ("task_id", "node_id", "depth", "speaker", "chosen_value", "rejected_value")


def children_by_parent(nodes: Sequence[dict]) -> dict[int, list[dict]]:
    """The children of every node id, in creation order."""
    children: dict[int, list[dict]] = {node["id"]: [] for node in nodes}
    for node in sorted(nodes, key=lambda n: n["id"]):
        if node["parent"] is not None:
            children[node["parent"]].append(node)
    return children


def path_utterances(node: dict, by_id: dict[int, dict]) -> list[Utterance]:
    """The utterances from the root down to `node` included."""
    path = []
    while node["parent"] is not None:
        path.append(Utterance(node["speaker"], node["text"]))
        node = by_id[node["parent"]]
    return path[::-1]


def best_and_worst(children: Sequence[dict]) -> tuple[dict, dict]:
    """The highest- and the lowest-valued of at least two children (ties: the older child)."""
    if len(children) < 2:
        raise ValueError(f"a pair needs at least two children, got {len(children)}")
    ranked = sorted(children, key=lambda child: -child["value"])  # stable: ties keep creation order
    return ranked[0], ranked[-1]


def passes_pair_rule(best: float, worst: float, recipe: DPOLoopRecipe) -> bool:
    """The pair rule: `best > initial_dpo_epsilon` and `best - worst > initial_dpo_min_value`."""
    return best > recipe.initial_dpo_epsilon and best - worst > recipe.initial_dpo_min_value


def build_pair_row(
    example: Example,
    path: Sequence[Utterance],
    chosen: dict,
    rejected: dict,
    node: dict,
    style: RenderStyle = DEFAULT_STYLE,
) -> dict:
    """One preference row from the view of the agent who speaks after `node` (`path`: the utterances up to it)."""
    speaker = chosen["speaker"]
    return {
        "prompt": build_agent_messages(example, speaker, path, style=style),
        "chosen": [{"role": "assistant", "content": render_utterance((speaker, chosen["text"]))}],
        "rejected": [{"role": "assistant", "content": render_utterance((speaker, rejected["text"]))}],
        "task_id": example.id,
        "node_id": node["id"],
        "depth": node["depth"],
        "speaker": speaker,
        "chosen_value": chosen["value"],
        "rejected_value": rejected["value"],
    }


def candidate_pairs(line: dict, recipe: DPOLoopRecipe) -> list[dict]:
    """Every pair of one question's tree (its `SearchResult` line) that passes the rule, in node order."""
    example = Example.from_dict(line["example"])
    style = compat_style(recipe.compat, example.task)
    by_id = {node["id"]: node for node in line["nodes"]}
    children = children_by_parent(line["nodes"])
    pairs = []
    for node in sorted(line["nodes"], key=lambda n: n["id"]):
        kids = children[node["id"]]
        if not node.get("minable", True) or len(kids) < 2:
            continue
        best, worst = best_and_worst(kids)
        if passes_pair_rule(best["value"], worst["value"], recipe):
            pairs.append(build_pair_row(example, path_utterances(node, by_id), best, worst, node, style))
    return pairs


def keep_best_pairs(pairs: Sequence[dict], keep_fraction: float) -> list[dict]:
    """The top `keep_fraction` of one question's pairs by chosen value (at least one when there are any)."""
    if not pairs:
        return []
    ranked = sorted(pairs, key=lambda pair: -pair["chosen_value"])  # stable: ties keep node order
    return ranked[: max(1, int(keep_fraction * len(ranked)))]


def split_pairs(
    pairs_by_question: Sequence[Sequence[dict]], train_fraction: float, seed: int, iteration: int
) -> dict[str, list[dict]]:
    """A seeded shuffle of the questions (another each iteration), split into train/test by question."""
    # From question order, not the order the search finished them in: the split and the rows' order stay the same.
    groups = sorted((list(group) for group in pairs_by_question if group), key=lambda group: str(group[0]["task_id"]))
    random.Random(f"{seed}:dpo-split:{iteration}").shuffle(groups)
    n_test = int(round(len(groups) * (1 - train_fraction)))
    if train_fraction < 1 and n_test == 0 and len(groups) >= 4:
        n_test = 1  # keep an evaluation split once there is enough data for it
    return {
        "train": [pair for group in groups[n_test:] for pair in group],
        "test": [pair for group in groups[:n_test] for pair in group],
    }


def pair_verdict(pair: dict, kept: bool) -> dict:
    """A found pair's audit entry: its metadata, whether it was kept, and the rule that decided."""
    meta = {key: pair[key] for key in META_COLUMNS if key != "task_id"}
    return meta | {"kept": kept, "reason": PAIR_KEPT if kept else OUTSIDE_KEEP_FRACTION}


def pair_record(line: dict, found: Sequence[dict], kept: Sequence[dict]) -> dict:
    """The audit line of one question: tree size, branching nodes, and every pair found (kept or not, and why)."""
    kept_nodes = {pair["node_id"] for pair in kept}
    children = children_by_parent(line["nodes"])
    return {
        "task_id": line["task_id"],
        "nodes": len(line["nodes"]),
        "rollouts": len(line["rollouts"]),
        "branching_nodes": sum(1 for n in line["nodes"] if n.get("minable", True) and len(children[n["id"]]) >= 2),
        "pairs": [pair_verdict(pair, pair["node_id"] in kept_nodes) for pair in found],
    }


def save_pairs(
    lines: Sequence[dict], recipe: DPOLoopRecipe, dataset_path: Path, record_path: Path, iteration: int
) -> dict:
    """Mine, keep, split and save the pairs of every question (no dataset when none is kept), write the audit
    record (a line per question); return a summary."""
    records, kept_by_question, found_total = [], [], 0
    for line in lines:
        found = candidate_pairs(line, recipe)
        kept = keep_best_pairs(found, recipe.dpo_keep_fraction)
        records.append(pair_record(line, found, kept))
        kept_by_question.append(kept)
        found_total += len(found)
    write_jsonl(records, record_path)
    kept_total = sum(len(kept) for kept in kept_by_question)
    rows = {}
    if kept_total:
        splits = split_pairs(kept_by_question, recipe.dpo_train_fraction, recipe.seed, iteration)
        rows = save_splits(splits, Path(dataset_path))
    logger.info("pairs | %d questions | %d pairs found | %d kept | rows %s", len(lines), found_total, kept_total, rows)
    return {
        "questions": len(lines),
        "questions_with_pairs": sum(1 for kept in kept_by_question if kept),
        "pairs_found": found_total,
        "pairs_kept": kept_total,
        "rows": rows,
    }
