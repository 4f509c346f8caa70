"""One run and its parts: what every stage shares (``Run``), one iteration or iSFT-DPO part (``Part``), each stage's
settings, computed once: the stage runs them and ``--dry-run`` prints them (``stage_settings``), and where each
stage's LM losses are computed: ``loss_route`` decides it for the run and the dry run, ``loss_scorer`` scores there.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from optima.agents.conversation import GenerationSettings
from optima.agents.footprint import policy_demand
from optima.agents.generation import generation_settings
from optima.config import LoopRecipe
from optima.config.rules import (
    loss_model,
    selection_range,
    tokenizer_path,
    train_start,
    trainer_base_yaml,
    trainer_overrides_for,
)
from optima.environments import PythonEnv
from optima.hardware.allocation import HardwareAllocation, allocate_this_machine
from optima.hardware.machine import Hardware
from optima.hardware.placement import ServerLayout, loss_server_wanted
from optima.lineage import Manifest
from optima.lm_loss import HFLossScorer, VLLMLossScorer
from optima.methods import DPO, Stage, TrainerKind
from optima.paths import RunPaths, StagePaths
from optima.serving.holder import ServerHolder
from optima.tasks import Task, get_task
from optima.tasks.math_equiv import MathVerifier
from optima.tracking import trainer_overrides
from optima.training.launch_config import (
    TrainLaunch,
    describe_trainer_overrides,
    launch_for,
    method_values,
    render_trainer_config,
)

logger = logging.getLogger(__name__)

ScoreTexts = Callable[[Sequence[str]], list[float]]


@dataclass(kw_only=True)
class Run:
    """What every stage of a run shares, one per run (``build_run``; a dry run builds one and makes nothing): the
    recipe, its files, the environments, the hardware allocation, the servers, the task, the tokenizer, the trackers
    (``report_to``, resolved when the run starts) and whether training draws progress bars."""

    recipe: LoopRecipe
    paths: RunPaths
    envs: dict[str, PythonEnv]
    hardware: HardwareAllocation
    progress: bool = True
    report_to: list[str] = field(default_factory=list)

    @cached_property
    def servers(self) -> ServerHolder:
        """The policy server (one model at a time) and the loss server beside it; constructing it starts nothing."""
        recipe = self.recipe

        def demand(model: str):
            return policy_demand(recipe, self.task.load_train(data_dir=recipe.data_dir, seed=recipe.seed), model)

        return ServerHolder(
            recipe,
            self.envs.get("vllm"),
            loss_model(recipe),
            self.paths.driver_log.parent,
            layout=self.hardware.layout,
            demand=demand,
        )

    @cached_property
    def task(self) -> Task:
        return get_task(self.recipe.dataset_type)

    @cached_property
    def tokenizer(self) -> Any:
        """The initial model's tokenizer (token counts, LM-loss rendering, subword F1)."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer_path(self.recipe))

    def math_verifier(self) -> contextlib.AbstractContextManager:
        """One symbolic checker of MATH answers (one worker pool) for a whole stage; yields None for other tasks."""
        if self.task.score_type != "math":
            return contextlib.nullcontext(None)
        return MathVerifier()


def build_run(
    recipe: LoopRecipe, envs: dict[str, PythonEnv], hardware: Hardware | None = None, gpu: bool | None = None,
    progress: bool = True,
) -> Run:  # fmt: skip
    """The run of ``recipe`` on ``hardware`` (default: this machine; ``gpu=False``: this machine without its GPUs)."""
    if hardware is None and gpu is False:
        hardware = Hardware(1, 0, 0.0, source="no GPU")
    allocation = allocate_this_machine(recipe, hardware)
    return Run(recipe=recipe, paths=RunPaths.from_recipe(recipe), envs=envs, hardware=allocation, progress=progress)


@dataclass(frozen=True)
class Part:
    """One iteration, or one part of it (``name``: ``sft``/``dpo`` in iSFT-DPO): the stages of its ``trainer``, its
    folder and checkpoint (``out``), the model it samples from and trains, its manifest (None in the dry run)."""

    run: Run
    iteration: int
    name: str | None
    trainer: TrainerKind
    sp: StagePaths
    out: Path
    model: str
    manifest: Manifest | None = None

    @property
    def recipe(self) -> LoopRecipe:
        return self.run.recipe

    @property
    def label(self) -> str:
        """``iteration 1/2 | `` (with ``sft | `` in an iSFT-DPO part): what its log lines start with."""
        where = f"iteration {self.iteration + 1}/{self.run.recipe.iteration_times} | "
        return where + (f"{self.name} | " if self.name else "")


