"""Plain TRL SFT, the baseline of ``bench/sft.py``: the same trainer YAML, TRL's own handling of ``messages``.

    .venvs/train/bin/python -m accelerate.commands.launch \
        --config_file alignment-handbook/recipes/accelerate_configs/cpu.yaml \
        bench/plain_sft.py --config /tmp/optima_bench_sft_x/plain.yaml

What a TRL user would write: ``TrlParser((ScriptArguments, SFTConfig, ModelConfig))``, the saved dataset reduced
to its conversational ``messages`` column, ``SFTTrainer`` with its defaults (chat template applied by TRL, loss on
every token), then ``save_model``. No per-agent masking: that is what ``optima.training.sft_train`` adds.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    import torch
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed
    from trl import ModelConfig, ScriptArguments, SFTConfig, SFTTrainer, TrlParser

    parser = TrlParser((ScriptArguments, SFTConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config(argv)
    set_seed(training_args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, dtype=torch.float32)
    train = load_from_disk(script_args.dataset_name)[script_args.dataset_train_split]
    train = train.select_columns(["messages"])
    trainer = SFTTrainer(model=model, args=training_args, train_dataset=train, processing_class=tokenizer)
    trainer.train()
    trainer.save_model(training_args.output_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
