"""Typed recipes for the three training loops and the two evaluation scripts.

One dataclass per method, loaded from YAML by ``load_recipe`` and validated before anything starts (the
vLLM ``validate_parsed_serve_args`` principle): unknown keys (with a "did you mean"), wrong types,
out-of-range values, unknown dataset types and missing input paths all raise one ``RecipeError`` naming the
file, the field and the value. Precedence is dataclass default < YAML < ``--set key=value``.

Every key of the released Optima recipes is accepted: ``load_recipe`` (``optima.config.loading``) reads their
misspellings (``initial_episilon``) through ``ALIASES``, which warns; our own names are spelled right. Every
hard-coded number of the method (docs/method.md D10) is a field with that number as its default. ``seed`` drives
every random choice.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any, ClassVar, Literal

from optima.config.defaults import default_mcts_selections, default_output_dir
from optima.config.fields import (
    RecipeError,
    field,
    is_hub_id,
    require,
    resolve_path,
)
from optima.config.groups import (
    DATA_DIR_ENV,
    PROBED,
    TRAINED,
    ConversationFields,
    GenerationFields,
    LoopFields,
    RewardFields,
    RunFields,
    ServingFields,
)
from optima.config.training_groups import DPOFields, SFTFields, TrainingFields
from optima.methods import DPO, SFT, SFT_DPO

logger = logging.getLogger(__name__)

__all__ = [
    "DATA_DIR_ENV",
    "RecipeError",
    "BaseRecipe",
    "LoopRecipe",
    "SFTRecipe",
    "DPORecipe",
    "SFTDPORecipe",
    "InferenceRecipe",
    "MultiSCRecipe",
]

# The released prompt-pool files (not shipped here); a recipe naming one that is not on disk gets our built-in pool.
ORIGINAL_POOLS = (
    "prompts_diverse.jsonl",
    "prompts_arc_first.jsonl",
    "prompts_gsm8k_first.jsonl",
    "prompts_math_first.jsonl",
)


def known_tasks() -> dict[str, str]:
    """Dataset names the recipes accept, mapped to their canonical name (aliases included)."""
    from optima.tasks import TASK_ALIASES, TASKS

    return {name: name for name in TASKS} | dict(TASK_ALIASES)


@dataclasses.dataclass(kw_only=True)
class BaseRecipe(RunFields, ServingFields, ConversationFields):
    """What every recipe has, loop or evaluation: the run's task and model, its servers and its conversations.

    Parameters:
        dataset_type (`str`): Task name (`hotpot_qa`, `mwh_qa`, `trival_qa`, `cbt`, `gsm8k`, `math`, `arc`, `mmlu`).
        initial_model_path (`str`): Base model: a hub id (`org/name`) or a local folder (`./models/...`).
        output_dir (`str`, *optional*): Run directory; default `runs/<dataset_type>_<method>`.
        seed (`int`, defaults to `42`): Seed of every random choice.
    """

    # class attribute: keys this method accepts and ignores (released recipes' keys, the loops' keys in evaluation)
    unused_keys: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        tasks = known_tasks()
        require(
            self.dataset_type in tasks,
            "dataset_type",
            f"unknown task {self.dataset_type!r}; known: " + ", ".join(sorted(tasks)),
        )
        self.dataset_type = tasks[self.dataset_type]
        self.check_run()
        if self.data_dir is None:
            self.data_dir = os.environ.get(DATA_DIR_ENV) or None
        if self.output_dir is None:
            self.output_dir = default_output_dir(self)
        for name in ("data_dir", "output_dir", *self.folder_fields(), *self.path_fields()):
            setattr(self, name, resolve_path(getattr(self, name), name))
        for name in self.model_fields():  # hub ids stay as they are
            value = getattr(self, name)
            if value and not is_hub_id(value):
                setattr(self, name, resolve_path(value, name))
        ServingFields.validate(self)
        ConversationFields.validate(self)

    def check_run(self) -> None:
        """Checks of a method's own fields that come before the paths are resolved (none here)."""

    def folder_fields(self) -> tuple[str, ...]:
        """Names of output-folder fields besides ``data_dir`` and ``output_dir`` (resolved to absolute paths)."""
        return ()

    def path_fields(self) -> tuple[str, ...]:
        """Names of the recipe's local input-file fields (resolved to absolute paths and checked)."""
        return ()

    def model_fields(self) -> tuple[str, ...]:
        """Names of the fields that take a model or tokenizer: a hub id or a local folder."""
        return ("initial_model_path", "tokenizer_first_path", "tokenizer_second_path")

    def input_paths(self) -> dict[str, str]:
        """Every local input the run reads, by field name (hub ids excluded)."""
        names = (*self.model_fields(), "data_dir", *self.path_fields())
        values = {n: getattr(self, n) for n in names}
        return {n: v for n, v in values.items() if v and not is_hub_id(v)}

    def missing_inputs(self) -> dict[str, str]:
        """The inputs of ``input_paths`` that do not exist."""
        return {n: p for n, p in self.input_paths().items() if not Path(p).exists()}

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (saved as ``run_dir/recipe.yaml``)."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(kw_only=True)
class LoopRecipe(TrainingFields, RewardFields, LoopFields, BaseRecipe, GenerationFields):
    """What the three training loops share: iterations, sampling, the reward and the trainer launch.

    The order of the bases is the order of the fields (last base first): sampling, conversation, serving, run, loop,
    reward, training, then the method's own, as in the recipe key reference.
    """

    def check_run(self) -> None:
        require(self.iteration_times >= 1, "iteration_times", f"must be >= 1, got {self.iteration_times}")
        pool = self.prompt_pool_path
        if pool and Path(pool).name in ORIGINAL_POOLS and not Path(pool).exists():
            logger.warning("prompt_pool_path %s is the released Optima pool (not here); using the built-in pool", pool)
            self.prompt_pool_path = None

    def folder_fields(self) -> tuple[str, ...]:
        return ("check_point_root_path",)

    def path_fields(self) -> tuple[str, ...]:
        return ("prompt_pool_path", "train_hostfile")

    def model_fields(self) -> tuple[str, ...]:
        return (*BaseRecipe.model_fields(self), "loss_model_path")

    def validate_loop(self) -> None:
        """The checks of the groups every loop has (after ``BaseRecipe.__post_init__``)."""
        GenerationFields.validate(self)
        LoopFields.validate(self)
        RewardFields.validate(self)


