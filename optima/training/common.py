"""Pieces shared by the SFT and DPO trainer scripts (run inside the training env, under accelerate)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from optima.identity import COMPLETE_MARKER, WEIGHTS_ID_KEY, new_weights_id, read_marker

logger = logging.getLogger(__name__)

STATE_ENV = "OPTIMA_TRAINER_STATE"  # where the trainer writes its TrainerState after every step (the driver's bar)
PEAK_RSS_FILE = "peak_rss_{rank}.json"  # a preflight rank's peak resident memory, in its output_dir
FILLER = " the"  # synthetic text: one token per word for the usual tokenizers


def state_callback() -> Any:
    """A ``TrainerCallback`` writing the trainer state to ``$OPTIMA_TRAINER_STATE`` (None when it is unset).

    Only the main process writes; each write replaces the file atomically, so a reader never sees half of it.
    """
    path = os.environ.get(STATE_ENV)
    if not path:
        return None
    from transformers import TrainerCallback

    class StateFileCallback(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                state.save_to_json(f"{path}.tmp")
                os.replace(f"{path}.tmp", path)

        on_train_begin = on_log = on_step_end

    return StateFileCallback()


def resolve_attn_implementation(requested: str, warn: bool = True) -> str:
    """``requested``, or ``sdpa`` when it is ``flash_attention_2`` and flash-attn cannot run here (one warning).

    The Llama-3 trainer YAMLs ask for flash-attn; it needs the ``flash_attn`` package built for the installed
    torch/CUDA and a GPU. Without them transformers would fail at model load; PyTorch's SDPA computes the same
    attention, more slowly on long sequences.

    Args:
        requested: ``attn_implementation`` from the trainer YAML.
        warn: Log the fallback (the main process only, so that a multi-process run warns once).
    """
    if requested != "flash_attention_2":
        return requested
    from transformers.utils import is_flash_attn_2_available

    if is_flash_attn_2_available():
        return requested
    if warn:
        logger.warning(
            "attn_implementation: flash_attention_2 was asked for, but flash-attn is not installed or no CUDA GPU "
            "is visible; using sdpa instead"
        )
    return "sdpa"


def load_model_and_tokenizer(model_args: Any, training_args: Any):
    """The policy model and its tokenizer, from ``model_name_or_path`` (hub id or folder)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_args.model_name_or_path
    tokenizer = AutoTokenizer.from_pretrained(path)
    dtype = model_args.dtype if model_args.dtype in (None, "auto") else getattr(torch, model_args.dtype)
    kwargs = {"dtype": dtype}
    if model_args.attn_implementation:
        kwargs["attn_implementation"] = resolve_attn_implementation(
            model_args.attn_implementation, warn=training_args.process_index == 0
        )
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if tokenizer.pad_token is None:
        # Labels are built explicitly, so pad == eos no longer hides end-of-turn tokens (docs/method.md D17).
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def describe_sharding(trainer: Any) -> str:
    """How the model is spread over the processes: ``fsdp``, ``deepspeed zero-<stage>`` or ``replicated``."""
    accelerator = trainer.accelerator
    kind = str(accelerator.distributed_type).rsplit(".", 1)[-1].lower()
    if kind == "deepspeed":
        return f"deepspeed zero-{accelerator.state.deepspeed_plugin.zero_stage}"
    if kind == "fsdp":
        return "fsdp"
    # accelerate's launcher exports these for an FSDP / DeepSpeed config; on CPU processes accelerate may still
    # run the model whole on every process (its FSDP needs an accelerator device), which is worth saying.
    asked = [name for name in ("FSDP", "DEEPSPEED") if os.environ.get(f"ACCELERATE_USE_{name}", "").lower() == "true"]
    if asked and trainer.args.process_index == 0:
        logger.warning("the accelerate config asks for %s, but accelerate runs the model whole on every process "
                       "(%s): nothing is sharded", asked[0], kind)  # fmt: skip
    return f"replicated ({kind})"


def train_or_resume(trainer: Any, training_args: Any) -> Any:
    """``trainer.train()``, continuing from the newest saved trainer state when the YAML asks to resume.

    The trainer state also goes to ``$OPTIMA_TRAINER_STATE`` after every step (``state_callback``).
    """
    from optima.training.checkpoint import resume_checkpoint

    callback = state_callback()  # the driver's progress bar reads the state it writes
    if callback is not None:
        trainer.add_callback(callback)
    resume = resume_checkpoint(training_args)
    logger.info(
        "train | process %d of %d | %s",
        training_args.process_index + 1, training_args.world_size, describe_sharding(trainer),
    )  # fmt: skip
    if resume is not None:
        logger.info("train | resuming from %s", resume)
    elif training_args.resume_from_checkpoint:
        logger.info("train | resume_from_checkpoint is set but %s holds no trainer checkpoint yet: starting fresh",
                    training_args.output_dir)  # fmt: skip
    return trainer.train(resume_from_checkpoint=resume)


