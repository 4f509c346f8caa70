"""Values derived from a recipe, one function each, used alike by the plan, the stages and the evaluation.

Pure: no process, no file. The reward's own rule, ``T_max``, lives with the formula (``optima.reward``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from optima.methods import DPO, TRAINERS, TrainerKind

if TYPE_CHECKING:
    from optima.config.loop_recipes import LoopRecipe, Recipe, SFTLoopRecipe

MATH_TASKS = ("gsm8k", "math")
# Texts per request to a vLLM server scoring LM loss, per text of an HF forward pass (``loss_batch_size``):
# a request is cheap to batch on the server, so it carries several forward passes' worth.
VLLM_LOSS_BATCH_FACTOR = 4
# A scored text is one utterance rendered as a lone assistant message: its tokens plus the chat template's.
SCORING_TEMPLATE_TOKENS = 64
# Tokens per step of the loss server on a GPU: each step's prompt log-probabilities are full-vocabulary logits of
# up to this many tokens (about 1.2 GiB for a 128k vocabulary), so it stays small; longer texts are prefilled in
# chunks.
SCORING_BATCHED_TOKENS = 1024


def generation_temperature(recipe: LoopRecipe, iteration: int) -> float:
    """Sampling temperature: ``temperature``; at iteration 0, 0.3 (0.7 for gsm8k/math) unless the recipe sets one."""
    if iteration > 0:
        return recipe.temperature
    if recipe.temperature_iteration0 is not None:
        return recipe.temperature_iteration0
    return 0.7 if recipe.dataset_type in MATH_TASKS else 0.3


def selection_range(recipe: SFTLoopRecipe) -> list[float]:
    """The [start, end) slice of questions, ranked by their best reward, that iSFT keeps."""
    if recipe.selection_range is not None:
        return list(recipe.selection_range)
    return [0.1, 0.8] if recipe.dataset_type == "math" else [0.0, 0.7]


def loss_model(recipe: LoopRecipe) -> str:
    """The fixed model whose LM loss scores readability: ``loss_model_path``, else the initial model."""
    return str(recipe.loss_model_path or recipe.initial_model_path)


def tokenizer_path(recipe: Recipe, agent: int = 0, model: str | None = None) -> str | None:
    """The tokenizer an agent's tokens are counted with: the recipe's own for that agent, else the model's.

    Args:
        recipe: Its ``tokenizer_first_path`` (agent 0, Alice) or ``tokenizer_second_path`` (agent 1, Bob).
        agent: 0 for the first agent, 1 for the second.
        model: The model served or evaluated (its tokenizer when the recipe names none); None: the initial model.

    Returns None when neither is known (an evaluation without an initial model and no model given).
    """
    named = recipe.tokenizer_second_path if agent == 1 else recipe.tokenizer_first_path
    path = named or model or recipe.initial_model_path
    return str(path) if path else None


def vllm_dtype_arg(vllm_extra_args: list[str]) -> str | None:
    """The ``--dtype`` a recipe's ``vllm_extra_args`` pass to vLLM (``--dtype X`` or ``--dtype=X``); None if none.

    A trailing ``--dtype`` without a value gives "" (set, but unknown).
    """
    args = list(vllm_extra_args)
    for i, arg in enumerate(args):
        if arg.startswith("--dtype="):
            return arg.split("=", 1)[1]
        if arg == "--dtype":
            return args[i + 1] if i + 1 < len(args) else ""
    return None


def vllm_loss_batch_size(recipe: LoopRecipe) -> int:
    """Texts per request when a vLLM server scores LM loss (``loss_batch_size`` is per HF forward pass)."""
    return VLLM_LOSS_BATCH_FACTOR * recipe.loss_batch_size


def loss_server_limits(recipe: LoopRecipe, model_max_len: int | None) -> tuple[int, int, int]:
    """``--max-model-len``, ``--max-num-seqs`` and ``--max-num-batched-tokens`` of the loss server on a GPU.

    It scores single utterances (at most ``max_tokens`` tokens, and never more than ``max_total_tokens`` in a
    conversation that gets a loss term) in requests of ``vllm_loss_batch_size`` texts: it needs neither vLLM's
    1,024 sequences nor the policy's context, and each of them costs memory at start-up (the sampler pass, vLLM's
    KV floor of one ``max_model_len`` request). Capped by ``max_model_len`` and the model's own context.
    """
    length = max(recipe.max_total_tokens, recipe.max_tokens) + SCORING_TEMPLATE_TOKENS
    length = min([length, *(cap for cap in (recipe.max_model_len, model_max_len) if cap)])
    seqs = vllm_loss_batch_size(recipe)
    batched = max(seqs, min(SCORING_BATCHED_TOKENS, seqs * length))
    if "--no-enable-chunked-prefill" in recipe.vllm_extra_args:  # vLLM then wants a whole prompt in one step
        batched = max(batched, length)
    return length, seqs, batched


def train_start(recipe: LoopRecipe, model: str, stage: str | None = None) -> str:
    """The model a training stage starts from (and, for DPO, its reference model).

    ``model`` is the one the stage's data came from. ``from_initial`` trains the initial model instead, except in
    the DPO stage of iSFT-DPO (``stage == "dpo"``), which always continues from the iteration's SFT checkpoint.
    """
    if recipe.from_initial and stage != DPO:
        return str(recipe.initial_model_path)
    return str(model)


def trainer_base_yaml(recipe: LoopRecipe, kind: TrainerKind) -> str:
    """The handbook-style base YAML of one trainer: ``origin_yaml_path`` (``sft``) or ``origin_dpo_yaml_path``."""
    return recipe.origin_dpo_yaml_path if kind == DPO else recipe.origin_yaml_path


def trainer_overrides_for(recipe: LoopRecipe, kind: TrainerKind) -> dict:
    """The ``trainer_overrides`` of one trainer (``sft`` or ``dpo``): the shared keys, then its own sub-mapping."""
    shared = {k: v for k, v in recipe.trainer_overrides.items() if k not in TRAINERS}
    return shared | recipe.trainer_overrides.get(kind, {})


def workers(recipe: Recipe, jobs: int | None = None) -> int:
    """Threads for ``jobs`` pieces of concurrent work: ``thread_count`` (requests in flight), at most one per job."""
    if jobs is None:
        return recipe.thread_count
    return max(1, min(recipe.thread_count, jobs))
