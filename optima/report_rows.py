"""One report row per stage folder of a run: the numbers of its ``metrics.json`` that reports and cards show.

``optima.reporting`` draws ``report.md``/``report.png`` from these rows, ``optima.tracking`` sends them to the
trackers, and ``optima.hub`` puts one in each checkpoint's model card: the row is built here once, from the file
alone.
"""

from __future__ import annotations

from optima.methods import DPO, SFT

PART_NAMES = ("task_score", "token_term", "loss_term", "penalty", "reward")
STAGE_ORDER = ("generate", "score", "select", "probe", "search", "pairs", "train")


def build_row(iteration: int, stage: str, metrics: dict) -> dict:
    """One report row from one ``metrics.json``: headline numbers, reward parts, pairs, loss and stage times.

    Args:
        iteration: The iteration number.
        stage: ``sft``/``dpo`` inside an iSFT-DPO iteration, else empty.
        metrics: The parsed ``metrics.json``.
    """
    stages = metrics.get("stages", {})
    kind = DPO if "search" in stages or "probe" in stages or "pairs" in stages else SFT
    conversations = stages.get("score") or stages.get("search") or {}
    train = stages.get("train") or {}
    timings = metrics.get("timings_s", {})
    row = {
        "label": f"{iteration + 1}" + (f" {stage}" if stage else ""),  # counted from 1, as the logs count them
        "iteration": iteration,
        "stage": stage,
        "kind": kind,
        "answer_rate": conversations.get("answer_rate"),
        "task_score": conversations.get("accuracy"),
        # The answer named in words where the format is missing (optima.tasks.flexible; older runs: not recorded).
        "flexible_answer_rate": conversations.get("flexible_answer_rate"),
        "flexible_score": conversations.get("flexible_accuracy"),
        "mean_tokens": conversations.get("mean_tokens"),
        "cut_rate": conversations.get("cut_rate"),  # share cut for length (older runs: not recorded)
        "placeholder_copies": conversations.get("placeholder_copies"),  # conversations copying a placeholder
        # MATH: symbolic checks that timed out twice, scored 0 (``MathVerifier.timeouts``); other tasks: no key.
        **({"verifier_timeouts": conversations["verifier_timeouts"]} if "verifier_timeouts" in conversations else {}),
        "conversations": conversations.get("conversations", conversations.get("rollouts")),
        "train_loss": train.get("train_loss"),
        "train_rows": train.get("train_rows"),
        "total_s": round(sum(timings.values()), 1) if timings else None,
    }
    row |= {f"part_{name}": (conversations.get("mean_reward_parts") or {}).get(name) for name in PART_NAMES}
    row |= {f"time_{name}": timings.get(name) for name in STAGE_ORDER}
    if kind == SFT:
        row["kept"] = (stages.get("select") or {}).get("kept_conversations")
    else:
        pairs, probe = stages.get("pairs") or {}, stages.get("probe") or {}
        row |= {
            "kept": pairs.get("pairs_kept"),
            "pairs_found": pairs.get("pairs_found"),
            "pairs_kept": pairs.get("pairs_kept"),
            "questions_with_pairs": pairs.get("questions_with_pairs"),
            "search_questions": conversations.get("questions"),
            "failed_rollouts": conversations.get("failed_rollouts"),  # left out of the trees' values
            "failed_requests": conversations.get("failed_requests"),
            "t_max": probe.get("t_max", conversations.get("t_max")),
            "probe_conversations": probe.get("conversations"),
        }
    return row
