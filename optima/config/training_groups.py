"""The training field groups: how a fine-tuning stage is launched (``TrainingFields``) and each trainer's part.

``SFTFields`` (iSFT's selection and trainer recipe) and ``DPOFields`` (the tree search, the preference pairs and
the DPO trainer) extend ``TrainingFields``; the checks of ``trainer_overrides`` (the trainer keys a recipe may set)
live here with them. The other field groups are in ``optima.config.groups``; ``optima.config.recipes`` composes
both into the method recipes.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, ClassVar, Literal

from optima.config.fields import field, require, require_in, require_positive
from optima.config.groups import PAIRED, PROBED, SEARCHED, SELECTED, TRAINED
from optima.config.trackers import parse_report_to
from optima.methods import METHODS, TRAINERS

# accelerate's multi-node flags: the hardware allocation sets them for each node it starts (train_hosts).
MULTI_NODE_FLAGS = ("--num_machines", "--machine_rank", "--main_process_ip", "--main_process_port", "--num_processes")


# The trainer keys the orchestrator sets itself (with the recipe field to use).
MANAGED_TRAINER_KEYS = {
    "model_name_or_path": "initial_model_path (each iteration starts from the previous checkpoint)",
    "dataset_name": "the iteration's training set",
    "output_dir": "output_dir / check_point_root_path",
    "seed": "seed (the trainer gets seed + iteration)",
    "report_to": "report_to",
    "run_name": "the run directory's name (one run name per iteration)",
    "rpo_alpha": "rpo_alpha",
}


# Scientific notation PyYAML (YAML 1.1) reads as a string: 2e-5, 1E3 (it wants 2.0e-5).
YAML11_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")


def yaml_numbers(overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` with ``2e-5``-style strings read as the floats a user means (``learning_rate=2e-5``)."""
    fixed = {}
    for key, value in overrides.items():
        if isinstance(value, dict):
            value = yaml_numbers(value)
        elif isinstance(value, str) and YAML11_FLOAT.match(value):
            value = float(value)
        fixed[key] = value
    return fixed


def check_trainer_overrides(overrides: dict[str, Any], kinds: tuple[str, ...]) -> None:
    """Validate ``trainer_overrides``: trainer keys, or ``sft:``/``dpo:`` mappings of the trainers the loop runs.

    Raises:
        RecipeError: a key the orchestrator sets (naming the recipe field to use), or a sub-mapping of a trainer
            the loop does not run.
    """
    for key, value in overrides.items():
        if key in TRAINERS:
            require(key in kinds, "trainer_overrides", f"{key}: this loop runs no {key} trainer (only {kinds})")
            require(isinstance(value, dict), "trainer_overrides", f"{key}: must be a mapping, got {value!r}")
            check_trainer_overrides(value, ())
            continue
        require(
            isinstance(key, str) and key not in MANAGED_TRAINER_KEYS,
            "trainer_overrides",
            f"{key!r} is set by the orchestrator; use {MANAGED_TRAINER_KEYS.get(key, 'a trainer key')}",
        )


