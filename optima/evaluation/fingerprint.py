"""What produced an evaluation result file: its producer's fingerprint, kept beside it (docs/method.md#evaluation).

Result files (``<model>.jsonl``, ``<model>.<method>.jsonl``, ``<model>.sc.jsonl``) resume by (question, sample), so
a rerun with other settings would otherwise append to rows sampled under the old ones. Each file therefore has a
sidecar ``<file>.producer.json`` holding the fingerprint of what produced it:

* ``model``: the weights' unique id (``optima.identity.model_identity``: a checkpoint's ``weights_id``);
* ``tokenizer``: a hash of the tokenizer files that count its tokens and hold the chat template;
* ``prompts``: a hash of the role prompts in code (``optima.agents.prompts.templates_identity``) and a hash of the
  prompt texts the method sends, rendered for every question of the set;
* ``generation``: temperature, samples per question, ``max_tokens``, ``max_turns``, ``seed``, the seed label;
* ``serving``: ``max_model_len`` and the ``--dtype`` of ``vllm_extra_args``;
* ``questions``: the task, the ``limit`` sample (its size, mode and ids) and a hash of the eval questions (ids,
  texts, answers, context halves), so ``--limit`` or the data changing is a change;
* ``method``: the method and its parameters (MAD's agents, rounds and context, and the ``cluster_f1`` of its vote);
* ``scoring``: the parser and scorer versions (``PARSER_VERSION``, ``SCORER_VERSION``) and ``cluster_f1``.

Before a file is filled, its recorded fingerprint is compared with this run's: a file written by another producer
(or by one that recorded none) is moved to ``superseded/<file>.<old fingerprint>.jsonl`` with a warning naming
what changed, and generated anew. Rows of two producers never mix in one file. ``scoring`` is how rows are read,
not how they were made: a change of it keeps the rows (readers re-parse rows of an older parser from their text,
``optima.tasks.reparse``) and only updates the sidecar, so the summaries' producer hash names both.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from optima.agents.prompts import (
    AGENT_NAMES,
    Utterance,
    build_agent_messages,
    partner_of,
    role_prompt,
    templates_identity,
)
from optima.config.rules import tokenizer_path, vllm_dtype_arg
from optima.identity import digest, model_identity
from optima.store import write_json
from optima.tasks import Example, get_task
from optima.tasks.answers import PARSER_VERSION
from optima.tasks.scoring import SCORER_VERSION

if TYPE_CHECKING:
    from optima.config import InferenceRecipe

logger = logging.getLogger(__name__)

# The files of a tokenizer (and of its chat template), hashed in this order when present.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
SUPERSEDED = "superseded"
READING = ("scoring",)  # how rows are read, not made: a change updates the sidecar and keeps the rows


def tokenizer_identity(path: str | Path) -> str:
    """Hash of a folder's tokenizer files (``TOKENIZER_FILES``); a hub name is its own identity."""
    folder = Path(path)
    if not folder.is_dir():
        return str(path)
    hasher = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            hasher.update(name.encode() + b"\0" + (folder / name).read_bytes())
    return "sha256:" + hasher.hexdigest()[:32]


def conversation_prompts(example: Example, system_prompts: Sequence[str] | None = None) -> list:
    """What Optima's two-agent conversation sends: each agent's view after one partner message, and its role."""
    task = get_task(example.task)
    texts: list = []
    for index, name in enumerate(AGENT_NAMES):
        system = system_prompts[index] if system_prompts else None
        texts.append(build_agent_messages(example, name, [Utterance(partner_of(name), "...")], system, task))
        texts.append(repr(role_prompt(task, name)))  # reminder, answer opening
    return texts


def model_fingerprint(recipe: InferenceRecipe, model_path: Path, examples: Sequence[Example]) -> dict:
    """The parts of a fingerprint every job of one model shares: weights, tokenizer and questions (built once).

    Args:
        recipe: The evaluation recipe (tokenizer, task; a training loop's for the held-out evaluation).
        model_path: The served model.
        examples: The eval set.
    """
    limit = getattr(recipe, "limit", None)  # a training run's held-out evaluation has none (its own sample)
    return {
        "model": model_identity(model_path),
        "tokenizer": tokenizer_identity(tokenizer_path(recipe, model=str(model_path))),
        "questions": {
            "task": recipe.dataset_type,
            "count": len(examples),
            "limit": {"n": limit, "mode": recipe.limit_mode} if limit else None,
            "ids": digest([example.id for example in examples]),
            "hash": digest([example.to_dict() for example in examples]),
        },
        "templates": templates_identity(),
    }


