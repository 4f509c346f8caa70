"""Experiment tracking of a loop run: the trainers' `report_to`, and the iteration rows as TensorBoard scalars and
W&B rows (docs/tracking.md).

`report_to` is `auto` (TensorBoard when the training environment has it), `none`, `tensorboard` or `wandb`. Each
trainer logs under `<run>/tensorboard/iteration_<i>[/<stage>]` with a run name per iteration; after each iteration
the report rows go to `<run>/tensorboard/optima/` (rewritten whole, so a resumed run shows every iteration once)
with a few conversations as text, and with `wandb` to one W&B project (`$WANDB_PROJECT`, else `optima`) and group
(the run's name): the run id is stored in `wandb_run.json`, so a resumed run continues its W&B run and sends the
rows not sent yet. The driver never imports torch (tensorboardX writes the events).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from optima.config import RecipeError, parse_report_to
from optima.methods import DPO
from optima.paths import TENSORBOARD_DIR, RunPaths, StagePaths
from optima.store import write_json

logger = logging.getLogger(__name__)

ITERATION_LOG = "optima"
# Report-row keys logged as scalars (tag = optima/<group>/<key>).
SCALAR_GROUPS = {
    "conversations": ("answer_rate", "cut_rate", "task_score", "mean_tokens", "kept", "verifier_timeouts"),
    "train": ("train_loss", "train_rows"),
    DPO: ("pairs_found", "pairs_kept", "t_max", "questions_with_pairs", "failed_rollouts", "failed_requests"),
}
RUN_FILE = "wandb_run.json"
DEFAULT_PROJECT = "optima"
ID_CHARS = string.ascii_lowercase + string.digits  # W&B's own run-id alphabet (base 36)


def resolve_report_to(value: str | list[str] | None, train_env) -> list[str]:
    """The trackers a run uses: `auto` is `["tensorboard"]` when the training environment (`PythonEnv`) has it.

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
    """The trainer's run name for one iteration folder: `<run>/iteration_<i>[/<stage>]`."""
    return f"{Path(run_dir).name}/{Path(stage_root).relative_to(run_dir).as_posix()}"


def trainer_overrides(report_to: list[str], run_dir: Path, stage_root: Path) -> dict[str, Any]:
    """The keys of the rendered trainer YAML that route the trainer's logs to the run's trackers."""
    return {"report_to": list(report_to) or "none", "run_name": run_name(run_dir, stage_root)}


def trainer_env(report_to: list[str], run_dir: Path, stage_root: Path) -> dict[str, str]:
    """The trainer process's environment: where its TensorBoard events go; its W&B project, group and own
    resumable run id (`<id>-iteration_<i>[-<stage>]`)."""
    env = {}
    if "tensorboard" in report_to:
        env["TENSORBOARD_LOGGING_DIR"] = str(RunPaths(Path(run_dir)).trainer_logs(StagePaths(Path(stage_root))))
    if "wandb" in report_to:
        record = run_record(run_dir)
        stage = Path(stage_root).relative_to(run_dir).as_posix().replace("/", "-")
        env |= {
            "WANDB_PROJECT": record["project"],
            "WANDB_RUN_GROUP": record["group"],
            "WANDB_RUN_ID": f"{record['id']}-{stage}",
            "WANDB_RESUME": "allow",
            "WANDB_JOB_TYPE": "train",
            "WANDB_DIR": str(run_dir),
        }
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


def write_tensorboard_scalars(run_dir: Path, rows: list[dict], samples: Sequence[tuple[int, str, str]] = ()) -> Path:
    """(Re)write the iteration scalars of `rows` and the `(step, tag, markdown)` sample conversations as one
    TensorBoard event file; returns its folder."""
    from tensorboardX import SummaryWriter

    folder = Path(run_dir) / TENSORBOARD_DIR / ITERATION_LOG
    if folder.exists():
        shutil.rmtree(folder)  # every finished iteration is written again below: no duplicates after a resume
    with SummaryWriter(str(folder)) as writer:
        for row in rows:
            for tag, value in scalars_of(row).items():
                writer.add_scalar(tag, value, global_step=row["iteration"])
        for step, tag, text in samples:
            writer.add_text(tag, text, global_step=step)
    return folder


def wandb_project() -> str:
    """The W&B project: `$WANDB_PROJECT`, else `optima`."""
    return os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT


def run_record(run_dir: Path) -> dict:
    """The run's W&B identity (`id`, `project`, `group`, the `logged` rows), created on first use; a record of
    another project (`WANDB_PROJECT` changed) is replaced: a new id, every row again."""
    path = Path(run_dir) / RUN_FILE
    project = wandb_project()
    if path.is_file():
        record = json.loads(path.read_text())
        if record.get("project") == project:
            return record
        logger.warning("wandb | %s was for project %r; starting a run in %r", path, record.get("project"), project)
    run_id = "".join(secrets.choice(ID_CHARS) for _ in range(8))
    record = {"id": run_id, "project": project, "group": Path(run_dir).name, "logged": []}
    write_json(path, record)
    return record


def row_key(row: dict) -> str:
    """`<iteration>[/<stage>]` of one report row, `@<key>` after it when the row names its lineage (an iteration
    redone under another key is sent again, at the same step)."""
    key = f"{row['iteration']}/{row['stage']}" if row.get("stage") else str(row["iteration"])
    return f"{key}@{row['lineage'][:12]}" if row.get("lineage") else key


def log_rows(run_dir: Path, rows: list[dict]) -> list[str]:
    """Send the rows not sent yet to the run's W&B run (resumed by its id, `iteration` its step metric), under the
    TensorBoard tags; returns their keys."""
    record = run_record(run_dir)
    missing = [row for row in rows if row_key(row) not in record["logged"]]
    if not missing:
        return []
    try:
        import wandb
    except ImportError:
        logger.warning("report_to: wandb, but the driver's Python has no wandb; iteration metrics not sent")
        return []
    try:
        run = wandb.init(
            project=record["project"],
            group=record["group"],
            name=record["group"],
            id=record["id"],
            resume="allow",
            job_type="optima",
            dir=str(run_dir),
        )
        run.define_metric("iteration")
        run.define_metric("*", step_metric="iteration")
        for row in missing:
            run.log(scalars_of(row) | {"iteration": row["iteration"]})
        run.finish()
    except wandb.Error as exc:
        logger.warning("wandb | could not log the iterations of %s: %s", run_dir, exc)
        return []
    sent = [row_key(row) for row in missing]
    write_json(Path(run_dir) / RUN_FILE, record | {"logged": record["logged"] + sent})
    logger.info("wandb | project %s, run %s: iteration rows %s", record["project"], record["id"], ", ".join(sent))
    return sent