@dataclasses.dataclass(kw_only=True)
class SFTRecipe(SFTFields, LoopRecipe):
    """iSFT (docs/method.md#isft): generate, reward, keep the best conversations, fine-tune, repeat."""

    method = SFT

    def __post_init__(self) -> None:
        BaseRecipe.__post_init__(self)
        self.validate_loop()
        SFTFields.validate(self)

    def path_fields(self) -> tuple[str, ...]:
        return (*LoopRecipe.path_fields(self), "origin_yaml_path")


@dataclasses.dataclass(kw_only=True)
class DPORecipe(DPOFields, LoopRecipe):
    """iDPO (docs/method.md#idpo): token-quantile probe, tree search for preference pairs, DPO (+NLL), repeat."""

    method = DPO
    # The released iDPO recipes carry SFT keys that iDPO never reads.
    unused_keys = ("initial_epsilon",)

    def __post_init__(self) -> None:
        if self.mcts_selections is None:
            self.mcts_selections = default_mcts_selections(self.method, self.explore_count)
        BaseRecipe.__post_init__(self)
        self.validate_loop()
        DPOFields.validate(self)

    def path_fields(self) -> tuple[str, ...]:
        return (*LoopRecipe.path_fields(self), "origin_dpo_yaml_path")


@dataclasses.dataclass(kw_only=True)
class SFTDPORecipe(DPOFields, SFTFields, LoopRecipe):
    """iSFT-DPO (docs/method.md#isft-dpo): a full iSFT iteration, then a DPO stage on the new checkpoint, repeated."""

    # Where iSFT-DPO differs from iDPO: plain sigmoid DPO, and the P80 token quantile.
    rpo_alpha: float | None = field(
        None, help="weight of the NLL term on chosen; null = plain sigmoid DPO", redoes=TRAINED
    )
    token_quantile: float = field(
        0.8, help="T_max of the tree search = this quantile of probe token counts", redoes=PROBED
    )

    method = SFT_DPO

    def __post_init__(self) -> None:
        if self.mcts_selections is None:
            self.mcts_selections = default_mcts_selections(self.method, self.explore_count)
        BaseRecipe.__post_init__(self)
        self.validate_loop()
        SFTFields.validate(self)
        DPOFields.validate(self)

    def path_fields(self) -> tuple[str, ...]:
        return (*LoopRecipe.path_fields(self), "origin_yaml_path", "origin_dpo_yaml_path")


