"""The recipes of the three training loops: iSFT, iDPO and iSFT-DPO, over the fields they share (``_LoopRecipe``).

Like TRL's configs, one dataclass per method, validated in ``__post_init__``; the fields every recipe has are in
``optima.config.recipes`` (``_BaseRecipe``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Any, Literal

from optima.config.loading import (
    check_trainer_overrides,
    documented,
    field,
    require,
    require_in,
    require_positive,
    yaml_numbers,
)
from optima.config.recipes import (
    GENERATED,
    PAIRED,
    PROBED,
    REWARDED,
    SAMPLED,
    SCORED,
    SEARCHED,
    SELECTED,
    TRAINED,
    InferenceRecipe,
    MultiSCRecipe,
    _BaseRecipe,
    parse_devices,
    parse_report_to,
)
from optima.methods import DPO, METHODS, SFT, SFT_DPO

logger = logging.getLogger(__name__)

# Node selections per question of a tree search whose recipe sets no ``mcts_selections`` (docs/method.md D20).
ORIGINAL_MCTS_SELECTIONS = 8
# The original's prompt pools (not shipped here): a recipe naming one that is not on disk gets the built-in pool.
ORIGINAL_POOLS = tuple(f"prompts_{name}.jsonl" for name in ("diverse", "arc_first", "gsm8k_first", "math_first"))


@documented
@dataclasses.dataclass(kw_only=True)
class _LoopRecipe(_BaseRecipe):
    """What the three training loops share: sampling, iterations, the reward and the trainer launch."""

    # Sampling
    sample_count: int = field(100, help="questions per iteration", redoes=GENERATED)
    explore_count: int = field(10, help="conversations per question", redoes=GENERATED)
    temperature: float = field(0.7, help="sampling temperature from iteration 1 on", redoes=SAMPLED)
    temperature_iteration0: float | None = field(
        None,
        help="temperature at iteration 0; null = 0.3, or 0.7 for gsm8k/math (docs/method.md#sampling-schedule)",
        redoes=GENERATED,
    )
    use_prompt_pool: bool = field(
        True, help="draw format-diverse system prompts at iteration 0 (docs/method.md#prompt-pool)", redoes=GENERATED
    )
    prompt_pool_path: str | None = field(
        None, help="JSONL prompt pool; null = the built-in pool of the task", redoes=GENERATED
    )
    answer_bootstrap: Literal["grammar", "prefill", "off"] = field(
        "off",
        help="answer format bootstrap of the first iterations (docs/method.md#answer-bootstrap): 'grammar' constrains "
        "each answering reply to free text around one well-formed answer (an option of the question, a number, ...) "
        "through the server's structured outputs; 'prefill' starts it with the answer tag; replaces "
        "prefill_answer_iteration0 (true reads as 'prefill')",
        redoes=GENERATED,
    )
    answer_bootstrap_iterations: int = field(
        1, help="iterations that bootstrap the answer, from iteration 0 (1: iteration 0 only)", redoes=GENERATED
    )

    # Iterations and checkpoints
    check_point_root_path: str | None = field(None, help="checkpoint root; default <output_dir>/checkpoints")
    iteration_times: int = field(1, help="number of iterations")
    compat: Literal["default", "original"] = field(
        "default",
        help="'original' restores exactly these of the original's behaviours: reward F1 over model subwords with its "
        "character strip; exact string match for gsm8k and for multiple choice (the option text after the prompt's "
        "'letter) ' label); private information as a Python list repr in training rows and tree-search prompts; "
        "MATH training rows under the GSM8K solver prompt; a "
        "tree-search rollout that hits max_turns scores no answer; the tree-search stop rule only knows the selected "
        "node's answer; the reward scores the last answer of a conversation cut at max_tokens "
        "(docs/method.md#where-we-differ-from-the-original)",
        redoes=REWARDED,
    )
    heldout_size: int = field(
        0,
        help="after the last iteration, evaluate the base model and every checkpoint greedily on this many eval "
        "questions the run never trained on (0: off; docs/method.md#held-out-evaluation)",
    )
    heldout_seed: int = field(0, help="seed of the held-out sample (the same questions for every model)")

    # Reward
    lambda1: float = field(-0.6, help="token-term coefficient (negative: fewer tokens is better)", redoes=REWARDED)
    lambda2: float = field(1.0, help="LM-loss-term coefficient", redoes=REWARDED)
    cal_ppl: bool = field(True, help="compute the LM-loss term (0/false drops it)", redoes=REWARDED)
    loss_backend: Literal["vllm", "hf"] = field(
        "vllm", help="LM loss from a vLLM server of the loss model, or HF", redoes=REWARDED
    )
    loss_model_path: str | None = field(
        None,
        help="fixed model whose LM loss scores readability (same tokenizer); null = initial_model_path",
        redoes=REWARDED,
    )
    loss_batch_size: int = field(8, help="texts per LM-loss batch")
    loss_placement: Literal["beside", "after"] = field(
        "beside",
        help="'beside': the loss model has its own vLLM server for the whole run and scores each conversation as "
        "it finishes; 'after': scoring follows generation on a server started then",
    )
    loss_gpu_memory_utilization: float | None = field(
        None,
        help="GPU memory share of the loss server beside the policy (taken from gpu_memory_utilization); null = "
        "computed from the loss model's weights and a minimum KV cache (docs/gpu.md)",
    )
    loss_devices: int | str | list[int] | None = field(
        None, help="GPU ids of the loss server (7 = GPU 7); null = it shares the policy's first GPU by memory share"
    )
    min_tokens: int = field(40, help="conversations with at most this many tokens get token term -1", redoes=REWARDED)
    max_total_tokens: int = field(2000, help="conversations above this many tokens get loss term -1", redoes=REWARDED)
    overlong_penalty: float = field(
        -1.0, help="token/loss term of a too long or too short conversation", redoes=REWARDED
    )
    impersonation_penalty: float = field(-10.0, help="added when an utterance speaks for the partner", redoes=SCORED)

    # Training launch
    accelerate_config: str | None = field(
        None,
        help="name under alignment-handbook/recipes/accelerate_configs (cpu, single_gpu, multi_gpu, deepspeed_zero3, "
        "fsdp) or a YAML path; null = cpu without a GPU, else deepspeed_zero3",
        redoes=TRAINED,
    )
    num_processes: int | None = field(
        None, help="training processes in all nodes; null = every GPU the hardware allocation leaves for training"
    )
    preflight: bool = field(
        True,
        help="before the first generation, each trainer takes one optimizer step at its max_length with the run's "
        "launcher and sharding, saving nothing: a trainer that cannot stops the run then (docs/gpu.md#preflight)",
    )
    train_launcher: Literal["local", "srun"] = field(
        "local",
        help="srun: train and serve on every node of the Slurm allocation the script runs in, one srun step per "
        "node (docs/gpu.md#several-nodes); local: this machine only",
    )
    main_process_port: int = field(29500, help="rendezvous port of a multi-node training, on the main host")
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
    hub_push_datasets: bool = field(
        False,
        help="with push_to_hub, also upload every iteration's training set to the dataset repo <hub_model_id>-data",
    )

    model_fields = (*_BaseRecipe.model_fields, "loss_model_path")
    folder_fields = ("check_point_root_path",)
    path_fields = ("prompt_pool_path",)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_sampling()
        require(self.heldout_size >= 0, "heldout_size", f"must be >= 0, got {self.heldout_size}")
        # Reward
        require(self.lambda1 <= 0, "lambda1", f"must be <= 0 (it multiplies the token count), got {self.lambda1}")
        require(self.lambda2 >= 0, "lambda2", f"must be >= 0, got {self.lambda2}")
        require_positive(self, "loss_batch_size", "max_total_tokens")
        require(
            self.loss_gpu_memory_utilization is None or 0 < self.loss_gpu_memory_utilization < 1,
            "loss_gpu_memory_utilization",
            f"must be in (0, 1), got {self.loss_gpu_memory_utilization!r}",
        )
        self.loss_devices = parse_devices(self.loss_devices, "loss_devices")
        require(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        # Training launch
        if self.num_processes is not None:
            require_positive(self, "num_processes")
        require_in("main_process_port", self.main_process_port, 1, 65535)
        parse_report_to(self.report_to)
        self.trainer_overrides = yaml_numbers(self.trainer_overrides)
        check_trainer_overrides(self.trainer_overrides, METHODS[self.method].trainers)
        if self.push_to_hub:
            require(
                bool(self.hub_model_id) and self.hub_model_id.count("/") == 1,
                "hub_model_id",
                f"push_to_hub needs a hub repository 'org/name', got {self.hub_model_id!r}",
            )

    def _check_early(self) -> None:
        require(self.iteration_times >= 1, "iteration_times", f"must be >= 1, got {self.iteration_times}")
        pool = self.prompt_pool_path
        if pool and Path(pool).name in ORIGINAL_POOLS and not Path(pool).exists():
            logger.warning("prompt_pool_path %s is the released Optima pool (not here); using the built-in pool", pool)
            self.prompt_pool_path = None

    def _check_sampling(self) -> None:
        require(self.sample_count >= 0, "sample_count", f"must be >= 0, got {self.sample_count}")
        require_positive(self, "explore_count")
        require_in("temperature", self.temperature, 0.0, 2.0)
        if self.temperature_iteration0 is not None:
            require_in("temperature_iteration0", self.temperature_iteration0, 0.0, 2.0)
        require(
            self.answer_bootstrap_iterations >= 0,
            "answer_bootstrap_iterations",
            f"must be >= 0, got {self.answer_bootstrap_iterations}",
        )


@documented
@dataclasses.dataclass(kw_only=True)
class SFTRecipe(_LoopRecipe):
    """iSFT (docs/method.md#isft): generate, reward, keep the best conversations, fine-tune, repeat."""

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

    method = SFT
    path_fields = (*_LoopRecipe.path_fields, "origin_yaml_path")

    def __post_init__(self) -> None:
        super().__post_init__()
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


@documented
@dataclasses.dataclass(kw_only=True)
class DPORecipe(_LoopRecipe):
    """iDPO (docs/method.md#idpo): token-quantile probe, tree search for preference pairs, DPO (+NLL), repeat."""

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

    method = DPO
    unused_keys = ("initial_epsilon",)  # the original's iDPO recipes carry this SFT key, which iDPO never reads
    path_fields = (*_LoopRecipe.path_fields, "origin_dpo_yaml_path")

    def __post_init__(self) -> None:
        if self.mcts_selections is None:  # iDPO reads explore_count (docs/method.md D20); iSFT-DPO's belongs to SFT
            self.mcts_selections = self.explore_count if self.method == DPO else ORIGINAL_MCTS_SELECTIONS
        super().__post_init__()
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


@documented
@dataclasses.dataclass(kw_only=True)
class SFTDPORecipe(DPORecipe, SFTRecipe):
    """iSFT-DPO (docs/method.md#isft-dpo): a full iSFT iteration, then a DPO stage on the new checkpoint, repeated.

    Every field of ``SFTRecipe`` and ``DPORecipe`` (checked in that order); two DPO defaults differ:
    """

    rpo_alpha: float | None = field(
        None, help="weight of the NLL term on chosen; null = plain sigmoid DPO", redoes=TRAINED
    )
    token_quantile: float = field(
        0.8, help="T_max of the tree search = this quantile of probe token counts", redoes=PROBED
    )

    method = SFT_DPO
    unused_keys = ()
    path_fields = (*_LoopRecipe.path_fields, "origin_yaml_path", "origin_dpo_yaml_path")


# What a signature names for the recipe it takes: the loops, the loops with iSFT stages, the loops with a tree
# search, and any recipe (code that tells the kinds apart itself).
LoopRecipe = SFTRecipe | DPORecipe | SFTDPORecipe
SFTLoopRecipe = SFTRecipe | SFTDPORecipe
DPOLoopRecipe = DPORecipe | SFTDPORecipe
Recipe = SFTRecipe | DPORecipe | SFTDPORecipe | InferenceRecipe | MultiSCRecipe
