"""W&B tracking of a loop run, the standard way: one project, one group per run, one stored run id.

With ``report_to: wandb`` (``optima.tracking``) the driver and every trainer log to W&B:

* **project**: ``$WANDB_PROJECT``, else ``optima``, for the driver and the trainers alike (the trainers' W&B
  callback would otherwise default to ``huggingface``).
* **group**: the run directory's name. The driver's run (the iteration rows of ``optima.reporting``) and one run
  per trainer (its loss curves) sit in it.
* **id**: drawn at random on the run's first W&B log and stored in ``<run>/wandb_run.json``. A resumed run reuses
  it (``resume="allow"``); a rerun into a new run directory draws a new one, so runs never collide. A trainer's
  id is ``<id>-iteration_<i>[-<stage>]``, so a trainer resumed from its ``checkpoint-N`` continues its own run.
* **step**: ``iteration`` is the step metric of the driver's run (``define_metric("*", step_metric=...)``), so
  rows logged late still sit at their iteration.
* **backfill**: ``wandb_run.json`` lists the rows already sent; each publish sends every finished row not sent
  yet. Iterations finished before a resume (or before ``wandb`` was switched on) are logged then.

wandb's own environment applies: ``WANDB_MODE=offline`` writes under ``<run>/wandb/`` and sends nothing.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import string
from pathlib import Path

from optima.store import write_json

logger = logging.getLogger(__name__)

RUN_FILE = "wandb_run.json"
DEFAULT_PROJECT = "optima"
ID_CHARS = string.ascii_lowercase + string.digits  # W&B's own run-id alphabet (base 36)


def wandb_project() -> str:
    """The W&B project: ``$WANDB_PROJECT``, else ``optima``."""
    return os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT


def run_record(run_dir: Path) -> dict:
    """The run's W&B identity (``id``, ``project``, ``group``, ``logged`` rows), created on first use.

    A record of another project (``WANDB_PROJECT`` changed) is replaced: the new project gets a new id and every
    row again.
    """
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


def trainer_env(run_dir: Path, stage_root: Path) -> dict[str, str]:
    """Environment of a trainer process: the run's project and group, the trainer's own resumable run id."""
    record = run_record(run_dir)
    stage = Path(stage_root).relative_to(run_dir).as_posix().replace("/", "-")
    return {
        "WANDB_PROJECT": record["project"],
        "WANDB_RUN_GROUP": record["group"],
        "WANDB_RUN_ID": f"{record['id']}-{stage}",
        "WANDB_RESUME": "allow",
        "WANDB_JOB_TYPE": "train",
        "WANDB_DIR": str(run_dir),
    }


def row_key(row: dict) -> str:
    """``<iteration>`` or ``<iteration>/<stage>``: one report row (iSFT-DPO has two per iteration); ``@<key>`` after
    it when the row names its lineage, so an iteration redone under another key is sent again (same step)."""
    key = f"{row['iteration']}/{row['stage']}" if row.get("stage") else str(row["iteration"])
    return f"{key}@{row['lineage'][:12]}" if row.get("lineage") else key


def log_rows(run_dir: Path, rows: list[dict], scalars_of) -> list[str]:
    """Send the rows not sent yet to the run's W&B run (resumed by its id); returns their keys.

    Args:
        run_dir: The run directory (``wandb_run.json`` and wandb's files go there).
        rows: Every finished report row (``optima.reporting.collect_rows``), in run order.
        scalars_of: Maps a row to ``{metric name: value}`` (the TensorBoard tags of ``optima.tracking``).
    """
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