def preflight_rows(tokenizer: Any, training_args: Any, max_length: int, prompt_length: int | None = None) -> Any:
    """Rows for one optimizer step (batch x accumulation x processes) at the length limits.

    SFT (``prompt_length`` None): ``max_length`` tokens, all trained. DPO: a prompt of ``prompt_length`` words and
    completions that fill the rest, cut to ``max_length`` by the trainer's own truncation.
    """
    from datasets import Dataset

    count = training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps
    count *= training_args.world_size
    if prompt_length is None:
        token = tokenizer(FILLER, add_special_tokens=False)["input_ids"][-1]
        return Dataset.from_list([{"input_ids": [token] * max_length, "labels": [token] * max_length}] * count)
    prompt = [{"role": "user", "content": FILLER * prompt_length}]
    completion = [{"role": "assistant", "content": FILLER * max_length}]
    return Dataset.from_list([{"prompt": prompt, "chosen": completion, "rejected": completion}] * count)


def record_peak_rss(training_args: Any) -> None:
    """Write this rank's peak resident memory (rank 0 adds its launcher's) to ``PEAK_RSS_FILE`` in output_dir."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    if training_args.process_index == 0:  # accelerate launch (or torchrun's agent): VmHWM of the parent
        status = Path(f"/proc/{os.getppid()}/status").read_text()
        peak += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) * 1024
    out = Path(training_args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / PEAK_RSS_FILE.format(rank=training_args.process_index)).write_text(json.dumps({"bytes": peak}))


def evaluation_split(splits: Any, training_args: Any, split: str) -> Any:
    """The split to evaluate on, or None; without test rows, evaluation is turned off (with a warning).

    Selection leaves the test split out when it got no rows (fewer than about four kept conversations or
    questions), and ``Trainer`` refuses an ``eval_strategy`` without an ``eval_dataset``: training goes on
    without evaluation instead of failing the stage.

    Args:
        splits: The loaded ``DatasetDict``.
        training_args: The trainer's arguments (``eval_strategy``, ``load_best_model_at_end`` are changed).
        split: Name of the test split (``dataset_test_split``).
    """
    if training_args.eval_strategy == "no":
        return None
    test = splits[split] if split in splits else None
    if test is not None and len(test) > 0:
        return test
    logger.warning(
        "no %r rows to evaluate on: training without evaluation (eval_strategy was %r)",
        split,
        getattr(training_args.eval_strategy, "value", training_args.eval_strategy),
    )
    from transformers.trainer_utils import IntervalStrategy

    training_args.eval_strategy = IntervalStrategy.NO
    training_args.do_eval = False
    training_args.load_best_model_at_end = False  # there is no evaluation to pick a best model by
    return None


def save_checkpoint(trainer: Any, tokenizer: Any, output_dir: str, metrics: dict[str, Any]) -> None:
    """Save a servable checkpoint (shards gathered, LoRA merged), check it, then write the completion marker.

    Every process calls this (gathering sharded weights and the probe's forward passes are collective); only the
    main process writes. The marker is written after ``verify_saved_checkpoint`` passed (the state dict in memory,
    the files' headers), so a broken save is never taken for a finished one. It carries a fresh ``weights_id`` and
    the weights probe of the trained model (``optima.identity``), against which every later reload of this
    checkpoint into a server is checked.
    """
    from optima.identity import PROBE_KEY, record_probe
    from optima.training.checkpoint import remove_trainer_checkpoints, save_servable, verify_saved_checkpoint

    probe = record_probe(trainer.model, tokenizer)
    state_dict = save_servable(trainer, tokenizer, output_dir)
    if trainer.accelerator.is_main_process:
        tensors = verify_saved_checkpoint(Path(output_dir), state_dict)
        logger.info("checkpoint | %d tensors verified in %s", tensors, output_dir)
        marker = metrics | {"tensors": tensors, WEIGHTS_ID_KEY: new_weights_id(), PROBE_KEY: probe.to_json()}
        Path(output_dir, COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        remove_trainer_checkpoints(Path(output_dir))
    trainer.accelerator.wait_for_everyone()


def is_complete(checkpoint: Path) -> bool:
    """True when a trainer script finished writing ``checkpoint``."""
    return (Path(checkpoint) / COMPLETE_MARKER).is_file()


def read_completion(checkpoint: Path) -> dict[str, Any]:
    """The metrics a trainer script wrote with its completion marker (its weights probe left out: not a metric)."""
    from optima.identity import PROBE_KEY

    marker = read_marker(checkpoint)
    if marker is None:
        raise FileNotFoundError(Path(checkpoint) / COMPLETE_MARKER)
    return {key: value for key, value in marker.items() if key != PROBE_KEY}