@dataclasses.dataclass(kw_only=True)
class InferenceRecipe(BaseRecipe):
    """Checkpoint sweep: greedy, one conversation per question, every ``iteration_*`` checkpoint.

    See docs/method.md#checkpoint-sweep.

    Parameters:
        model_root_path (`str`): Folder holding `iteration_<k>` checkpoints (or one model folder).
        limit (`int`, *optional*): Evaluate only N questions of the eval set: a seeded sample stratified by the
            task's groups (``limit_mode: sample``), or the first N (``limit_mode: first``). A debugging aid.
        limit_mode (`str`): ``sample`` (default) or ``first``.
        include_base (`bool`): Also evaluate `initial_model_path`.
    """

    initial_model_path: str | None = field(None, help="base model, evaluated as 'base' with include_base")
    model_root_path: str = field(help="folder of iteration_<k> checkpoints, or one model folder")
    output_root_path: str | None = field(None, help="where <checkpoint>.jsonl and summaries go")
    limit: int | None = field(
        None,
        help="evaluate N questions of the eval set, a debugging aid (default: 1000 for information exchange, all "
        "for debate)",
    )
    limit_mode: Literal["sample", "first"] = field(
        "sample",
        help="which N questions limit keeps: a seeded sample stratified by the task's groups, or the first N",
    )
    include_base: bool = field(False, help="also evaluate initial_model_path as 'base'")

    # The loops' keys, accepted (a loop's recipe may be reused) and ignored with a warning: evaluation samples
    # greedily (or at sc_temperature), without the pool, once per checkpoint.
    unused_keys = (
        *(f.name for f in dataclasses.fields(GenerationFields)),
        *(f.name for f in dataclasses.fields(LoopFields)),
    )
    method = "inference"

    def __post_init__(self) -> None:
        self.model_root_path = resolve_path(self.model_root_path, "model_root_path")
        self.output_root_path = resolve_path(self.output_root_path, "output_root_path") or str(
            Path(self.model_root_path) / "eval"
        )
        BaseRecipe.__post_init__(self)
        require(self.limit is None or self.limit >= 1, "limit", f"must be >= 1, got {self.limit}")

    def input_paths(self) -> dict[str, str]:
        return BaseRecipe.input_paths(self) | {"model_root_path": self.model_root_path}


@dataclasses.dataclass(kw_only=True)
class MultiSCRecipe(InferenceRecipe):
    """Multi-agent self-consistency: k samples per question at a temperature, then voting.

    See docs/method.md#self-consistency.
    """

    num_samples: int = field(50, help="conversations per question (k)")
    sc_temperature: float = field(0.5, help="sampling temperature")
    cluster_f1: float = field(0.9, help="answers with F1 >= this join one vote cluster (F1 tasks)")

    method = "multi_sc"

    def __post_init__(self) -> None:
        InferenceRecipe.__post_init__(self)
        require(self.num_samples >= 1, "num_samples", f"must be >= 1, got {self.num_samples}")
        require(0 <= self.sc_temperature <= 2, "sc_temperature", f"must be in [0, 2], got {self.sc_temperature}")
