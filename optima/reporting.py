"""A run's report: `report.md` and `report.png` in its run directory, redrawn after every iteration.

One row per stage folder, from its `metrics.json` alone (`build_row`; the trackers and the model cards show the
same rows): answer rate, task score (strict and flexible), mean tokens beside the share cut for length, reward
parts, kept, DPO pairs and rollouts, train loss and stage times, the most frequent final answers (a copied
answer shows at a glance), and the held-out table. `python -m optima report RUN_DIR` redraws it from the files.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import yaml

from optima.browser import collect_sections, sample_conversations, write_conversations_page
from optima.evaluation.metrics import with_timeouts
from optima.evaluation.tables import new_figure, render_heldout_table, render_markdown_table
from optima.lineage import lineage_folders, read_entries
from optima.methods import DPO, SFT, method_of_trainers
from optima.paths import PAGE, StagePaths
from optima.store import atomic_write_text, load_records
from optima.tasks.scoring import reparsed
from optima.tracking import log_rows, write_tensorboard_scalars

logger = logging.getLogger(__name__)

REPORT_MD = "report.md"
REPORT_PNG = "report.png"
HELDOUT_SUMMARY = Path("heldout") / "summary.json"
TOP_ANSWERS = 10
SAMPLES_PER_STAGE = 3  # conversations per stage output logged as TensorBoard text
PART_NAMES = ("task_score", "token_term", "loss_term", "penalty", "reward")
STAGE_ORDER = ("generate", "score", "select", "probe", "search", "pairs", "train")
# The per-iteration table (MATH runs add the verifier's timeouts: ``with_timeouts``).
ITERATION_COLUMNS = ("label", "answer_rate", "task_score", "flexible_answer_rate", "flexible_score", "mean_tokens",
                     "cut_rate", "placeholder_copies", "conversations", "kept", "train_loss", "total_s")  # fmt: skip
ITERATION_HEADERS = ("iteration", "answer rate", "task score", "answer rate (flexible)", "task score (flexible)",
                     "mean tokens", "cut share", "placeholder copies", "conversations", "kept", "train loss",
                     "time (s)")  # fmt: skip


def build_row(iteration: int, stage: str, metrics: dict) -> dict:
    """One report row from one `metrics.json` (`stage`: `sft`/`dpo` inside an iSFT-DPO iteration, else "")."""
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
        # The answer named in words where the format is missing (older runs: not recorded).
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


def find_metrics(run_dir: Path) -> list[tuple[int, str, Path]]:
    """`(iteration, stage folder name, metrics.json)` of every finished iteration of the current lineage, in run
    order (an earlier run's iterations left in the folder are not read)."""
    return [(iteration, part, sp.metrics) for iteration, part, sp in lineage_folders(run_dir) if sp.metrics.is_file()]


def collect_rows(run_dir: Path) -> list[dict]:
    """The report rows of every finished stage folder of `run_dir`, in run order."""
    rows = []
    for iteration, stage, path in find_metrics(run_dir):
        try:
            metrics = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from exc
        rows.append(build_row(iteration, stage, metrics) | {"answers": final_answers(path.parent)} | lineage_of(path))
    return rows


def lineage_of(metrics: Path) -> dict:
    """`{"lineage": <key of the folder's last finished stage>}` (`{}` without a manifest): a tracker that sent the
    row of a redone iteration sends the new one too."""
    finished = [entry for entry in read_entries(metrics.with_name("manifest.json")).values() if "result" in entry]
    identity = finished[-1].get("identity") if finished else None
    return {"lineage": identity} if identity else {}


def final_answers(folder: Path) -> list[str]:
    """Final answers ("" for none) of a stage folder's conversations: generated ones (SFT), else the rollouts (DPO)."""
    paths = StagePaths(folder)
    if paths.generations.is_file():
        records = [reparsed(r) for r in load_records(paths.generations)[0]]
    elif paths.rollouts.is_file():
        records = [r for line in load_records(paths.rollouts)[0] for r in line.get("rollouts", [])]
    else:
        return []
    return [(record.get("final_answer") or "").strip() for record in records]


def answer_rows(rows: list[dict], top: int = TOP_ANSWERS) -> list[dict]:
    """The `top` most frequent final answers of each report row, with counts and shares of its conversations."""
    table = []
    for row in rows:
        answers = row.get("answers") or []
        for rank, (answer, count) in enumerate(Counter(a for a in answers if a).most_common(top), start=1):
            shown = " ".join(answer.split()).replace("|", "\\|")
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            table.append({"label": row["label"], "rank": rank, "answer": f"`{shown}`", "count": count,
                          "share": round(count / len(answers), 3)})  # fmt: skip
    return table


def _describe_run(run_dir: Path, rows: list[dict]) -> str:
    """One line naming the method (from the stages run), task and base model (from `recipe.yaml`)."""
    found = method_of_trainers({row["kind"] for row in rows})
    method = found.label if found else "-"
    recipe_file = run_dir / "recipe.yaml"
    if not recipe_file.is_file():
        return f"method {method}"
    recipe = yaml.safe_load(recipe_file.read_text()) or {}
    return (
        f"method {method}, task `{recipe.get('dataset_type', '?')}`, "
        f"base model `{recipe.get('initial_model_path', '?')}`, "
        f"{recipe.get('iteration_times', '?')} iterations planned"
    )


def render_report(run_dir: Path, rows: list[dict]) -> str:
    """The Markdown text of `report.md`."""
    lines = [f"# Optima run report: {run_dir.name}", "", _describe_run(run_dir, rows), ""]
    if (run_dir / PAGE).is_file():
        lines += [f"Every conversation, kept or dropped and why, and every DPO pair: [{PAGE}]({PAGE})", ""]
    if not rows:
        return "\n".join(
            [*lines, "No iteration has finished yet (no metrics.json found).", "", *heldout_section(run_dir)]
        )
    lines += [
        "Task score and answer rate are over the sampled conversations (SFT) or the tree-search rollouts (DPO); "
        "strict: the answer in the answer format (what the reward scores); flexible: the strict answer, else the "
        "one the replies name in words (an option, the last number: the `flexible-extract` of lm-eval-harness); "
        "kept = conversations kept by selection (SFT) or preference pairs kept (DPO); placeholder copies = "
        "conversations that state a prompt's placeholder as an answer (never kept). Iteration k is the folder "
        "`iteration_<k-1>`; its checkpoint `checkpoints/iteration_<k-1>` is the model after iteration k.",
        "",
        "## Per iteration",
        "",
        render_markdown_table(rows, with_timeouts(ITERATION_COLUMNS, rows), with_timeouts(ITERATION_HEADERS, rows)),
        "",
        "## Mean reward parts per conversation",
        "",
        render_markdown_table(rows, ("label", *(f"part_{n}" for n in PART_NAMES)), ("iteration", *PART_NAMES)),
        "",
    ]
    dpo = [row for row in rows if row["kind"] == DPO]
    if dpo:
        columns = ("label", "t_max", "search_questions", "conversations", "failed_rollouts", "failed_requests",
                   "pairs_found", "pairs_kept", "questions_with_pairs")  # fmt: skip
        headers = ("iteration", "T_max", "questions searched", "rollouts", "failed rollouts", "failed requests",
                   "pairs found", "pairs kept", "questions with pairs")  # fmt: skip
        lines += ["## DPO pairs and rollouts", "", render_markdown_table(dpo, columns, headers), ""]
    answers = answer_rows(rows)
    if answers:
        lines += [
            f"## Most frequent final answers (top {TOP_ANSWERS} per iteration)",
            "",
            "Share: of all the iteration's conversations (or rollouts). An answer far above the others may be copied.",
            "",
            render_markdown_table(
                answers,
                ("label", "rank", "answer", "count", "share"),
                ("iteration", "rank", "final answer", "count", "share"),
            ),  # fmt: skip
            "",
        ]
    used = [name for name in STAGE_ORDER if any(row.get(f"time_{name}") is not None for row in rows)]
    lines += [
        "## Stage times (s)",
        "",
        render_markdown_table(rows, ("label", *(f"time_{n}" for n in used), "total_s"), ("iteration", *used, "total")),
        "",
        f"![run report]({REPORT_PNG})",
        "",
        *heldout_section(run_dir),
    ]
    return "\n".join(lines)


def heldout_section(run_dir: Path) -> list[str]:
    """The held-out evaluation's table and plot (`heldout/summary.json`), the report's last; [] without one."""
    summary_file = run_dir / HELDOUT_SUMMARY
    if not summary_file.is_file():
        return []
    summary = json.loads(summary_file.read_text())
    rows, metric = summary.get("models") or [], summary.get("metric", "accuracy")
    return [
        "## Held-out evaluation",
        "",
        f"The base model and each checkpoint, greedy, one conversation per question, on the same "
        f"{summary.get('questions')} `{summary.get('task')}` eval questions (seed {summary.get('seed')}), none of "
        "them in the training split; no answer pre-fill, no constraint. Strict: the answer tag; flexible: the strict "
        f"answer, else the one named in words. Intervals: 95% Wilson. Time: {summary.get('seconds')} s.",
        "",
        render_heldout_table(rows, metric),
        "",
        f"![held-out evaluation]({HELDOUT_SUMMARY.with_suffix('.png')})",
        "",
    ]


def plot_report(rows: list[dict], path: Path, title: str):
    """Four panels per stage folder: task score, answer rate and share cut, mean tokens, train loss, stacked stage
    times; returns the figure."""
    figure, axes = new_figure(2, rows=2)
    (score_axis, token_axis), (loss_axis, time_axis) = axes
    x = list(range(len(rows)))
    labels = [row["label"] for row in rows]
    score_axis.plot(x, [row["task_score"] for row in rows], marker="o", label="task score")
    score_axis.plot(x, [row["answer_rate"] for row in rows], marker="^", linestyle=":", label="answer rate")
    if any(row.get("flexible_score") is not None for row in rows):
        score_axis.plot(x, [row.get("flexible_score") for row in rows], marker="o", mfc="none", linestyle="-.",
                        color="tab:blue", label="task score (flexible)")  # fmt: skip
        score_axis.plot(x, [row.get("flexible_answer_rate") for row in rows], marker="^", mfc="none", linestyle=":",
                        color="tab:orange", label="answer rate (flexible)")  # fmt: skip
    if any(row.get("cut_rate") is not None for row in rows):
        cut = [row.get("cut_rate") for row in rows]
        score_axis.plot(x, cut, marker="v", linestyle="--", color="tab:gray", label="cut for length")
    score_axis.set_ylim(-0.02, 1.02)
    score_axis.set_ylabel("share of conversations")
    score_axis.legend()
    token_axis.plot(x, [row["mean_tokens"] for row in rows], marker="o", color="tab:red")
    token_axis.set_ylabel("mean tokens per conversation")
    token_axis.set_ylim(bottom=0)
    loss_axis.plot(x, [row["train_loss"] for row in rows], marker="o", color="tab:green")
    loss_axis.set_ylabel("train loss")
    bottom = [0.0] * len(rows)
    for name in STAGE_ORDER:
        heights = [row.get(f"time_{name}") or 0.0 for row in rows]
        if any(heights):
            time_axis.bar(x, heights, bottom=bottom, label=name)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    time_axis.set_ylabel("stage time (s)")
    time_axis.legend(fontsize="small")
    for axis in (score_axis, token_axis, loss_axis, time_axis):
        axis.set_xticks(x, labels)
        axis.set_xlabel("iteration")
        axis.grid(alpha=0.3)
    figure.suptitle(title)
    tmp = path.with_name(path.name + ".tmp")
    figure.savefig(tmp, dpi=110, format="png")
    tmp.replace(path)  # a reader never sees half an image
    return figure


def write_run_report(run_dir: Path, rows: list[dict] | None = None) -> tuple[Path, Path]:
    """Write (or redraw) `report.md` and `report.png` in `run_dir` (`rows`: `collect_rows` if read already)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    rows = collect_rows(run_dir) if rows is None else rows
    markdown, image = run_dir / REPORT_MD, run_dir / REPORT_PNG
    atomic_write_text(markdown, render_report(run_dir, rows))
    if rows:
        plot_report(rows, image, f"Optima run {run_dir.name}")
    logger.info("report | %s (%d iterations)", markdown, len(rows))
    return markdown, image


def publish_iteration(run_dir: Path, report_to: list[str]) -> None:
    """After an iteration: rewrite `conversations.html`, redraw `report.md`/`report.png` (which link it), and send
    the report rows and a few conversations (a kept one, a dropped one, one cut for length) to the trackers.

    A failure here is logged and does not stop the run (the metrics stay in `metrics.json`).
    """
    sections = None  # the stage outputs, read once for the page and the trackers' sample conversations
    try:
        sections = collect_sections(run_dir)
        write_conversations_page(run_dir, sections=sections)
    except (OSError, ValueError, KeyError) as exc:
        logger.warning("conversations | could not write the conversation browser of %s: %s", run_dir, exc)
    try:
        rows = collect_rows(run_dir)  # read once: the report, TensorBoard and W&B all draw from these rows
        write_run_report(run_dir, rows)
        if rows and "tensorboard" in report_to:
            try:
                samples = sample_conversations(run_dir, SAMPLES_PER_STAGE, sections)
            except (OSError, ValueError, KeyError) as exc:  # the scalars are written whatever the conversations hold
                logger.warning("tensorboard | no sample conversations for %s: %s", run_dir, exc)
                samples = []
            write_tensorboard_scalars(run_dir, rows, samples)
        if rows and "wandb" in report_to:
            log_rows(run_dir, rows)  # every finished row not sent yet (backfills after a resume)
    except (OSError, ValueError, ImportError) as exc:
        logger.warning("report | could not write the run report or tracker logs of %s: %s", run_dir, exc)