@dataclasses.dataclass(kw_only=True)
class TrainingFields:
    """How a fine-tuning stage is launched (docs/method.md#training)."""

    method: ClassVar[str]  # the loop's name (``RunFields.method``): which trainers it runs

    accelerate_config: str | None = field(
        None,
        help="name under alignment-handbook/recipes/accelerate_configs (cpu, single_gpu, multi_gpu, deepspeed_zero3, "
        "fsdp) or a YAML path; null = cpu without a GPU, else deepspeed_zero3",
        redoes=TRAINED,
    )
    num_processes: int | None = field(
        None, help="training processes in all nodes; null = every GPU the hardware allocation leaves for training"
    )
    accelerate_extra_args: list[str] = field([], help="more 'accelerate launch' flags (not the multi-node ones)")
    train_hosts: list[str] = field(
        [],
        help="multi-node training: one host per node, the first is the main one (machine rank 0); [] = this machine",
    )
    train_hostfile: str | None = field(None, help="instead of train_hosts: a file with one host per line")
    train_launcher: Literal["ssh", "srun"] = field(
        "ssh",
        help="how each node of a multi-node training starts: ssh to each host, or srun inside a Slurm allocation "
        "(no hosts needed: the allocation's nodes)",
    )
    train_launcher_executable: str | None = field(None, help="the ssh or srun program; null = the one on PATH")
    main_process_port: int = field(29500, help="rendezvous port of a multi-node training, on the main host")
    train_forward_env: list[str] | None = field(
        None,
        help="variables the ssh launcher carries to each node (names, or prefixes ending in *); null = the "
        "built-in allow-list (NCCL_*, FI_*, UCX_*, GLOO_*, CUDA_HOME, PATH, LD_LIBRARY_PATH, HF_*, ...: "
        "docs/gpu.md#several-nodes)",
    )
    from_initial: bool = field(
        False, help="fine-tune the base model every iteration (data from the newest)", redoes=TRAINED
    )
    on_empty_selection: Literal["stop", "carry_forward"] = field(
        "stop", help="when nothing passes selection: stop, or carry the current model to the next iteration"
    )
    report_to: str | list[str] = field(
        "auto",
        help="trainer and iteration logging: auto (tensorboard if the training env has it), none, tensorboard, "
        "wandb, or a list; events under <output_dir>/tensorboard",
    )
    trainer_overrides: dict[str, Any] = field(
        {},
        help="trainer YAML keys set over the base YAML of every train stage (e.g. learning_rate, use_peft); "
        "'sft:'/'dpo:' sub-mappings apply to one trainer only; --trainer_set key=value adds one",
        redoes=TRAINED,
    )
    push_to_hub: bool = field(False, help="after the last iteration, upload the final checkpoint to hub_model_id")
    hub_model_id: str | None = field(None, help="hub repository (org/name) of push_to_hub")
    hub_private: bool = field(True, help="create the hub repositories as private")
    hub_push_datasets: bool = field(
        False,
        help="with push_to_hub, also upload every iteration's training set to the dataset repo <hub_model_id>-data",
    )

    def validate(self) -> None:
        if self.num_processes is not None:
            require_positive(self, "num_processes")
        require_in("main_process_port", self.main_process_port, 1, 65535)
        planned = [a for a in self.accelerate_extra_args if a.split("=")[0] in MULTI_NODE_FLAGS]
        require(
            not planned,
            "accelerate_extra_args",
            f"{planned[0] if planned else ''} is set by the hardware allocation (alone it started this node only): "
            "use num_processes, and train_hosts (or train_hostfile, or train_launcher: srun) for several nodes, each "
            "of which is then started for you",
        )
        require(
            not (self.train_hosts and self.train_hostfile),
            "train_hostfile",
            "set train_hosts or train_hostfile, not both",
        )
        parse_report_to(self.report_to)
        self.trainer_overrides = yaml_numbers(self.trainer_overrides)
        check_trainer_overrides(
            self.trainer_overrides, METHODS[self.method].trainers if self.method in METHODS else ()
        )
        if self.push_to_hub:
            require(
                bool(self.hub_model_id) and self.hub_model_id.count("/") == 1,
                "hub_model_id",
                f"push_to_hub needs a hub repository 'org/name', got {self.hub_model_id!r}",
            )


