"""The field groups the recipes are built from: run, serving, conversation, generation, loop, reward, training.

Each group is a keyword-only dataclass mixin with its own ``validate``; ``optima.config.recipes`` composes them into
the method recipes, and a signature names the group it reads (``optima.config.types``). Keys stay flat in YAML, as
in the released Optima recipes (``port``, ``lambda1``, ...). Defaults are the values of those recipes and the
method's hard-coded numbers (docs/method.md D10).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, ClassVar, Literal

from optima.config.devices import parse_devices
from optima.config.fields import field, require
from optima.config.stage_names import Stage
from optima.config.trackers import parse_report_to
from optima.methods import METHODS, TRAINERS

DATA_DIR_ENV = "OPTIMA_DATA_DIR"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# accelerate's multi-node flags: the hardware allocation sets them for each node it starts (train_hosts).
MULTI_NODE_FLAGS = ("--num_machines", "--machine_rank", "--main_process_ip", "--main_process_port", "--num_processes")

# The stages whose output a field decides (``field(redoes=...)``): the stage tables of ``optima.plan`` read them.
GENERATED = (Stage.GENERATE,)  # iSFT's conversations
PROBED = (Stage.PROBE,)  # DPO's token-count probe
SAMPLED = GENERATED + PROBED  # both ask the served model for conversations
SCORED = (Stage.SCORE,)  # iSFT's rewards
SEARCHED = (Stage.SEARCH,)  # DPO's tree search
REWARDED = SCORED + SEARCHED  # both apply the reward formula
SELECTED = (Stage.SELECT,)  # iSFT's training set
PAIRED = (Stage.PAIRS,)  # DPO's preference pairs
TRAINED = (Stage.TRAIN,)  # the checkpoint (of whichever method's train stage reads the group)


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


def _in(name: str, value: float, low: float, high: float) -> None:
    require(low <= value <= high, name, f"must be in [{low}, {high}], got {value!r}")


def _positive(self: object, *names: str) -> None:
    for name in names:
        value = getattr(self, name)
        require(value >= 1, name, f"must be >= 1, got {value!r}")


@dataclasses.dataclass(kw_only=True)
class ServingFields:
    """How the current model is served (docs/method.md D1)."""

    port: int = field(8000, help="first port tried; each replica takes the next free port from here")
    devices: int | str | list[int] | None = field(
        None,
        help="GPUs of the vLLM replicas: an integer N = GPUs 0..N ('devices: 7' = 8 GPUs), "
        "a list [0, 3] or '0,3' = exactly those; null = all visible; ignored on CPU",
    )
    tensor_parallel_size: int = field(1, help="GPUs per replica for models too big for one GPU")
    gpu_memory_utilization: float = field(0.9, help="vLLM --gpu-memory-utilization")
    max_model_len: int | None = field(None, help="vLLM --max-model-len (null: the model's own)")
    endpoints: list[str] = field([], help="already-running OpenAI-compatible base URLs; if set, none is launched")
    endpoint_sync: Literal["reload", "check", "off"] = field(
        "reload",
        help="before each stage, compare the model each endpoint holds with the one the stage needs; on a mismatch "
        "'reload' loads the needed weights into it (vLLM with VLLM_SERVER_DEV_MODE=1) or stops, 'check' stops, "
        "'off' checks only served_model_name (sampling may then be off-policy)",
    )
    api_key: str | None = field(None, help="API key for the servers (required when host is not loopback)")
    host: str = field("127.0.0.1", help="address the launched servers bind to")
    private_hosts: list[str] = field(
        [],
        help="addresses of private interfaces: a server with vLLM's reload routes (sleep_mode, which its API key "
        "does not guard) may bind to these besides loopback; never a wildcard",
    )
    served_model_name: str = field("optima", help="model name the servers answer to", redoes=SAMPLED)
    thread_count: int = field(
        64,
        help="work in flight at once: conversations (fewer when the servers' KV caches cannot hold them), "
        "search trees, LM-loss requests",
    )
    server_startup_timeout_s: float = field(900.0, help="deadline for a server to answer /health")
    request_timeout_s: float = field(600.0, help="timeout of one chat request")
    max_retries: int = field(3, help="retries of a transient request failure (with backoff)")
    cpu_kvcache_space_gb: int | None = field(
        None,
        help="the policy server's VLLM_CPU_KVCACHE_SPACE (GiB) on a CPU-only machine; null = a share of the memory "
        "available (in a training loop at most what thread_count conversations need); the loss server's is always "
        "one scoring batch",
    )
    vllm_extra_args: list[str] = field([], help="extra arguments appended to 'vllm serve'")
    sleep_mode: bool | None = field(
        None,
        help="keep the policy server across iterations: during training it sleeps (GPU, vLLM sleep mode) or idles "
        "(CPU), then loads the new checkpoint's weights instead of a restart; null = on (CPU and GPU)",
    )

    def validate(self) -> None:
        _in("port", self.port, 1, 65535)
        _positive(self, "tensor_parallel_size", "thread_count", "server_startup_timeout_s", "request_timeout_s")
        _in("max_retries", self.max_retries, 0, 100)
        if self.cpu_kvcache_space_gb is not None:
            _positive(self, "cpu_kvcache_space_gb")
        require(
            0 < self.gpu_memory_utilization <= 1,
            "gpu_memory_utilization",
            f"must be in (0, 1], got {self.gpu_memory_utilization!r}",
        )
        self.devices = parse_devices(self.devices)
        for url in self.endpoints:
            require(url.startswith(("http://", "https://")), "endpoints", f"not an http(s) URL: {url!r}")
        require(
            self.host in LOOPBACK_HOSTS or bool(self.api_key),
            "host",
            f"binding to {self.host!r} exposes the servers; set api_key too",
        )


@dataclasses.dataclass(kw_only=True)
class RunFields:
    """What every recipe names: the task, the model and its tokenizers, the data and output folders, the seed."""

    dataset_type: str = field(help="task name, e.g. arc or hotpot_qa", redoes=SAMPLED)
    initial_model_path: str = field(
        help="base model: hub id org/name or local folder (start local ones with ./)", redoes=GENERATED
    )
    tokenizer_first_path: str | None = field(None, help="tokenizer of Alice (default: the model's own)")
    tokenizer_second_path: str | None = field(None, help="tokenizer of Bob (default: the model's own)")
    data_dir: str | None = field(
        None, help=f"local dataset root (JSONL); default ${DATA_DIR_ENV}, else the hub", redoes=SAMPLED
    )
    output_dir: str | None = field(
        None, help="run directory; default runs/<dataset_type>_<method> (evaluation: output_root_path)"
    )
    seed: int = field(
        42, help="seed of every random choice (question slices, contexts, pool draws, shuffles)", redoes=SAMPLED
    )

    method: ClassVar[str] = "base"  # the recipe's kind (loop or evaluation), used in default paths and logs


@dataclasses.dataclass(kw_only=True)
class ConversationFields:
    """The length limits of one two-agent conversation (docs/method.md#turn-loop), in training and in evaluation."""

    max_turns: int = field(10, help="utterances per conversation at most (both agents together)", redoes=SAMPLED)
    max_tokens: int = field(
        2000, help="tokens per utterance at most; longer ends the conversation as too_long", redoes=SAMPLED
    )

    def validate(self) -> None:
        _positive(self, "max_turns", "max_tokens")


@dataclasses.dataclass(kw_only=True)
class GenerationFields:
    """The training loops' conversation sampling (docs/method.md#sampling-schedule)."""

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

    def validate(self) -> None:
        require(self.sample_count >= 0, "sample_count", f"must be >= 0, got {self.sample_count}")
        _positive(self, "explore_count")
        _in("temperature", self.temperature, 0.0, 2.0)
        if self.temperature_iteration0 is not None:
            _in("temperature_iteration0", self.temperature_iteration0, 0.0, 2.0)
        require(
            self.answer_bootstrap_iterations >= 0,
            "answer_bootstrap_iterations",
            f"must be >= 0, got {self.answer_bootstrap_iterations}",
        )


@dataclasses.dataclass(kw_only=True)
class LoopFields:
    """What only a training loop has: its iterations, where its checkpoints go, and the compatibility switch."""

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

    def validate(self) -> None:
        require(self.heldout_size >= 0, "heldout_size", f"must be >= 0, got {self.heldout_size}")


@dataclasses.dataclass(kw_only=True)
class RewardFields:
    """R = task score + lambda1 * tokens / T_max + lambda2 / max utterance LM loss (docs/method.md#reward)."""

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

    def validate(self) -> None:
        require(self.lambda1 <= 0, "lambda1", f"must be <= 0 (it multiplies the token count), got {self.lambda1}")
        require(self.lambda2 >= 0, "lambda2", f"must be >= 0, got {self.lambda2}")
        _positive(self, "loss_batch_size", "max_total_tokens")
        require(
            self.loss_gpu_memory_utilization is None or 0 < self.loss_gpu_memory_utilization < 1,
            "loss_gpu_memory_utilization",
            f"must be in (0, 1), got {self.loss_gpu_memory_utilization!r}",
        )
        self.loss_devices = parse_devices(self.loss_devices, "loss_devices")
        require(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")


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
    warm_trainer: bool = field(
        True,
        help="a single-process CPU training runs each stage as a fork of one warm trainer process per run (imports "
        "once, docs/cpu.md#warm-trainer); false = accelerate launch for every stage",
    )
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
            _positive(self, "num_processes")
        _in("main_process_port", self.main_process_port, 1, 65535)
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
        _in("initial_epsilon", self.initial_epsilon, -10.0, 10.0)
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
        _positive(self, "monte_sample_count", "mcts_rollouts", "mcts_top_k", "probe_count")
        if self.mcts_selections is not None:
            _positive(self, "mcts_selections")
        for name in ("diversity_threshold", "merge_threshold", "token_quantile", "dpo_keep_fraction"):
            _in(name, getattr(self, name), 0.0, 1.0)
        require(
            0 < self.dpo_train_fraction <= 1, "dpo_train_fraction", f"must be in (0, 1], got {self.dpo_train_fraction}"
        )
        require(
            self.rpo_alpha is None or (self.rpo_alpha >= 0 and math.isfinite(self.rpo_alpha)),
            "rpo_alpha",
            f"must be >= 0 or null, got {self.rpo_alpha!r}",
        )