# Where a stage's LM losses are computed, and what --dry-run says of it.
LOSS_ROUTES = {
    "off": "off (cal_ppl: false)",
    "loss server": "{} on the run's vLLM loss server beside the policy",
    "policy": "{} on the policy's own vLLM server (it serves the loss model)",
    "search loss server": "{} on a vLLM loss server started with the tree search and stopped after it",
    "in place": "{} on a vLLM server started in place of the policy after generation",
    "in process": "{} with transformers in the driver process (fp32, on the CPU: one forward per text; for a large "
    "model set loss_placement: beside, which serves it with vLLM)",
}


@dataclass(frozen=True)
class LossRoute:
    """Where one stage computes its LM losses (``LOSS_ROUTES``) under which loss model; ``keeps_policy``: the stage
    still samples from the policy (the tree search), so nothing is stopped for the losses."""

    where: str
    model: str
    keeps_policy: bool = False

    def __str__(self) -> str:
        return LOSS_ROUTES[self.where].format(self.model)


def loss_route(recipe: LoopRecipe, layout: ServerLayout | None, stage: Stage, served: str) -> LossRoute:
    """Where ``stage`` computes its LM losses while the policy serves ``served`` (docs/method.md#reward): the run's
    loss server beside the policy when it keeps one; else generation scores none, the tree search (which still
    samples) scores on the policy when it serves the loss model, else on a loss server started for it where the layout
    placed one (``loss_placement: after`` on a GPU), and the score stage on a server started in place of the policy;
    with ``loss_backend: hf`` or nowhere to serve, with transformers in the driver."""
    model, search = loss_model(recipe), stage == Stage.SEARCH
    vllm = recipe.loss_backend == "vllm"
    if not recipe.cal_ppl:
        where = "off"
    elif vllm and loss_server_wanted(recipe):
        where = "loss server"
    elif stage == Stage.GENERATE:
        where = "off"  # scored after generation, by the score stage
    elif vllm and search and str(served) == model:
        where = "policy"
    elif vllm and search and layout is not None and layout.loss is not None and not layout.loss_resident:
        where = "search loss server"
    elif vllm and not search:
        where = "in place"
    else:
        where = "in process"
    return LossRoute(where, model, keeps_policy=search)


@contextlib.contextmanager
def loss_scorer(run: Run, route: LossRoute, sp) -> Iterator[ScoreTexts | None]:
    """The LM-loss function of ``route`` (mean NLL of each text under the loss model), or None when it is off.

    A vLLM scorer is built (its server waited for or started) only when something is left to score; a loss server
    started for the tree search stops when the block ends.
    """
    servers = run.servers
    if route.where == "off":
        yield None
    elif route.where == "search loss server":
        with servers.search_loss_server() as urls:
            yield built_on_first_use(lambda: served_loss_scorer(run, urls()))
    elif route.where != "in process":
        urls = {
            "loss server": servers.loss_urls,
            "policy": lambda: list(servers.urls),
            "in place": lambda: servers.serve(route.model, sp),
        }[route.where]
        yield built_on_first_use(lambda: served_loss_scorer(run, urls()))
    else:
        if not route.keeps_policy:
            servers.release_for_training()  # the in-process scorer needs the cores / memory, as training does
        backend = run.recipe.loss_backend
        logger.info("loss | %s scored with transformers in this process (loss_backend %s)", route.model, backend)
        yield HFLossScorer(route.model, run.tokenizer, run.recipe.loss_batch_size).score


def served_loss_scorer(run: Run, urls: list[str]) -> ScoreTexts:
    """Mean LM loss of each text from vLLM servers of the loss model at ``urls``."""
    return VLLMLossScorer(urls, run.recipe.served_model_name, run.tokenizer, run.recipe).score


def built_on_first_use(build: Callable[[], ScoreTexts]) -> ScoreTexts:
    """A scorer built (its server started or waited for) only on the first call; a build that failed is not tried
    again by every later call (each would wait for a server start): they raise."""
    built: list[ScoreTexts] = []
    failed: list[Exception] = []
    lock = threading.Lock()

    def score_texts(texts: Sequence[str]) -> list[float]:
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

    return score_texts


class CachedLoss:
    """Per-utterance LM losses, each text scored once (rollouts share most of their utterances)."""

    def __init__(self, score_texts: ScoreTexts):
        self.score_texts, self.cache, self.lock = score_texts, {}, threading.Lock()

    def __call__(self, texts: Sequence[str]) -> list[float]:
        with self.lock:
            missing = [t for t in dict.fromkeys(texts) if t not in self.cache]
        if missing:
            # Outside the lock: the trees score their rollouts concurrently (a text scored twice gets one value).
            scored = dict(zip(missing, self.score_texts(missing), strict=True))
            with self.lock:
                self.cache.update(scored)
        with self.lock:
            return [self.cache[t] for t in texts]


