"""The recipes every method shares (``_BaseRecipe``) and the two evaluations' (checkpoint sweep, self-consistency).

One dataclass per method, like TRL's configs, validated in ``__post_init__`` (a ``RecipeError`` names the field and
the value; ``load_recipe`` adds the file). YAML keys are the field names, flat as in the original's recipes
(``port``, ``lambda1``, ...); defaults are the original's values and the method's hard-coded numbers (docs/method.md
D10). ``redoes=`` names the stages whose output a field decides: changing it on a finished run redoes them. The
training loops' recipes are in ``optima.config.loop_recipes``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any, ClassVar, Literal

from optima.config.loading import (
    RecipeError,
    documented,
    field,
    is_hub_id,
    require,
    require_in,
    require_positive,
    resolve_path,
)
from optima.methods import Stage
from optima.store import write_yaml

logger = logging.getLogger(__name__)

DATA_DIR_ENV = "OPTIMA_DATA_DIR"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")

# The stages whose output a field decides (``field(redoes=...)``); the stage tables of ``optima.plan`` read them.
GENERATED = (Stage.GENERATE,)  # iSFT's conversations
PROBED = (Stage.PROBE,)  # DPO's token-count probe
SAMPLED = GENERATED + PROBED  # both ask the served model for conversations
SCORED = (Stage.SCORE,)  # iSFT's rewards
SEARCHED = (Stage.SEARCH,)  # DPO's tree search
REWARDED = SCORED + SEARCHED  # both apply the reward formula
SELECTED = (Stage.SELECT,)  # iSFT's training set
PAIRED = (Stage.PAIRS,)  # DPO's preference pairs
TRAINED = (Stage.TRAIN,)  # the checkpoint


def known_tasks() -> dict[str, str]:
    """Dataset names the recipes accept, mapped to their canonical name (aliases included)."""
    from optima.tasks import TASK_ALIASES, TASKS

    return {name: name for name in TASKS} | dict(TASK_ALIASES)


# Which GPUs the vLLM replicas use (docs/method.md D1; the original's meanings): recipe ``devices: N`` = GPUs 0..N
# (``devices: 7`` = eight GPUs), ``[0, 3]`` or ``"0,3"`` = exactly those; ``inference_script.py --device d`` = GPUs
# d..d+3, ``multi_sc_data_generate_script.py --device d`` = d..d+7, ``--device 0,3`` = exactly those; not given:
# every visible GPU. Numbers count the GPUs this process sees (``CUDA_VISIBLE_DEVICES`` order).
SWEEP_DEVICE_SPAN = 4  # inference_script.py --device d: GPUs d..d+3
SC_DEVICE_SPAN = 8  # multi_sc_data_generate_script.py --device d: GPUs d..d+7


def _parse_list(field_name: str, value: str) -> list[int]:
    parts = [part.strip() for part in value.split(",") if part.strip()]
    require(
        bool(parts) and all(p.isascii() and p.isdigit() for p in parts),
        field_name,
        f"expected GPU ids like [0, 1] or '0,1', got {value!r}",
    )
    return [int(p) for p in parts]


def _check(field_name: str, devices: list[int], value: object) -> list[int]:
    ints = all(isinstance(d, int) and not isinstance(d, bool) for d in devices)
    require(ints, field_name, f"expected GPU ids like [0, 1] or '0,1', got {value!r}")
    require(all(d >= 0 for d in devices), field_name, f"GPU ids must be >= 0, got {value!r}")
    require(len(devices) == len(set(devices)), field_name, f"lists a GPU twice: {value!r}")
    return devices


def parse_devices(value: int | str | list[int] | None, name: str = "devices") -> list[int] | None:
    """A recipe's GPU field as a list of GPU numbers (``None``: every visible GPU, or the field's default).

    ``devices``: ``7`` -> [0, 1, ..., 7] (docs/method.md, D1); any other field (``loss_devices``, which is ours):
    ``7`` -> [7]. Both: ``[3]`` or ``"3"`` -> [3], ``"0,1"`` -> [0, 1].

    Raises:
        RecipeError: not GPU numbers, a negative one, or one listed twice.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise RecipeError(name, f"expected GPU ids like [0, 1] or '0,1', got {value!r}")
    if isinstance(value, int):
        require(value >= 0, name, f"GPU ids must be >= 0, got {value!r}")
        return list(range(value + 1)) if name == "devices" else [value]
    devices = _parse_list(name, value) if isinstance(value, str) else list(value)
    return _check(name, devices, value)


def expand_device_flag(value: str, span: int) -> list[int]:
    """``--device`` of an evaluation script as GPU numbers: ``d`` -> d..d+span-1; ``"0,3"`` -> [0, 3].

    Args:
        value: The flag as given on the command line.
        span: GPUs that the script's ``--device d`` names from ``d`` on (``SWEEP_DEVICE_SPAN`` or ``SC_DEVICE_SPAN``).

    Raises:
        RecipeError: (field ``--device``) not a GPU number or a comma list of them.
    """
    devices = _parse_list("--device", value)
    if "," not in value:
        return list(range(devices[0], devices[0] + span))
    return _check("--device", devices, value)


TRACKERS = ("tensorboard", "wandb")


def parse_report_to(value: str | list[str] | None) -> list[str] | str:
    """Validate the recipe's ``report_to``: ``auto``, ``none``, a tracker, or a list of trackers.

    Returns ``"auto"`` or the list of trackers (empty for ``none``).
    """
    if value in (None, "none", []):
        return []
    if value == "auto":
        return "auto"
    names = [value] if isinstance(value, str) else list(value)
    for name in names:
        if name not in TRACKERS:
            raise RecipeError("report_to", f"expected auto, none or one of {list(TRACKERS)}, got {name!r}")
    return names


