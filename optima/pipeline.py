"""The only place that runs serve -> generate -> reward -> select -> train (SPEC 1.2-1.4).

Follows the stage list of ``optima.plan``; each stage writes a manifest entry after it succeeds, so the same
command resumes at the first unfinished stage.
"""

from __future__ import annotations

import logging

from optima.plan import Plan

logger = logging.getLogger(__name__)


class StageNotAvailable(RuntimeError):
    """A stage this version cannot run yet."""


def run_plan(plan: Plan) -> None:
    """Execute a plan's stages in order."""
    first = next((s for s in plan.stages if s.name != "skip"), None)
    if first is not None:
        raise StageNotAvailable(f"stage {first.name!r} is not implemented yet; use --dry-run to see the plan")
