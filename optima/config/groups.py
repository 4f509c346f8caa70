"""The field groups the recipes are built from: run, serving, conversation, generation, loop and reward.

Each group is a keyword-only dataclass mixin with its own ``validate``; ``optima.config.recipes`` composes them into
the method recipes, and a signature names the group it reads (``optima.config.types``). Keys stay flat in YAML, as
in the released Optima recipes (``port``, ``lambda1``, ...). Defaults are the values of those recipes and the
method's hard-coded numbers (docs/method.md D10). The training groups (``TrainingFields`` and its iSFT and DPO
parts) are in ``optima.config.training_groups``; the stages a field redoes (``GENERATED``, ``TRAINED``, ...) are
named here for both.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from optima.config.devices import parse_devices
from optima.config.fields import field, require, require_in, require_positive
from optima.config.stage_names import Stage

DATA_DIR_ENV = "OPTIMA_DATA_DIR"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")

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
        require_in("port", self.port, 1, 65535)
        require_positive(self, "tensor_parallel_size", "thread_count", "server_startup_timeout_s", "request_timeout_s")
        require_in("max_retries", self.max_retries, 0, 100)
        if self.cpu_kvcache_space_gb is not None:
            require_positive(self, "cpu_kvcache_space_gb")
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
        require_positive(self, "max_turns", "max_tokens")


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
        require_positive(self, "explore_count")
        require_in("temperature", self.temperature, 0.0, 2.0)
        if self.temperature_iteration0 is not None:
            require_in("temperature_iteration0", self.temperature_iteration0, 0.0, 2.0)
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
        require_positive(self, "loss_batch_size", "max_total_tokens")
        require(
            self.loss_gpu_memory_utilization is None or 0 < self.loss_gpu_memory_utilization < 1,
            "loss_gpu_memory_utilization",
            f"must be in (0, 1), got {self.loss_gpu_memory_utilization!r}",
        )
        self.loss_devices = parse_devices(self.loss_devices, "loss_devices")
        require(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
