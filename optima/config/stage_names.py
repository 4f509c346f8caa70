"""The names of the stages of the training loops, once: the stage tables, the manifest and the ``redoes=`` tags.

A recipe field names the stages whose output it decides (``field(redoes=...)``); the stage tables of
``optima.plan`` give each stage its name from here. Both sides reading one enum ties them: a tag that names no stage
fails when the recipe classes are defined (at import), not later as a stage that silently never redoes. The values
are the strings the manifests of earlier runs recorded, so those runs keep resuming.
"""

from __future__ import annotations

from enum import StrEnum


class Stage(StrEnum):
    """A stage of iSFT (generate, score, select, train) or iDPO (probe, search, pairs, train)."""

    GENERATE = "generate"  # iSFT: sample conversations
    SCORE = "score"  # iSFT: reward them
    SELECT = "select"  # iSFT: keep the best as the training set
    PROBE = "probe"  # iDPO: sample conversations for the token budget T_max
    SEARCH = "search"  # iDPO: the tree search
    PAIRS = "pairs"  # iDPO: mine preference pairs from the trees
    TRAIN = "train"  # either: fine-tune into the checkpoint


def stage_tags(tags: tuple[str, ...]) -> tuple[Stage, ...]:
    """``tags`` as ``Stage`` members.

    Raises:
        ValueError: a tag names no stage (with the stages there are).
    """
    known = [stage.value for stage in Stage]
    unknown = [tag for tag in tags if tag not in known]
    if unknown:
        raise ValueError(f"redoes: no stage named {', '.join(map(repr, unknown))}; the stages: {', '.join(known)}")
    return tuple(Stage(tag) for tag in tags)