@documented
@dataclasses.dataclass(kw_only=True)
class _BaseRecipe:
    """What every recipe has, loop or evaluation: the conversation limits, the servers, the task and the model."""

    # Conversation limits (training and evaluation)
    max_turns: int = field(10, help="utterances per conversation at most (both agents together)", redoes=SAMPLED)
    max_tokens: int = field(
        2000, help="tokens per utterance at most; longer ends the conversation as too_long", redoes=SAMPLED
    )

    # Serving
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

    # Task, model, data, output
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

    method: ClassVar[str] = "base"  # the recipe's kind (loop or evaluation): default paths, logs, METHODS
    unused_keys: ClassVar[tuple[str, ...]] = ()  # keys accepted and ignored with a warning
    model_fields: ClassVar[tuple[str, ...]] = ("initial_model_path", "tokenizer_first_path", "tokenizer_second_path")
    folder_fields: ClassVar[tuple[str, ...]] = ()  # output folders besides data_dir and output_dir
    path_fields: ClassVar[tuple[str, ...]] = ()  # local input files (resolved, and checked by load_recipe)

    def __post_init__(self) -> None:
        tasks = known_tasks()
        require(
            self.dataset_type in tasks,
            "dataset_type",
            f"unknown task {self.dataset_type!r}; known: " + ", ".join(sorted(tasks)),
        )
        self.dataset_type = tasks[self.dataset_type]
        self._check_early()
        if self.data_dir is None:
            self.data_dir = os.environ.get(DATA_DIR_ENV) or None
        if self.output_dir is None:
            self.output_dir = self._default_output_dir()
        for name in ("data_dir", "output_dir", *self.folder_fields, *self.path_fields):
            setattr(self, name, resolve_path(getattr(self, name), name))
        for name in self.model_fields:  # hub ids stay as they are
            value = getattr(self, name)
            if value and not is_hub_id(value):
                setattr(self, name, resolve_path(value, name))
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
        require_positive(self, "max_turns", "max_tokens")

    def _check_early(self) -> None:
        """Checks that come before the paths are resolved (none here)."""

    def _default_output_dir(self) -> str:
        return f"runs/{self.dataset_type}_{self.method}"

    def input_paths(self) -> dict[str, str]:
        """Every local input the run reads, by field name (hub ids excluded)."""
        names = (*self.model_fields, "data_dir", *self.path_fields)
        values = {n: getattr(self, n) for n in names}
        return {n: v for n, v in values.items() if v and not is_hub_id(v)}

    def missing_inputs(self) -> dict[str, str]:
        """The inputs of ``input_paths`` that do not exist."""
        return {n: p for n, p in self.input_paths().items() if not Path(p).exists()}

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (saved as ``run_dir/recipe.yaml``)."""
        return dataclasses.asdict(self)


# The loops' sampling and loop keys: an evaluation recipe accepts them (a loop's recipe may be reused) and ignores
# them with a warning, since it samples greedily (or at sc_temperature), without the pool, once per checkpoint.
LOOP_ONLY_KEYS = (
    "sample_count",
    "explore_count",
    "temperature",
    "temperature_iteration0",
    "use_prompt_pool",
    "prompt_pool_path",
    "answer_bootstrap",
    "answer_bootstrap_iterations",
    "check_point_root_path",
    "iteration_times",
    "compat",
    "heldout_size",
    "heldout_seed",
)


@documented
@dataclasses.dataclass(kw_only=True)
class InferenceRecipe(_BaseRecipe):
    """Checkpoint sweep (docs/method.md#checkpoint-sweep): greedy, one conversation per question, every checkpoint."""

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

    unused_keys = LOOP_ONLY_KEYS
    method = "inference"

    def __post_init__(self) -> None:
        self.model_root_path = resolve_path(self.model_root_path, "model_root_path")
        self.output_root_path = resolve_path(self.output_root_path, "output_root_path") or str(
            Path(self.model_root_path) / "eval"
        )
        super().__post_init__()
        require(self.limit is None or self.limit >= 1, "limit", f"must be >= 1, got {self.limit}")

    def _default_output_dir(self) -> str:
        return self.output_root_path

    def input_paths(self) -> dict[str, str]:
        return super().input_paths() | {"model_root_path": self.model_root_path}


@documented
@dataclasses.dataclass(kw_only=True)
class MultiSCRecipe(InferenceRecipe):
    """Multi-agent self-consistency (docs/method.md#self-consistency): k samples per question, then voting."""

    num_samples: int = field(50, help="conversations per question (k)")
    sc_temperature: float = field(0.5, help="sampling temperature")
    cluster_f1: float = field(0.9, help="answers with F1 >= this join one vote cluster (F1 tasks)")

    method = "multi_sc"

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.num_samples >= 1, "num_samples", f"must be >= 1, got {self.num_samples}")
        require(0 <= self.sc_temperature <= 2, "sc_temperature", f"must be in [0, 2], got {self.sc_temperature}")


SECRET_FIELDS = ("api_key",)


def redacted(values: dict[str, Any]) -> dict[str, Any]:
    """A recipe dict fit for disk and logs: secrets replaced by a marker."""
    return {k: ("<redacted>" if k in SECRET_FIELDS and v else v) for k, v in values.items()}


def save_recipe(recipe: _BaseRecipe, path: Path) -> None:
    """Write the validated recipe (secrets redacted); say which fields changed when resuming under another one."""
    import yaml

    current = redacted(recipe.to_dict())
    if path.exists():
        previous = yaml.safe_load(path.read_text()) or {}
        changed = sorted(k for k in set(previous) | set(current) if previous.get(k) != current.get(k))
        if changed:
            logger.warning("resuming %s with changed recipe fields: %s", path.parent, ", ".join(changed))
    write_yaml(path, current)