@dataclass(frozen=True)
class TrainJob:
    """A train stage's trainer: the handbook base YAML, the recipe's ``trainer_overrides`` of this trainer and this
    iteration's values on top (``config``), and the command that runs it (``launch``)."""

    base: str
    user: dict
    values: dict
    launch: TrainLaunch
    start: str

    def config(self) -> dict[str, Any]:
        """The trainer YAML (a warning for each base value an override replaces)."""
        return render_trainer_config(Path(self.base), self.values, self.user)


@dataclass(frozen=True)
class Settings:
    """One stage's settings, computed once: what it hands the engines (``generation``, ``loss``, ``train``) and, from
    the same values, what ``--dry-run`` prints of it (``show``)."""

    show: dict[str, Any]
    generation: GenerationSettings | None = None
    loss: LossRoute | None = None
    train: TrainJob | None = None


def train_settings(part: Part) -> Settings:
    """The train stage of ``part``: its trainer YAML's values and its launch."""
    run, recipe, sp, kind = part.run, part.recipe, part.sp, part.trainer
    start = train_start(recipe, part.model, part.name)
    values = {"model_name_or_path": start, "dataset_name": str(sp.dataset), "output_dir": str(part.out)}
    values |= {"seed": recipe.seed + part.iteration} | trainer_overrides(run.report_to, run.paths.output_dir, sp.root)
    if kind in run.hardware.accumulation:  # keeps the released global batch on the planned processes
        values["gradient_accumulation_steps"] = run.hardware.accumulation[kind]
    if kind == DPO:
        values |= method_values(recipe, kind)  # DPO + NLL on chosen (rpo_alpha None: plain DPO)
        method = {"model": start, "reference": start, "rpo_alpha": recipe.rpo_alpha}
    else:
        method = {"model": start, "trainer yaml": sp.trainer_yaml}
    launch = launch_for(recipe, kind, run.envs["train"], sp.trainer_yaml, run.hardware.hardware.has_gpu,
                        run.hardware.training)  # fmt: skip
    job = TrainJob(trainer_base_yaml(recipe, kind), trainer_overrides_for(recipe, kind), values, launch, start)
    overrides = describe_trainer_overrides(Path(job.base), job.user)
    show = {"base recipe": job.base, "trainer overrides": overrides, **method, "output": part.out}
    return Settings(show | {"command": launch.argv()}, train=job)


def stage_settings(part: Part) -> dict[Stage, Settings]:
    """Every stage's settings of ``part``, in the order they run: what the stages run and ``--dry-run`` prints."""
    recipe, sp, layout = part.recipe, part.sp, part.run.hardware.layout
    if part.trainer == DPO:
        probe = GenerationSettings(part.iteration, recipe.temperature, 1, use_prompt_pool=False, stage="probe")
        quantile = f"P{round(recipe.token_quantile * 100)} of their token counts"
        sizes = f"{recipe.mcts_selections} selections x {recipe.mcts_rollouts} rollouts, depth {recipe.max_turns}"
        search = loss_route(recipe, layout, Stage.SEARCH, part.model)
        searched = {"questions": recipe.monte_sample_count, "per question": sizes, "LM loss": str(search)}
        pairs = {"best child >": recipe.initial_dpo_epsilon, "best - worst >": recipe.initial_dpo_min_value}
        return {
            Stage.PROBE: Settings({"questions": recipe.probe_count, "T_max": quantile, "output": sp.probe}, probe),
            Stage.SEARCH: Settings(searched | {"output": sp.rollouts}, loss=search),
            Stage.PAIRS: Settings(pairs | {"dataset": sp.dataset}),
            Stage.TRAIN: train_settings(part),
        }
    g = generation_settings(recipe, part.iteration)
    generate = {
        "questions": f"{recipe.sample_count} (train split, slice from seed {recipe.seed})",
        "conversations per question": g.samples,
        "temperature": g.temperature,
        "prompt pool": (recipe.prompt_pool_path or "built-in") if g.use_prompt_pool else "off",
        "answer bootstrap": g.answer_bootstrap,
        "max turns / tokens per utterance": f"{recipe.max_turns} / {recipe.max_tokens}",
        "output": sp.generations,
    }
    loss = loss_route(recipe, layout, Stage.SCORE, part.model)
    reward = f"task score {recipe.lambda1:+} * tokens/T_max"
    reward += f" + {recipe.lambda2} / LM loss ({loss})" if loss.where != "off" else " (no LM-loss term)"
    select = {"best per question, ranks": selection_range(recipe), "epsilon": recipe.initial_epsilon}
    return {
        Stage.GENERATE: Settings(generate, g, loss_route(recipe, layout, Stage.GENERATE, part.model)),
        Stage.SCORE: Settings({"reward": reward, "output": sp.rewarded}, loss=loss),
        Stage.SELECT: Settings(select | {"dataset": sp.dataset}),
        Stage.TRAIN: train_settings(part),
    }
