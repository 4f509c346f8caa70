"""What ``inference_script.py`` and ``multi_sc_data_generate_script.py`` would do, without doing it.

docs/method.md#checkpoint-sweep: every finished ``iteration_*`` checkpoint under the root (of the run's current lineage
when the root is a run's ``checkpoints`` folder), in numeric order, is served and run
greedily on the eval split (one conversation per question, no prompt pool). docs/method.md#self-consistency: one model,
k samples per question.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from optima.config import InferenceRecipe, MultiSCRecipe
from optima.environments import PythonEnv
from optima.evaluation.runs import describe_limit
from optima.lineage import lineage_checkpoints

if TYPE_CHECKING:
    from optima.config import Recipe


def list_models(recipe: InferenceRecipe) -> list[tuple[str, Path]]:
    """(name, path) of every model to evaluate: ``base`` first when asked, then the checkpoints."""
    models = lineage_checkpoints(Path(recipe.model_root_path))
    if recipe.include_base and recipe.initial_model_path:
        models.insert(0, ("base", Path(recipe.initial_model_path)))
    return models


def describe_serving(recipe: Recipe) -> str:
    """Where the models are served: the external endpoints, or the GPUs of the vLLM replicas."""
    if recipe.endpoints:
        return f"endpoints {', '.join(recipe.endpoints)} (endpoint_sync: {recipe.endpoint_sync})"
    gpus = "all visible" if recipe.devices is None else str(recipe.devices)
    return f"GPUs {gpus}, one replica per {recipe.tensor_parallel_size} (one CPU replica without a GPU)"


def render_dry_run(recipe: InferenceRecipe | MultiSCRecipe, envs: dict[str, PythonEnv]) -> str:
    """What ``--dry-run`` prints for a sweep or a self-consistency run."""
    sc = isinstance(recipe, MultiSCRecipe)
    models = list_models(recipe)
    questions = describe_limit(recipe) or "default eval size (1000 or the test split)"
    sampling = (
        f"{recipe.num_samples} conversations per question at temperature {recipe.sc_temperature}"
        if sc
        else "1 conversation per question, greedy (temperature 0), no prompt pool"
    )
    lines = [
        f"Optima {'self-consistency' if sc else 'evaluation'} plan: {recipe.dataset_type}",
        f"  models under {recipe.model_root_path}: {len(models)}",
        f"  vllm env: {envs['vllm'].describe()}",
        f"  questions: {questions} of the eval split (data: {recipe.data_dir or 'hub'})",
        f"  sampling: {sampling}",
        f"  serving: {describe_serving(recipe)}",
        f"  output: {recipe.output_root_path}",
    ]
    if not models:
        lines.append("  WARNING: no iteration_<k> checkpoint and no model folder found")
    for name, path in models:
        lines.append(f"  [{name}] serve {path} -> {Path(recipe.output_root_path) / (name + '.jsonl')}")
    return "\n".join(lines)
