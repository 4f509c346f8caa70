"""Experiment tracking of a loop run: the trainer's ``report_to`` and the per-iteration numbers, one dashboard.

``report_to`` in the recipe is ``auto`` (TensorBoard when the training environment has it, else nothing),
``none``, ``tensorboard`` or ``wandb`` (or a list of them). The trainer of every iteration gets it in its rendered
YAML with a ``run_name`` per iteration (``<run>/iteration_<i>[/<stage>]``); its TensorBoard events go to
``<run>/tensorboard/iteration_<i>[/<stage>]/``. After each iteration the driver writes the report rows of
``optima.reporting`` (answer rate, task score, mean tokens, reward parts, kept, train loss, stage times) as
scalars under ``<run>/tensorboard/optima/``, one step per iteration, so
``tensorboard --logdir <run>/tensorboard`` shows the trainer curves and the iteration curves side by side. With
``wandb`` the same rows go to W&B, the trainers' runs in the same project and group (``optima.wandb_tracking``).

The driver never imports torch: TensorBoard events are written with ``tensorboardX``'s ``SummaryWriter``. The
scalar file is rewritten from all finished iterations each time, so a resumed run shows every iteration once. A
few conversations of every stage output (a kept one, a dropped one, one cut for length) go beside the scalars as
TensorBoard text (tag ``conversations/<stage output>``, one step per iteration), and after every iteration the
driver also rewrites ``conversations.html`` (``optima.browser``) before the report that links it.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from optima.config import RecipeError, parse_report_to
from optima.methods import DPO
from optima.paths import TENSORBOARD_DIR, RunPaths, StagePaths

logger = logging.getLogger(__name__)

ITERATION_LOG = "optima"
# Report-row keys logged as scalars (tag = optima/<group>/<key>).
SCALAR_GROUPS = {
    "conversations": ("answer_rate", "cut_rate", "task_score", "mean_tokens", "kept", "verifier_timeouts"),
    "train": ("train_loss", "train_rows"),
    DPO: ("pairs_found", "pairs_kept", "t_max", "questions_with_pairs", "failed_rollouts", "failed_requests"),
}
SAMPLES_PER_STAGE = 3  # conversations per stage output logged as TensorBoard text


def resolve_report_to(value: str | list[str] | None, train_env) -> list[str]:
    """The trackers a run uses: ``auto`` becomes ``["tensorboard"]`` when the training env can import it.

    Args:
        value: The recipe's ``report_to``.
        train_env: The training environment (``PythonEnv``), asked which modules it has.

    Raises:
        RecipeError: a requested tracker is not installed in the training environment.
    """
    parsed = parse_report_to(value)
    if parsed == "auto":
        return [] if train_env is None or train_env.missing_modules(("tensorboard",)) else ["tensorboard"]
    missing = train_env.missing_modules(tuple(parsed)) if parsed and train_env is not None else []
    if missing:
        raise RecipeError(
            "report_to", f"{missing} not installed in the training environment; install it or set report_to: none"
        )
    return parsed


def run_name(run_dir: Path, stage_root: Path) -> str:
    """The trainer's run name for one iteration folder: ``<run>/iteration_<i>[/<stage>]``."""
    return f"{Path(run_dir).name}/{Path(stage_root).relative_to(run_dir).as_posix()}"


def trainer_overrides(report_to: list[str], run_dir: Path, stage_root: Path) -> dict[str, Any]:
    """Keys of the rendered trainer YAML that route the trainer's logs to the run's trackers."""
    return {"report_to": list(report_to) or "none", "run_name": run_name(run_dir, stage_root)}


def trainer_env(report_to: list[str], run_dir: Path, stage_root: Path) -> dict[str, str]:
    """Environment of the trainer process: where its TensorBoard events go, its W&B project, group and run id."""
    env = {}
    if "tensorboard" in report_to:
        env["TENSORBOARD_LOGGING_DIR"] = str(RunPaths(Path(run_dir)).trainer_logs(StagePaths(Path(stage_root))))
    if "wandb" in report_to:
        from optima import wandb_tracking

        env |= wandb_tracking.trainer_env(run_dir, stage_root)
    return env


def scalars_of(row: dict) -> dict[str, float]:
    """The numeric values of one report row, keyed by TensorBoard tag."""
    prefix = f"{row['stage']}/" if row.get("stage") else ""  # iSFT-DPO: sft/... and dpo/... at the same step
    tags = {}
    for group, keys in SCALAR_GROUPS.items():
        tags |= {f"{prefix}{group}/{key}": row.get(key) for key in keys}
    tags |= {f"{prefix}reward_parts/{k.removeprefix('part_')}": v for k, v in row.items() if k.startswith("part_")}
    tags |= {f"{prefix}time_s/{k.removeprefix('time_')}": v for k, v in row.items() if k.startswith("time_")}
    return {tag: float(value) for tag, value in tags.items() if isinstance(value, int | float)}


def write_tensorboard_scalars(run_dir: Path, rows: list[dict], sections: list | None = None) -> Path:
    """(Re)write the iteration scalars of ``rows`` as one TensorBoard event file; returns its folder.

    ``sections``: the run's browser sections when the caller has read them (``optima.browser.collect_sections``).
    """
    from tensorboardX import SummaryWriter

    folder = Path(run_dir) / TENSORBOARD_DIR / ITERATION_LOG
    if folder.exists():
        shutil.rmtree(folder)  # every finished iteration is written again below: no duplicates after a resume
    with SummaryWriter(str(folder)) as writer:
        for row in rows:
            for tag, value in scalars_of(row).items():
                writer.add_scalar(tag, value, global_step=row["iteration"])
        try:
            add_sample_conversations(writer, run_dir, sections=sections)
        except (OSError, ValueError, KeyError) as exc:  # the scalars are written whatever the conversations hold
            logger.warning("tensorboard | no sample conversations for %s: %s", run_dir, exc)
    return folder


def add_sample_conversations(
    writer, run_dir: Path, count: int = SAMPLES_PER_STAGE, sections: list | None = None
) -> int:
    """Log up to ``count`` conversations of every stage output of ``run_dir`` as text; returns the texts written.

    Args:
        writer: Anything with ``add_text(tag, text, global_step)`` (tensorboardX's or torch's ``SummaryWriter``).
        run_dir: The run directory.
        count: Conversations per stage output (a kept one, a dropped one, one cut for length, then the first).
        sections: The run's browser sections, if read already (else read here).
    """
    from optima.browser import sample_conversations

    samples = sample_conversations(run_dir, count, sections)
    for step, tag, text in samples:
        writer.add_text(tag, text, global_step=step)
    return len(samples)


def publish_iteration(run_dir: Path, report_to: list[str]) -> None:
    """After an iteration: rewrite ``conversations.html``, redraw ``report.md``/``report.png`` (which link it) and
    send the iteration numbers and a few conversations to the trackers.

    A failure here is logged and does not stop the run (the metrics stay in ``metrics.json``).
    """
    from optima.browser import collect_sections, write_conversations_page
    from optima.reporting import collect_rows, write_run_report

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
            write_tensorboard_scalars(run_dir, rows, sections)
        if rows and "wandb" in report_to:
            from optima.wandb_tracking import log_rows

            log_rows(run_dir, rows, scalars_of)  # every finished row not sent yet (backfills after a resume)
    except (OSError, ValueError, ImportError) as exc:
        logger.warning("report | could not write the run report or tracker logs of %s: %s", run_dir, exc)
