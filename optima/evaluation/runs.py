"""What every evaluation shares: the eval set, the result files and what produced them, and a session that serves
a model only when one of its files is incomplete (docs/method.md#evaluation).

A result file (``<model>[.<method>].jsonl``) resumes by (question, sample) and is complete when every pair has a
record other than ``error``. Beside it, ``<file>.producer.json`` holds its producer's fingerprint (weights,
tokenizer, prompts, generation and serving settings, questions, method, scoring versions); before a file is filled
the two are compared, and a file of another producer is moved to ``superseded/`` and generated anew, so rows of two
producers never mix. ``scoring`` is how rows are read, not made: its change keeps the rows (readers re-parse them,
``optima.tasks.scoring``) and only updates the sidecar.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

from optima.agents.conversation import GenerationSettings
from optima.agents.generation import generate_conversations
from optima.agents.prompts import (
    AGENT_NAMES,
    Utterance,
    build_agent_messages,
    partner_of,
    role_prompt,
    templates_identity,
)
from optima.config import InferenceRecipe, Recipe, save_recipe
from optima.config.rules import tokenizer_path, vllm_dtype_arg
from optima.environments import PythonEnv, check_env
from optima.evaluation.metrics import RecordScorer, reparsed_debate
from optima.identity import digest, model_identity
from optima.logging_utils import attach_driver_log
from optima.paths import StagePaths
from optima.serving.vllm_server import serve
from optima.store import load_records, record_key, write_json
from optima.tasks import Example, get_task
from optima.tasks.answers import PARSER_VERSION
from optima.tasks.math_equiv import MathVerifier
from optima.tasks.sampling import stratified_indices
from optima.tasks.scoring import SCORER_VERSION, reparsed

logger = logging.getLogger(__name__)

ServeModel = Callable[[str, Path], AbstractContextManager]  # (name, model folder) -> the URLs serving it
# The files of a tokenizer (and of its chat template), hashed in this order when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
                   "chat_template.json")  # fmt: skip
SUPERSEDED = "superseded"
READING = ("scoring",)  # how rows are read, not made: a change updates the sidecar and keeps the rows


@dataclass(frozen=True)
class GenerationJob:
    """One result file to fill for a served model: its method ``label``, ``generate`` (``generate_conversations`` or
    a baseline's function of the same signature), and what its fingerprint adds: the method's ``params`` (MAD's
    shape), its ``prompts`` renderer (None: Optima's conversation) and the recipe fields it ``reads``."""

    label: str
    out_path: Path
    generation: GenerationSettings
    generate: Callable = generate_conversations
    params: dict = field(default_factory=dict)
    prompts: Callable[[Example], list] | None = None
    reads: tuple[str, ...] = ()


def greedy_job(out_root: Path, name: str) -> GenerationJob:
    """The sweep's (and the held-out table's) file of one model: one greedy conversation per question, no pool."""
    generation = GenerationSettings(checkpoint_iteration(name), 0.0, 1, use_prompt_pool=False, stage="eval")
    return GenerationJob("eval", out_root / f"{name}.jsonl", generation)


def checkpoint_iteration(name: str) -> int:
    """The iteration number in a checkpoint name (``iteration_3`` -> 3); -1 for the base model and others."""
    number = name.rpartition("_")[2]
    return int(number) if name != "base" and number.isdigit() else -1


def prepare_output(recipe: InferenceRecipe) -> Path:
    """Create the output folder, save the recipe there and log the driver to ``logs/driver.log``."""
    out_root = Path(recipe.output_root_path)
    out_root.mkdir(parents=True, exist_ok=True)
    save_recipe(recipe, out_root / "recipe.yaml")
    attach_driver_log(out_root / "logs" / "driver.log")
    return out_root


def load_eval_examples(recipe: InferenceRecipe) -> list[Example]:
    """The fixed eval set: the task's eval split at its default size, then ``limit`` questions of it (a seeded
    sample stratified by the questions' groups, or with ``limit_mode: first`` the first ones)."""
    examples = get_task(recipe.dataset_type).load_eval(data_dir=recipe.data_dir, seed=recipe.seed)
    if not recipe.limit or recipe.limit >= len(examples):
        return examples
    if recipe.limit_mode == "first":
        kept = examples[: recipe.limit]
    else:
        groups = [f"{example.task}/{example.group}" for example in examples]
        kept = [examples[i] for i in stratified_indices(groups, recipe.limit, recipe.seed)]
    logger.warning(
        "limit %d (%s): %d of %d eval questions, %d of %d groups; a debugging aid, not a benchmark result",
        recipe.limit,
        "the first ones" if recipe.limit_mode == "first" else f"a stratified sample, seed {recipe.seed}",
        len(kept),
        len(examples),
        len({(e.task, e.group) for e in kept}),
        len({(e.task, e.group) for e in examples}),
    )
    return kept


def describe_limit(recipe: InferenceRecipe) -> str | None:
    """``limit`` in words for the plans (None without a limit)."""
    if not recipe.limit:
        return None
    if recipe.limit_mode == "first":
        return f"the first {recipe.limit}"
    return f"{recipe.limit} (a seeded sample stratified by the task's groups, seed {recipe.seed}; a debugging aid)"


def load_results(out_path: Path, cluster_f1: float = 0.9) -> list[dict]:
    """The rows of a result file, each answer as the current parser reads it (a debate voted again)."""
    records, _ = load_records(out_path)
    return [reparsed_debate(r, cluster_f1) if "debate" in r else reparsed(r) for r in records]


def pending_count(out_path: Path, examples: Sequence[Example], samples: int) -> int:
    """How many ``(question, sample)`` records ``out_path`` still lacks (failed ones count as missing)."""
    records, _ = load_records(out_path)
    done = {record_key(r) for r in records if r.get("status") != "error"}
    return sum((example.id, k) not in done for example in examples for k in range(samples))


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


def model_fingerprint(recipe: Recipe, model_path: Path, examples: Sequence[Example]) -> dict:
    """The parts of a fingerprint every job of one model shares: weights, tokenizer, questions (built once)."""
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


def producer_fingerprint(recipe: Recipe, job: GenerationJob, examples: Sequence[Example], shared: dict) -> dict:
    """The fingerprint of ``job``'s file when the model of ``shared`` (``model_fingerprint``) produces it."""
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
    """Make ``out_path`` a file of this producer (its sidecar written before any row); True when rows of another
    producer (or of one that recorded none) were moved to ``superseded/``."""
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


class EvalSession:
    """Serves models one at a time, only when one of their result files is incomplete: with ``server`` (a training
    run's servers, the held-out evaluation), else by ``optima.serving.serve`` with ``envs["vllm"]``."""

    def __init__(
        self,
        recipe: Recipe,
        envs: dict[str, PythonEnv],
        examples: Sequence[Example],
        out_root: Path,
        server: ServeModel | None = None,
    ):
        self.recipe, self.envs, self.examples = recipe, envs, list(examples)
        self.out_root, self.server = Path(out_root), server
        self.servers_started = 0
        self._env_checked = bool(recipe.endpoints) or server is not None  # external or given servers: no vLLM env

    def run(self, name: str, model_path: Path, jobs: Sequence[GenerationJob]) -> dict[str, dict]:
        """Fill every incomplete file of ``jobs`` with ``model_path`` served (files of another producer moved aside
        first); return each job's generation stats. A model whose files are complete starts no server."""
        shared = model_fingerprint(self.recipe, model_path, self.examples)  # hashes the weights once per model
        for job in jobs:
            claim_result_file(job.out_path, producer_fingerprint(self.recipe, job, self.examples, shared))
        todo = [job for job in jobs if pending_count(job.out_path, self.examples, job.generation.samples)]
        if not todo:
            logger.info("%s | skip: %d result files complete, no server started", name, len(jobs))
            return {}
        if not self._env_checked:
            check_env(self.envs["vllm"], "vllm")
            self._env_checked = True
        stats = {}
        logger.info("%s | serve %s | %s", name, model_path, ", ".join(job.label for job in todo))
        with self._serve(name, model_path) as endpoints:
            self.servers_started += 1
            for job in todo:
                result = job.generate(self.recipe, self.examples, endpoints, job.out_path, job.generation)
                stats[job.label] = result.to_dict()
        return stats

    def _serve(self, name: str, model_path: Path) -> AbstractContextManager:
        if self.server is not None:
            return self.server(name, model_path)
        return serve(self.recipe, model_path, self.envs.get("vllm"), StagePaths(self.out_root / name))


class RecordScorers:
    """The ``RecordScorer`` of each evaluated model: its tokenizer loaded once (F1 tasks only, for
    ``f1_original_subword``), one shared ``MathVerifier``."""

    def __init__(self, recipe: Recipe, verifier: MathVerifier):
        self.recipe, self.verifier = recipe, verifier
        self.score_type = get_task(recipe.dataset_type).score_type
        self._scorers: dict[str, RecordScorer] = {}

    def __call__(self, model_path: Path) -> RecordScorer:
        key = str(model_path)
        if key not in self._scorers:
            tokenize = None
            if self.score_type == "f1":
                from transformers import AutoTokenizer

                path = tokenizer_path(self.recipe, model=str(model_path))
                tokenize = AutoTokenizer.from_pretrained(path).tokenize
            self._scorers[key] = RecordScorer(tokenize, self.verifier)
        return self._scorers[key]
