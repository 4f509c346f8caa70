"""The key of each stage of a part: its recipe fields, and the identity of everything it reads (docs/method.md#resume).

A stage's output depends on more than its recipe fields: on the model it samples from or starts training from, on
the loss model that scores it, on the trainer's base YAML, and on everything the stages before it produced. So
each stage's ``StageKey`` (``optima.manifest``) holds, besides the fields:

* the unique id of every model it reads (``optima.identity.model_identity``: the ``weights_id`` of a finished
  checkpoint's completion marker, so a checkpoint retrained in place is a new model), and a hash of every file it
  reads (the trainer's base YAML, the prompt pool, the task's train split under ``data_dir``);
* the role prompts in code (``optima.agents.prompts.templates_identity``) for the stages that sample
  conversations, and the parser and scorer versions for the stages that score answers;
* the key of the stage before it (``previous stage``), chained across the parts and iterations of a run.

A change anywhere therefore redoes exactly what depends on it: retraining iteration 1 gives its checkpoint a new
``weights_id``, so iteration 2 samples again from the new model instead of keeping off-policy conversations; a
new ``initial_model_path`` redoes iDPO's probe, tree search and pairs as it redoes iSFT's conversations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from optima.agents.generation import generation_settings
from optima.agents.prompts import templates_identity
from optima.config.rules import loss_model, train_start, trainer_base_yaml
from optima.identity import digest, file_digest, model_identity
from optima.manifest import StageKey, field_values, fields_hash, stage_link
from optima.methods import DPO, SFT
from optima.tasks import DataError, get_task, resolve_data_dir
from optima.tasks.answers import PARSER_VERSION
from optima.tasks.scoring import SCORER_VERSION

if TYPE_CHECKING:
    from optima.config import Recipe


def file_identity(path: str | None) -> str | None:
    """``sha256:<hex>`` of a file's bytes (None when no path is set, ``missing:<path>`` when it does not exist)."""
    if not path:
        return None
    file = Path(path)
    if not file.is_file():
        return f"missing:{path}"
    return "sha256:" + file_digest(file)[:32]


def _prompt_pool(call) -> str | None:
    used = generation_settings(call.ctx.recipe, call.iteration).use_prompt_pool  # the generate stage's own settings
    return file_identity(call.ctx.recipe.prompt_pool_path) if used else None


def data_identity(recipe: Recipe) -> str:
    """A hash of the task's train split: its files' names and contents (hub names for the hub's rows).

    A split that cannot be found is ``missing: <why>`` (the stage then fails when it reads it).
    """
    task = get_task(recipe.dataset_type)
    try:
        sources = task.sources(task.train_split, recipe.data_dir)
    except DataError as error:
        return f"missing: {error}"
    root = resolve_data_dir(recipe.data_dir)
    named = [s if isinstance(s, str) else [s.relative_to(root).as_posix(), file_digest(s)] for s in sources]
    return "sha256:" + digest(named)


# What a stage can read (the ``reads`` of a stage table row) -> its identity for one ``StageCall`` (None: unused).
READERS: dict[str, Callable] = {
    "served model": lambda call: model_identity(call.model),
    "loss model": lambda call: model_identity(loss_model(call.ctx.recipe)) if call.ctx.recipe.cal_ppl else None,
    "start model": lambda call: model_identity(train_start(call.ctx.recipe, call.model, call.part)),
    "SFT trainer YAML": lambda call: file_identity(trainer_base_yaml(call.ctx.recipe, SFT)),
    "DPO trainer YAML": lambda call: file_identity(trainer_base_yaml(call.ctx.recipe, DPO)),
    "prompt pool": _prompt_pool,
    "task data": lambda call: data_identity(call.ctx.recipe),
    "role prompts": lambda call: templates_identity(),
    "answer checks": lambda call: f"parser {PARSER_VERSION}, scorer {SCORER_VERSION}",
}


def part_keys(call, stages: Sequence, upstream: str | None = None) -> dict[str, StageKey]:
    """The ``StageKey`` of every stage of one part, in order, each chained to the one before it.

    Args:
        call: The part's ``StageCall`` (its models must exist: they are the previous parts' outputs).
        stages: The part's stage table rows (``name``, ``fields``, ``reads``).
        upstream: ``previous stage`` of the first stage (the last stage of the previous part; None for the first).
    """
    recipe, keys = call.ctx.recipe, {}
    for stage in stages:
        inputs = {name: READERS[name](call) for name in stage.reads}
        inputs = {name: value for name, value in inputs.items() if value is not None}
        if upstream is not None:
            inputs["previous stage"] = upstream
        key = StageKey(fields_hash(recipe, stage.fields), field_values(recipe, stage.fields), inputs)
        keys[stage.name] = key
        upstream = link(call, stage.name, key)
    return keys


def link(call, stage: str, key: StageKey) -> str:
    """What the stage after ``stage`` records as its ``previous stage``: where it ran and its identity."""
    return stage_link(f"iteration_{call.iteration}{'/' + call.part if call.part else ''}", stage, key.identity)