def producer_fingerprint(recipe: InferenceRecipe, job, examples: Sequence[Example], shared: dict) -> dict:
    """The fingerprint of ``job``'s result file when the model of ``shared`` produces it on ``examples``.

    Args:
        recipe: The evaluation recipe (generation settings, seed).
        job: The ``GenerationJob`` (generation, method parameters, prompt renderer).
        examples: The eval set.
        shared: ``model_fingerprint`` of the served model on ``examples``.
    """
    render = job.prompts or conversation_prompts
    generation = job.generation
    return {
        "method": {"label": job.label} | dict(job.params) | {name: getattr(recipe, name, None) for name in job.reads},
        "model": shared["model"],
        "tokenizer": shared["tokenizer"],
        "prompts": {"templates": shared["templates"], "rendered": digest([render(e) for e in examples])},
        "generation": {
            "temperature": generation.temperature,
            "samples": generation.samples,
            "max_tokens": recipe.max_tokens,
            "max_turns": recipe.max_turns,
            "seed": recipe.seed,
            "stage": generation.stage,
            "iteration": generation.iteration,
        },
        "serving": {"max_model_len": recipe.max_model_len, "dtype": vllm_dtype_arg(recipe.vllm_extra_args)},
        "questions": shared["questions"],
        "scoring": {
            "parser": PARSER_VERSION,
            "scorer": SCORER_VERSION,
            "cluster_f1": getattr(recipe, "cluster_f1", None),
        },
    }


def producer_path(out_path: Path) -> Path:
    """``<file>.producer.json`` beside a result file."""
    return out_path.with_name(out_path.name.removesuffix(".jsonl") + ".producer.json")


def read_producer(out_path: Path) -> dict | None:
    """The fingerprint recorded beside ``out_path`` (None when there is none)."""
    path = producer_path(out_path)
    return json.loads(path.read_text()) if path.is_file() else None


def differences(old: dict | None, new: dict) -> list[str]:
    """What changed between two fingerprints, one ``key: old -> new`` phrase each."""
    if old is None:
        return ["no fingerprint recorded"]
    changes = []
    for key in sorted(set(old) | set(new)):
        before, after = old.get(key), new.get(key)
        if isinstance(before, dict) and isinstance(after, dict):
            changes += [f"{key}.{c}" for c in differences(before, after)]
        elif before != after:
            changes.append(f"{key}: {before} -> {after}")
    return changes


def claim_result_file(out_path: Path, fingerprint: dict) -> bool:
    """Make ``out_path`` a file of this producer; return True when rows of another one were moved aside.

    A file with the same fingerprint is kept (it resumes); one with another fingerprint, or none, goes to
    ``superseded/`` with its sidecar. The sidecar of this producer is written before any row.
    """
    old = read_producer(out_path)
    made = {key: value for key, value in fingerprint.items() if key not in READING}
    changes = differences({k: v for k, v in old.items() if k not in READING} if old else None, made)
    changes = changes if out_path.exists() else []
    moved = bool(changes) and out_path.stat().st_size > 0
    if moved:
        folder = out_path.parent / SUPERSEDED
        folder.mkdir(exist_ok=True)
        stem = out_path.name.removesuffix(".jsonl")
        target = folder / f"{stem}.{digest(old) if old else 'unknown'}.jsonl"
        out_path.replace(target)
        if old is not None:
            producer_path(out_path).replace(producer_path(target))
        logger.warning(
            "%s: produced otherwise (%s); moved to %s, generating anew", out_path, "; ".join(changes), target
        )
    elif changes and out_path.exists():
        out_path.unlink()  # an empty file of another producer
    write_json(producer_path(out_path), fingerprint)
    return moved
