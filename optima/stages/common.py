"""What the SFT and DPO stages share: the context a stage is called with, the question slices, the LM-loss scorer,
the MATH verifier, and the train stage.

Every stage function takes one ``StageCall`` (the stage tables of ``optima.plan`` list them), built as the dry-run
builds the one it describes the stage from, and returns a small JSON-able result that the iteration's manifest
records.

``train_checkpoint`` is the whole train stage of either method: a finished checkpoint is reused, a partial one (a
killed run) is deleted except the trainer's resumable ``checkpoint-N`` states, the trainer YAML is rendered from the
recipe's base YAML, the servers give their resources back (training needs the cores or the GPU memory; a policy
kept idle on the CPU keeps its memory, so the trainer's peak is estimated on the stage's rows first and the policy
is stopped instead when that does not fit), the YAML is written, TRL runs under accelerate (a progress bar on the
console unless ``--quiet``), and the result is what the trainer wrote with its completion marker.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from optima.config.rules import loss_model, trainer_base_yaml, trainer_overrides_for
from optima.evaluation.metrics import TIMEOUTS
from optima.hardware.placement import loss_server_wanted
from optima.methods import TrainerKind
from optima.paths import StagePaths
from optima.run_context import RunContext
from optima.tasks import select_questions as slice_questions
from optima.tracking import trainer_env, trainer_overrides
from optima.training.checkpoint import clear_partial_output
from optima.training.common import is_complete, read_completion
from optima.training.launch import console_stream, run_training
from optima.training.launch_config import TrainLaunch, launch_for, render_trainer_config, write_trainer_config

if TYPE_CHECKING:
    from optima.config import LoopRecipe

logger = logging.getLogger(__name__)

ScoreTexts = Callable[[Sequence[str]], list[float]]
CHECKPOINT = "checkpoint"  # the output name of a train stage (every other output is a ``StagePaths`` attribute)
TRAINER_LOGS = "trainer logs"  # the train stage's TensorBoard events (``RunPaths.trainer_logs``)


@dataclass(frozen=True, kw_only=True)
class StageCall:
    """The context of one stage: the run, where its part runs, the model it starts from, the earlier results.

    One of the two context objects (the other is the run's ``RunContext``). It is frozen: the pipeline builds one
    for each stage it runs (``optima.plan.PlanPart.stage_call``), from the run, the part's description, the model
    the part really starts from and the results of the stages before it, which the pipeline keeps itself; the
    dry-run describes each stage from one built the same way. The recipe is the run's: ``call.ctx.recipe``.

    Args:
        ctx: The run (recipe, paths, environments, hardware, servers).
        iteration: The iteration.
        part: ``sft`` or ``dpo`` within an iSFT-DPO iteration, else None.
        model: The model this part starts from: it is served for sampling, and training starts from it
            (``optima.config.rules.train_start``).
        sp: The part's folder.
        out: The part's checkpoint.
        results: The results of the part's earlier stages, by name (a read-only copy).
    """

    ctx: RunContext
    iteration: int
    part: str | None
    model: str
    sp: StagePaths
    out: Path
    results: Mapping[str, dict] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A copy behind a read-only view: a stage reads the results before it, and nothing changes them under it.
        object.__setattr__(self, "results", MappingProxyType(dict(self.results)))

    def output(self, name: str) -> Path:
        """A stage output by name: ``checkpoint``, ``trainer logs`` or a ``StagePaths`` attribute (``generations``,
        ``dataset``...)."""
        if name == TRAINER_LOGS:
            return self.ctx.paths.trainer_logs(self.sp)
        return self.out if name == CHECKPOINT else getattr(self.sp, name)


def training_questions(ctx: RunContext, iteration: int, stage: str, count: int | None = None):
    """This iteration's slice of the training split, derived from (seed, iteration, stage).

    See docs/method.md#question-slices.

    Args:
        ctx: The run.
        iteration: The iteration.
        stage: ``sft``, ``probe`` or ``search`` (independent slices).
        count: Questions wanted (default ``sample_count``).
    """
    recipe = ctx.recipe
    examples = ctx.task.load_train(data_dir=recipe.data_dir, seed=recipe.seed)
    return slice_questions(examples, recipe.sample_count if count is None else count, recipe.seed, iteration, stage)


def served_loss_scorer(ctx: RunContext, urls: list[str]) -> ScoreTexts:
    """Mean LM loss of each text from vLLM servers of the loss model at ``urls``."""
    from optima.lm_loss import VLLMLossScorer

    return VLLMLossScorer(urls, ctx.recipe.served_model_name, ctx.tokenizer(), ctx.recipe).score


def built_on_first_use(build: Callable[[], ScoreTexts]) -> ScoreTexts:
    """A scorer that is built (its server started or waited for) only when something is left to score.

    A build that failed is not tried again by every later call (each would wait for a server start): they raise.
    """
    built: list[ScoreTexts] = []
    failed: list[Exception] = []
    lock = threading.Lock()

    def score(texts: Sequence[str]) -> list[float]:
        with lock:
            if failed:
                raise RuntimeError(f"the LM-loss scorer could not be built: {failed[0]}") from failed[0]
            if not built:
                try:
                    built.append(build())
                except Exception as exc:
                    failed.append(exc)
                    raise
        return built[0](texts)

    return score


def loss_route(recipe: LoopRecipe, loss_server: bool, served: str | None, keep_served: bool) -> str:
    """How a stage scores LM losses (``loss_scorer``, and what ``--dry-run`` says): ``off``, ``loss server`` (the
    run's vLLM server beside the policy), ``served`` (a vLLM server of the loss model: started in place of the
    policy, or the policy's own when it serves the loss model) or ``in process`` (transformers in the driver).

    Args:
        recipe: ``cal_ppl``, ``loss_backend`` and the loss model.
        loss_server: The run keeps a loss server.
        served: The model the policy servers hold when the stage scores (None: none yet).
        keep_served: The stage still needs the policy (the tree search).
    """
    if not recipe.cal_ppl:
        return "off"
    if recipe.loss_backend == "vllm" and loss_server:
        return "loss server"
    if recipe.loss_backend == "vllm" and (not keep_served or str(served) == str(loss_model(recipe))):
        return "served"
    return "in process"


def describe_loss(recipe: LoopRecipe, served: str | None, keep_served: bool) -> str:
    """What ``--dry-run`` says about a stage's LM losses (``loss_route`` with the run's planned loss server)."""
    route, model = loss_route(recipe, loss_server_wanted(recipe), served, keep_served), loss_model(recipe)
    return {
        "off": "off (cal_ppl: false)",
        "loss server": f"{model} on the run's vLLM loss server beside the policy",
        "served": f"{model} on the policy's own vLLM server (it serves the loss model)"
        if keep_served
        else f"{model} on a vLLM server started in place of the policy after generation",
        "in process": f"{model} with transformers in the driver process (fp32, on the CPU: one forward per text; "
        "for a large model set loss_placement: beside, which serves it with vLLM)",
    }[route]


def loss_scorer(ctx: RunContext, sp: StagePaths, keep_served: bool = False) -> ScoreTexts | None:
    """The LM-loss function of the recipe (mean NLL of each text under the loss model), or None without the term.

    Args:
        ctx: The run.
        sp: The stage folder (logs of a server started for the loss model).
        keep_served: The stage still needs the model being served (the tree search).

    With the vLLM backend the loss is scored on the run's loss server beside the policy (``loss_placement:
    beside``); else (``after``, or external endpoints) on a server of the loss model, started in place of the
    policy unless ``keep_served``, when it is used only if the policy is the loss model. Otherwise the HF backend
    runs in this process (stopping the servers first unless ``keep_served``: it needs the cores or the memory).
    """
    recipe = ctx.recipe
    route = loss_route(recipe, ctx.servers.loss is not None, ctx.servers.model, keep_served)
    if route == "off":
        return None
    model = loss_model(recipe)
    if route == "loss server":
        return built_on_first_use(lambda: served_loss_scorer(ctx, ctx.servers.loss_urls()))
    if route == "served":
        return built_on_first_use(lambda: served_loss_scorer(ctx, ctx.servers.serve(model, sp)))
    from optima.lm_loss import HFLossScorer

    if not keep_served:
        ctx.servers.release_for_training()  # the in-process scorer needs the cores / memory, as training does
    logger.info("loss | %s scored with transformers in this process (loss_backend %s)", model, recipe.loss_backend)
    return HFLossScorer(model, ctx.tokenizer(), recipe.loss_batch_size).score


def math_verifier(ctx: RunContext):
    """One symbolic checker of MATH answers for a whole stage (its worker pool shared by every conversation).

    A context manager yielding a ``MathVerifier``, or None for tasks that need none (no worker processes then).
    """
    if ctx.task.score_type != "math":
        return contextlib.nullcontext(None)
    from optima.tasks.math_equiv import MathVerifier

    return MathVerifier()


def verifier_stats(verifier) -> dict:
    """A stage result's count of symbolic MATH checks that timed out on every try (scored 0); {} without a verifier.

    The count covers this process's checks: a stage resumed after a kill does not know the killed run's.
    """
    return {} if verifier is None else {TIMEOUTS: verifier.timeouts}


def trainer_launch(call: StageCall, kind: TrainerKind) -> TrainLaunch:
    """The trainer process of the part's train stage: its environment, trainer YAML and placement."""
    ctx = call.ctx
    return launch_for(ctx.recipe, kind, ctx.envs["train"], call.sp.trainer_yaml, ctx.gpu, ctx.hardware.training)


