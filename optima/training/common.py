"""Pieces shared by the SFT and DPO trainer scripts (run inside the training env, under accelerate)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "optima_complete.json"


def load_model_and_tokenizer(model_args: Any, training_args: Any):
    """The policy model and its tokenizer, from ``model_name_or_path`` (hub id or folder)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_args.model_name_or_path
    tokenizer = AutoTokenizer.from_pretrained(path)
    dtype = model_args.dtype if model_args.dtype in (None, "auto") else getattr(torch, model_args.dtype)
    kwargs = {"dtype": dtype}
    if model_args.attn_implementation:
        kwargs["attn_implementation"] = model_args.attn_implementation
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if tokenizer.pad_token is None:
        # Labels are built explicitly, so pad == eos no longer hides end-of-turn tokens (docs/method.md D17).
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def save_checkpoint(trainer: Any, tokenizer: Any, output_dir: str, metrics: dict[str, Any]) -> None:
    """Save a servable checkpoint (LoRA merged into the weights), then the completion marker, last."""
    model = trainer.model
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    if trainer.accelerator.is_main_process:
        trainer.accelerator.unwrap_model(model).save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
        Path(output_dir, COMPLETE_MARKER).write_text(json.dumps(metrics, indent=2) + "\n")
    trainer.accelerator.wait_for_everyone()


def is_complete(checkpoint: Path) -> bool:
    """True when a trainer script finished writing ``checkpoint``."""
    return (Path(checkpoint) / COMPLETE_MARKER).is_file()


def read_completion(checkpoint: Path) -> dict[str, Any]:
    """The metrics a trainer script wrote with its completion marker."""
    return json.loads((Path(checkpoint) / COMPLETE_MARKER).read_text())
