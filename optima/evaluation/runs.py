"""What the checkpoint sweep and the self-consistency run share: the eval set, the output folder, and
"serve this model only if something is left to generate" (docs/method.md#evaluation).

The eval set is fixed: the first N questions of the task's eval split (1000 for the information-exchange
tasks, the whole test split for debate tasks, capped by the data), with contexts split by ``seed``; ``limit``
keeps a seeded sample of it stratified by the questions' groups (``limit_mode: first``: its first questions), a
debugging aid that the log says is no benchmark result. A result file is complete when every ``(question,
sample)`` of that set has a record other than ``error``; a model whose files are all complete is not served again.
Each file records what produced it (``optima.evaluation.fingerprint``): a file of another producer is moved aside
and generated anew, never resumed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from optima.agents.generation import generate_conversations
from optima.agents.runner import GenerationSettings
from optima.config import save_recipe
from optima.config.rules import tokenizer_path
from optima.environments import PythonEnv, check_env
from optima.evaluation.debate import reparsed_debate
from optima.evaluation.fingerprint import claim_result_file, model_fingerprint, producer_fingerprint
from optima.evaluation.metrics import RecordScorer
from optima.logging_utils import attach_driver_log
from optima.paths import StagePaths
from optima.store import load_records, record_key
from optima.tasks import Example, get_task
from optima.tasks.math_equiv import MathVerifier
from optima.tasks.reparse import reparsed
from optima.tasks.sampling import stratified_indices

if TYPE_CHECKING:
    from optima.config import InferenceRecipe, Recipe

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationJob:
    """One result file to fill for a served model.

    Args:
        label: Method label for logs (``eval``, ``optima_sc``, ``cot``, ``cot_sc``).
        out_path: The JSONL result file.
        generation: Temperature and samples per question.
        generate: ``generate_conversations`` or another function with its signature (the CoT baseline).
        params: The method's own parameters (MAD's agents, rounds, context), part of the file's fingerprint.
        prompts: Renders the texts the method sends for one question (its prompt version); None: Optima's
            two-agent conversation.
        reads: Recipe fields the method's generation reads besides the common ones (MAD's vote: ``cluster_f1``),
            part of the file's fingerprint.
    """

    label: str
    out_path: Path
    generation: GenerationSettings
    generate: Callable = generate_conversations
    params: dict = field(default_factory=dict)
    prompts: Callable[[Example], list] | None = None
    reads: tuple[str, ...] = ()


def prepare_output(recipe: InferenceRecipe) -> Path:
    """Create the output folder, save the recipe there and log the driver to ``logs/driver.log``."""
    out_root = Path(recipe.output_root_path)
    out_root.mkdir(parents=True, exist_ok=True)
    save_recipe(recipe, out_root / "recipe.yaml")
    attach_driver_log(out_root / "logs" / "driver.log")
    return out_root


def load_eval_examples(recipe: InferenceRecipe) -> list[Example]:
    """The fixed eval set: the task's eval split at its default size, then ``limit`` questions of it.

    ``limit_mode: sample`` keeps a seeded sample stratified by the questions' groups (sub-task and
    ``Example.group``: MMLU subject, MATH subject and level; uniform for the others), ``first`` the first ``limit``.
    """
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
    """The rows of a result file, each answer as the current parser reads it (``optima.tasks.reparse``).

    Args:
        out_path: A result file (conversations, CoT, AutoForm or debates).
        cluster_f1: The recipe's vote threshold, which a debate's majority uses.
    """
    records, _ = load_records(out_path)
    return [reparsed_debate(r, cluster_f1) if "debate" in r else reparsed(r) for r in records]


def pending_count(out_path: Path, examples: Sequence[Example], samples: int) -> int:
    """How many ``(question, sample)`` records ``out_path`` still lacks (failed ones count as missing)."""
    records, _ = load_records(out_path)
    done = {record_key(r) for r in records if r.get("status") != "error"}
    return sum((example.id, k) not in done for example in examples for k in range(samples))


def checkpoint_iteration(name: str) -> int:
    """The iteration number in a checkpoint name (``iteration_3`` -> 3); -1 for the base model and others."""
    number = name.rpartition("_")[2]
    return int(number) if name != "base" and number.isdigit() else -1


class EvalSession:
    """Serves models one at a time for an evaluation run, only when one of their files is incomplete.

    Args:
        recipe: The evaluation recipe (serving fields), or a loop's (held-out evaluation).
        envs: ``{"vllm": PythonEnv}``.
        examples: The eval set.
        out_root: Where the models' folders go (an evaluation's ``output_root_path``).
        server: ``(name, model folder)`` -> a context manager giving the URLs that serve it (a training run's
            servers); default: ``optima.serving.serve`` starts replicas for each model and stops them after.
    """

    def __init__(
        self,
        recipe: Recipe,
        envs: dict[str, PythonEnv],
        examples: Sequence[Example],
        out_root: Path,
        server: Callable[[str, Path], AbstractContextManager] | None = None,
    ):
        self.recipe, self.envs, self.examples = recipe, envs, list(examples)
        self.out_root = Path(out_root)
        self.server = server
        self.servers_started = 0
        self._env_checked = bool(recipe.endpoints) or server is not None  # external or given servers: no vLLM env

    def run(self, name: str, model_path: Path, jobs: Sequence[GenerationJob]) -> dict[str, dict]:
        """Fill every incomplete file of ``jobs`` with ``model_path`` served; return each job's generation stats.

        A model whose files are all complete is skipped without starting a server. A file that another producer
        wrote (``optima.evaluation.fingerprint``) is moved aside first.
        """
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
        from optima.serving import serve

        return serve(self.recipe, model_path, self.envs.get("vllm"), StagePaths(self.out_root / name))


def load_tokenize(recipe: Recipe, model_path: Path, score_type: str):
    """The model tokenizer's ``tokenize`` for ``f1_original_subword`` (F1 tasks only; None otherwise)."""
    if score_type != "f1":
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_path(recipe, model=str(model_path))).tokenize


class RecordScorers:
    """The ``RecordScorer`` of each evaluated model: its tokenizer loaded once per model (F1 tasks only), one
    shared ``MathVerifier``.

    Args:
        recipe: The evaluation recipe (task, tokenizer).
        verifier: The run's ``MathVerifier``.
    """

    def __init__(self, recipe: Recipe, verifier: MathVerifier):
        self.recipe, self.verifier = recipe, verifier
        self.score_type = get_task(recipe.dataset_type).score_type
        self._scorers: dict[str, RecordScorer] = {}

    def __call__(self, model_path: Path) -> RecordScorer:
        key = str(model_path)
        if key not in self._scorers:
            self._scorers[key] = RecordScorer(load_tokenize(self.recipe, model_path, self.score_type), self.verifier)
        return self._scorers[key]
