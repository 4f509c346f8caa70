"""DPO / RPO on the tree-search pairs with TRL: handbook-style, under ``accelerate launch``.

See docs/method.md#dpo-and-rpo.

    accelerate launch --config_file alignment-handbook/recipes/accelerate_configs/cpu.yaml \
        alignment-handbook/scripts/run_dpo.py --config <run>/iteration_0/dpo_trainer.yaml

The YAML holds ``ScriptArguments``, ``DPOConfig`` and ``ModelConfig`` fields of the installed TRL plus
``OptimaDPOArguments`` (``optima.training.args``). ``dataset_name`` is the ``save_to_disk`` folder written by
``optima.selection.dpo.save_pairs``: conversational ``prompt`` / ``chosen`` / ``rejected`` columns (the metadata
columns are dropped here). TRL renders them with the chat template: the prompt (ending with a ``user`` turn) with
the generation prompt, then prompt + the one ``assistant`` turn; the completion is what follows the common prefix,
so for ChatML (SmolLM2) the completion is ``"Alice: text<|im_end|>\\n"``.

Two settings of the method's trainer recipes that TRL 1.16 no longer has are mapped here (docs/method.md#dpo-and-rpo):

* **RPO** (iDPO: ``rpo_alpha: 1.0``; iSFT-DPO: ``rpo_alpha: null``, plain sigmoid DPO). TRL 0.10 added
  ``rpo_alpha`` × the mean token NLL of the chosen completions to the sigmoid DPO loss. TRL 1.16 combines losses by
  lists instead (``DPOConfig.loss_type`` + ``loss_weights``, summed as ``Σ weight_i · mean(loss_i)``) and its
  ``"sft"`` loss is exactly that NLL (``-mean`` of the chosen completion tokens' log-probs over the batch). So
  ``rpo_alpha = a`` becomes ``loss_type = [..., "sft"]``, ``loss_weights = [..., a]`` (``apply_rpo``). With the
  only value the recipes use, 1.0, this equals TRL 0.10's loss (some TRL 0.9/0.10 releases wrote the RPO loss as
  ``alpha · dpo + nll``; the two forms agree at 1.0).
* **max_prompt_length** (``truncate_pair``), TRL 0.10's rule: when prompt + longer completion exceed
  ``max_length``, the prompt keeps its last ``max_prompt_length`` tokens (the most recent turns; the old
  ``truncation_mode: keep_end``); if that is still too long the completions are cut to fit. It runs after TRL's
  tokenisation and before TRL's own filter, which would otherwise drop every pair whose prompt alone fills
  ``max_length``. ``max_prompt_length < max_length`` is checked before anything loads.

Reference model: the iteration's starting checkpoint, i.e. ``model_name_or_path``. With full fine-tuning TRL
loads a second copy from the policy's ``config._name_or_path`` (same path, same dtype); with ``use_peft: true``
there is no copy, the reference log-probs come from the same model with the adapter disabled. The final model
(LoRA merged) and tokenizer are saved to ``output_dir``, then the completion marker with the metrics (final loss
and every logged loss included).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from optima.methods import SFT

logger = logging.getLogger(__name__)

PAIR_COLUMNS = ("prompt", "chosen", "rejected")


def validate_lengths(max_length: int | None, max_prompt_length: int | None) -> None:
    """Fail early on prompt/sequence lengths TRL would handle degenerately (such as max_length 512 <
    max_prompt_length 1024, docs/method.md#dpo-and-rpo).

    Args:
        max_length: ``DPOConfig.max_length`` (prompt + completion tokens).
        max_prompt_length: ``OptimaDPOArguments.max_prompt_length``.
    """
    if max_prompt_length is None:
        return
    if max_prompt_length < 1:
        raise ValueError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
    if max_length is None:
        raise ValueError(f"max_prompt_length ({max_prompt_length}) needs max_length to be set (it is null)")
    if max_prompt_length >= max_length:
        raise ValueError(
            f"max_prompt_length ({max_prompt_length}) must be smaller than max_length ({max_length}), "
            "otherwise no completion token fits; lower max_prompt_length or raise max_length in the trainer YAML"
        )


def truncate_pair(
    prompt_ids: list[int], chosen_ids: list[int], rejected_ids: list[int], max_length: int, max_prompt_length: int
) -> dict[str, list[int]]:
    """Make prompt + each completion fit ``max_length`` the TRL 0.10 way (prompt end kept, then completions cut).

    Args:
        prompt_ids: The tokenised prompt (generation prompt included).
        chosen_ids: The tokenised chosen completion.
        rejected_ids: The tokenised rejected completion.
        max_length: Tokens of prompt + completion at most.
        max_prompt_length: Prompt tokens kept when the pair is too long (< ``max_length``).
    """
    longest = max(len(chosen_ids), len(rejected_ids))
    if len(prompt_ids) + longest > max_length:
        prompt_ids = prompt_ids[-max_prompt_length:]
    if len(prompt_ids) + longest > max_length:
        room = max_length - len(prompt_ids)
        chosen_ids, rejected_ids = chosen_ids[:room], rejected_ids[:room]
    return {"prompt_ids": prompt_ids, "chosen_ids": chosen_ids, "rejected_ids": rejected_ids}


def apply_rpo(training_args: Any, rpo_alpha: float | None) -> None:
    """Add the NLL-on-chosen term (``"sft"`` loss, weight ``rpo_alpha``) to ``training_args.loss_type``.

    Args:
        training_args: The parsed ``DPOConfig`` (changed in place).
        rpo_alpha: Weight of the NLL term; None or 0 leaves the loss as configured (plain DPO by default).
    """
    if not rpo_alpha:
        return
    loss_types = list(training_args.loss_type)
    if SFT in loss_types:
        raise ValueError(
            f"rpo_alpha ({rpo_alpha}) adds the 'sft' loss, but loss_type already has it ({loss_types}); "
            "set only one of them"
        )
    weights = list(training_args.loss_weights or [1.0] * len(loss_types))
    training_args.loss_type = [*loss_types, SFT]  # TRL names the NLL-on-chosen loss after SFT
    training_args.loss_weights = [*weights, float(rpo_alpha)]


def load_pair_splits(script_args: Any, training_args: Any):
    """The train split (and the test split when evaluating) with only the prompt/chosen/rejected columns."""
    from datasets import load_from_disk

    from optima.training.common import evaluation_split

    # In memory: no rank writes datasets cache files into the dataset folder (TRL maps it once per process).
    data = load_from_disk(script_args.dataset_name, keep_in_memory=True)
    train = data[script_args.dataset_train_split].select_columns(list(PAIR_COLUMNS))
    test = evaluation_split(data, training_args, script_args.dataset_test_split)
    return train, None if test is None else test.select_columns(list(PAIR_COLUMNS))


def build_trainer_class():
    """``DPOTrainer`` with ``max_prompt_length`` (TRL is imported here, never at module import)."""
    from accelerate import PartialState
    from trl import DPOTrainer

    class OptimaDPOTrainer(DPOTrainer):
        """TRL's DPOTrainer, plus the prompt truncation TRL 1.x dropped (see ``truncate_pair``)."""

        def __init__(self, *args, max_prompt_length: int | None = None, **kwargs):
            self.optima_max_prompt_length = max_prompt_length
            super().__init__(*args, **kwargs)

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            if self.optima_max_prompt_length is None:
                return super()._prepare_dataset(dataset, processing_class, args, dataset_name)
            # Tokenise without TRL's max_length filter, truncate our way, after which that filter has nothing to do.
            untruncated = copy.copy(args)
            untruncated.max_length = None
            dataset = super()._prepare_dataset(dataset, processing_class, untruncated, dataset_name)
            lengths = {"max_length": args.max_length, "max_prompt_length": self.optima_max_prompt_length}
            with PartialState().main_process_first():  # one process writes the datasets cache, as TRL's own maps
                return dataset.map(
                    lambda row: truncate_pair(row["prompt_ids"], row["chosen_ids"], row["rejected_ids"], **lengths),
                    num_proc=args.dataset_num_proc,
                    desc=f"Truncating {dataset_name} prompts to max_prompt_length",
                )

    return OptimaDPOTrainer


def logged_losses(trainer: Any) -> list[float]:
    """The training losses the trainer logged, in order."""
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def main(argv: list[str] | None = None) -> int:
    from transformers import set_seed
    from trl import DPOConfig, ModelConfig, ScriptArguments, TrlParser, get_peft_config

    from optima.logging_utils import setup_logging
    from optima.training.args import OptimaDPOArguments
    from optima.training.common import (
        load_model_and_tokenizer,
        preflight_rows,
        record_peak_rss,
        save_checkpoint,
        train_or_resume,
    )

    parser = TrlParser((ScriptArguments, DPOConfig, ModelConfig, OptimaDPOArguments))
    script_args, training_args, model_args, optima_args = parser.parse_args_and_config(argv)
    validate_lengths(training_args.max_length, optima_args.max_prompt_length)  # before anything loads
    apply_rpo(training_args, optima_args.rpo_alpha)
    setup_logging()
    set_seed(training_args.seed)
    model, tokenizer = load_model_and_tokenizer(model_args, training_args)
    if optima_args.preflight:
        max_length = training_args.max_length or model.config.max_position_embeddings
        prompt = optima_args.max_prompt_length or max_length // 2
        train, test = preflight_rows(tokenizer, training_args, max_length, prompt), None
    else:
        train, test = load_pair_splits(script_args, training_args)
    logger.info(
        "dpo | %d train pairs, %s test pairs | loss %s weights %s | %s",
        len(train), len(test) if test else 0, training_args.loss_type, training_args.loss_weights,
        training_args.output_dir,
    )  # fmt: skip
    trainer = build_trainer_class()(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=test,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
        max_prompt_length=optima_args.max_prompt_length,
    )
    result = train_or_resume(trainer, training_args)
    if optima_args.preflight:
        record_peak_rss(training_args)
        return 0
    losses = logged_losses(trainer)
    metrics = dict(result.metrics) | {
        "train_rows": len(train),
        "final_loss": losses[-1] if losses else None,
        "losses": losses,
        "loss_type": list(training_args.loss_type),
        "loss_weights": list(training_args.loss_weights) if training_args.loss_weights else None,
    }
    save_checkpoint(trainer, tokenizer, training_args.output_dir, metrics)
    return 0