@dataclasses.dataclass(kw_only=True)
class SFTFields(TrainingFields):
    """iSFT data selection and its trainer recipe (docs/method.md#isft-selection)."""

    origin_yaml_path: str | None = field(None, help="handbook-style SFT trainer YAML (base.yaml)", redoes=TRAINED)
    initial_epsilon: float = field(0.5, help="keep conversations with reward >= this", redoes=SELECTED)
    selection_range: list[float] | None = field(
        None,
        help="[start, end) fraction of questions ranked by best reward; null = [0, 0.7] ([0.1, 0.8] for math)",
        redoes=SELECTED,
    )
    sft_train_fraction: float = field(
        0.98, help="train share of the SFT dataset (the rest is its test split)", redoes=SELECTED
    )

    def validate(self) -> None:
        TrainingFields.validate(self)
        require(self.origin_yaml_path is not None, "origin_yaml_path", "is required (the SFT trainer base.yaml)")
        require_in("initial_epsilon", self.initial_epsilon, -10.0, 10.0)
        if self.selection_range is not None:
            lo_hi = self.selection_range
            require(
                len(lo_hi) == 2 and 0 <= lo_hi[0] < lo_hi[1] <= 1,
                "selection_range",
                f"must be [start, end) with 0 <= start < end <= 1, got {lo_hi!r}",
            )
        require(
            0 < self.sft_train_fraction <= 1, "sft_train_fraction", f"must be in (0, 1], got {self.sft_train_fraction}"
        )


@dataclasses.dataclass(kw_only=True)
class DPOFields(TrainingFields):
    """Tree search for preference pairs and DPO (docs/method.md#tree-search)."""

    origin_dpo_yaml_path: str | None = field(None, help="handbook-style DPO trainer YAML (base.yaml)", redoes=TRAINED)
    initial_dpo_min_value: float = field(0.2, help="a pair needs best - worst child value > this", redoes=PAIRED)
    initial_dpo_epsilon: float = field(0.4, help="a pair needs best child value > this", redoes=PAIRED)
    monte_sample_count: int = field(100, help="questions searched per iteration", redoes=SEARCHED)
    mcts_selections: int | None = field(
        None, help="node selections per question; null = explore_count (iDPO) or 8 (iSFT-DPO)", redoes=SEARCHED
    )
    mcts_rollouts: int = field(3, help="rollouts per selection", redoes=SEARCHED)
    mcts_top_k: int = field(10, help="selection samples among the top-k values", redoes=SEARCHED)
    diversity_threshold: float = field(
        0.25, help="normalised edit distance under which a candidate is skipped", redoes=SEARCHED
    )
    merge_threshold: float = field(
        0.1, help="normalised edit distance under which a new utterance merges", redoes=SEARCHED
    )
    token_quantile: float = field(
        0.85, help="T_max of the tree search = this quantile of probe token counts", redoes=PROBED
    )
    probe_count: int = field(100, help="questions of the token-quantile probe", redoes=PROBED)
    dpo_keep_fraction: float = field(
        0.5, help="per question, keep this share of pairs (by chosen value)", redoes=PAIRED
    )
    dpo_train_fraction: float = field(0.9, help="train share of the DPO dataset", redoes=PAIRED)
    rpo_alpha: float | None = field(
        1.0, help="weight of the NLL term on chosen (iDPO's RPO); null = plain DPO", redoes=TRAINED
    )

    def validate(self) -> None:
        TrainingFields.validate(self)
        require(
            self.origin_dpo_yaml_path is not None, "origin_dpo_yaml_path", "is required (the DPO trainer base.yaml)"
        )
        require_positive(self, "monte_sample_count", "mcts_rollouts", "mcts_top_k", "probe_count")
        if self.mcts_selections is not None:
            require_positive(self, "mcts_selections")
        for name in ("diversity_threshold", "merge_threshold", "token_quantile", "dpo_keep_fraction"):
            require_in(name, getattr(self, name), 0.0, 1.0)
        require(
            0 < self.dpo_train_fraction <= 1, "dpo_train_fraction", f"must be in (0, 1], got {self.dpo_train_fraction}"
        )
        require(
            self.rpo_alpha is None or (self.rpo_alpha >= 0 and math.isfinite(self.rpo_alpha)),
            "rpo_alpha",
            f"must be >= 0 or null, got {self.rpo_alpha!r}",
        )
