"""Per-agent SFT with TRL (docs/method.md#training): handbook-style, run under ``accelerate launch``.

    accelerate launch --config_file alignment-handbook/recipes/accelerate_configs/cpu.yaml \
        alignment-handbook/scripts/run_sft.py --config <run>/iteration_0/trainer.yaml

The dataset (``dataset_name``: a ``save_to_disk`` folder with ``train``/``test`` splits and a ``messages``
column, one agent's view per row) is tokenised here with ``optima.training.masking``: loss only on that
agent's own utterances. The final model (LoRA merged) and tokenizer are saved to ``output_dir``, then a
completion marker with the training metrics.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def build_datasets(script_args, training_args, optima_args, tokenizer):
    """Load the saved dataset and tokenise each row with the per-agent mask."""
    from datasets import load_from_disk

    from optima.training.common import evaluation_split
    from optima.training.masking import tokenize_with_mask

    # In memory: the maps below (ours and TRL's) never write cache files into the dataset folder, from any rank.
    dataset = load_from_disk(script_args.dataset_name, keep_in_memory=True)

    def encode(row):
        messages = row["messages"]
        if not optima_args.mask_partner_turns:
            messages = [m | {"role": "assistant"} if m["role"] == "user" else m for m in messages]
        return tokenize_with_mask(tokenizer, messages, training_args.max_length)

    columns = dataset[script_args.dataset_train_split].column_names
    dataset = dataset.map(encode, remove_columns=columns)
    train = dataset[script_args.dataset_train_split]
    return train, evaluation_split(dataset, training_args, script_args.dataset_test_split)


def main(argv: list[str] | None = None) -> int:
    from transformers import set_seed
    from trl import ModelConfig, ScriptArguments, SFTConfig, SFTTrainer, TrlParser, get_peft_config

    from optima.logging_utils import setup_logging
    from optima.training.args import OptimaSFTArguments
    from optima.training.common import (
        load_model_and_tokenizer,
        preflight_rows,
        record_peak_rss,
        save_checkpoint,
        train_or_resume,
    )

    parser = TrlParser((ScriptArguments, SFTConfig, ModelConfig, OptimaSFTArguments))
    script_args, training_args, model_args, optima_args = parser.parse_args_and_config(argv)
    setup_logging()
    set_seed(training_args.seed)
    model, tokenizer = load_model_and_tokenizer(model_args, training_args)
    if optima_args.preflight:
        max_length = training_args.max_length or model.config.max_position_embeddings
        train, test = preflight_rows(tokenizer, training_args, max_length), None
    else:
        train, test = build_datasets(script_args, training_args, optima_args, tokenizer)
    logger.info(
        "sft | %d train rows, %s test rows | %s", len(train), len(test) if test else 0, training_args.output_dir
    )
    trainer = SFTTrainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=test,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
    )
    result = train_or_resume(trainer, training_args)
    if optima_args.preflight:
        record_peak_rss(training_args)
        return 0
    metrics = dict(result.metrics) | {"train_rows": len(train)}
    save_checkpoint(trainer, tokenizer, training_args.output_dir, metrics)
    return 0