def iteration_values(call: StageCall, kind: TrainerKind, start: str) -> dict[str, Any]:
    """The trainer YAML values of this iteration: model, data, output, seed, the run's trackers and a run name
    (``optima.tracking``), and the ``gradient_accumulation_steps`` that keeps the released global batch on the
    planned processes (``optima.hardware``; only where it differs from the YAML's)."""
    ctx, sp = call.ctx, call.sp
    values = {"model_name_or_path": start, "dataset_name": str(sp.dataset), "output_dir": str(call.out)}
    values |= {"seed": call.ctx.recipe.seed + call.iteration}
    values |= trainer_overrides(ctx.report_to, ctx.paths.output_dir, sp.root)
    if kind in ctx.hardware.accumulation:
        values["gradient_accumulation_steps"] = ctx.hardware.accumulation[kind]
    return values


def train_checkpoint(
    call: StageCall,
    kind: TrainerKind,
    start: str,
    overrides: dict[str, Any] | None = None,
    check: Callable[[dict[str, Any]], None] | None = None,
) -> dict:
    """Fine-tune ``start`` into the part's checkpoint; the checkpoint is complete once its marker is written.

    Args:
        call: The train stage's call (its dataset, trainer YAML and log are in ``call.sp``).
        kind: ``sft`` or ``dpo`` (the base YAML and the handbook script).
        start: The model training starts from (``optima.config.rules.train_start``).
        overrides: More trainer YAML values of this method (``None`` deletes a key).
        check: Validates the rendered trainer YAML before anything is written.
    """
    ctx, recipe, sp, out = call.ctx, call.ctx.recipe, call.sp, call.out
    if is_complete(out):
        return read_completion(out)
    clear_partial_output(out)  # a killed run's files go; its resumable trainer checkpoints (checkpoint-N) stay
    base = trainer_base_yaml(recipe, kind)
    values = iteration_values(call, kind, start) | (overrides or {})
    config = render_trainer_config(Path(base), values, trainer_overrides_for(recipe, kind))
    if check is not None:
        check(config)
    ctx.servers.release_for_training(trainer=True)
    write_trainer_config(config, sp.trainer_yaml)
    launch = trainer_launch(call, kind)
    label = f"train iteration {call.iteration + 1}" + (f" {call.part}" if call.part else "")
    env = trainer_env(ctx.report_to, ctx.paths.output_dir, sp.root)
    run_training(launch, sp.train_log, env, console_stream(ctx.progress), label)
    return read_completion(out) | {"model": start}
