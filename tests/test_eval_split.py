"""A dataset without test rows trains without evaluation instead of failing the stage.

Selection leaves the test split out when it has no rows (with fewer than about four kept conversations the 2%
test share rounds to zero), while the original's trainer recipes evaluate every epoch or every 100 steps:
``Trainer`` refuses an ``eval_strategy`` without an ``eval_dataset``. ``evaluation_split`` turns evaluation off
with a warning; both trainer scripts use it, checked here with TRL's real configs and one real run of each.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from optima.selection.sft import split_rows
from optima.store import save_splits
from optima.training.common import evaluation_split, is_complete, read_completion
from tests.helpers import arc_examples
from tests.test_dpo_train import PAIRS, run_dpo, run_trainer, write_config

REPO = Path(__file__).resolve().parent.parent
RUN_SFT = REPO / "alignment-handbook/scripts/run_sft.py"
SFT_ROWS = [
    {
        "messages": [
            {"role": "system", "content": "Alice and Bob answer ."},
            {"role": "user", "content": f"the answer of {a} + {b} is"},
            {"role": "assistant", "content": f"Alice : the answer is <A> {a + b} </A>"},
        ]
    }
    for a, b in ((1, 2), (2, 5), (3, 3), (4, 1))
]


def sft_config(**values):
    from trl import SFTConfig

    return SFTConfig(
        output_dir="unused", use_cpu=True, bf16=False, activation_checkpointing=False, report_to="none", **values
    )


def test_few_kept_conversations_leave_no_test_rows():
    utterances = [{"speaker": "Alice", "text": "<A>B</A>"}, {"speaker": "Bob", "text": "Right."}]
    kept = [{"example": example.to_dict(), "utterances": utterances} for example in arc_examples(3)]
    splits = split_rows(kept, 0.98, 42, 0)
    assert len(splits["train"]) == 6 and splits["test"] == []  # the case this file is about


def test_without_test_rows_evaluation_is_turned_off_with_a_warning(tmp_path, caplog):
    from datasets import load_from_disk

    save_splits({"train": SFT_ROWS, "test": []}, tmp_path / "data")
    splits = load_from_disk(str(tmp_path / "data"))
    assert "test" not in splits
    args = sft_config(eval_strategy="epoch", load_best_model_at_end=True, save_strategy="epoch")
    with caplog.at_level(logging.WARNING, logger="optima.training.common"):
        assert evaluation_split(splits, args, "test") is None
    assert args.eval_strategy == "no" and not args.do_eval and not args.load_best_model_at_end
    assert "training without evaluation" in caplog.text and "'epoch'" in caplog.text


def test_test_rows_are_used_and_no_evaluation_stays_off(tmp_path, caplog):
    from datasets import load_from_disk

    save_splits({"train": SFT_ROWS, "test": SFT_ROWS[:1]}, tmp_path / "data")
    splits = load_from_disk(str(tmp_path / "data"))
    args = sft_config(eval_strategy="steps", eval_steps=1)
    assert len(evaluation_split(splits, args, "test")) == 1 and args.eval_strategy == "steps"
    off = sft_config(eval_strategy="no")
    with caplog.at_level(logging.WARNING, logger="optima.training.common"):
        assert evaluation_split(splits, off, "test") is None
    assert caplog.text == ""  # not evaluating by choice is not worth a warning


def test_real_sft_run_without_test_rows_trains_without_evaluation(tiny_model, tmp_path):
    save_splits({"train": SFT_ROWS, "test": []}, tmp_path / "data")
    out = tmp_path / "checkpoint"
    config = yaml.safe_load(write_config(tmp_path / "base.yaml", tiny_model, tmp_path / "data", out).read_text())
    for key in ("beta", "max_prompt_length"):  # DPO-only settings
        config.pop(key)
    config |= {"eval_strategy": "epoch", "max_steps": 1, "packing": False}
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(config))
    run_trainer(RUN_SFT, tmp_path / "sft.yaml", tmp_path / "train.log")
    assert is_complete(out) and read_completion(out)["train_rows"] == 4
    assert "training without evaluation" in (tmp_path / "train.log").read_text()


def test_real_dpo_run_without_test_rows_trains_without_evaluation(tiny_model, tmp_path):
    save_splits({"train": PAIRS, "test": []}, tmp_path / "pairs")
    out = tmp_path / "checkpoint"
    config = write_config(tmp_path / "dpo.yaml", tiny_model, tmp_path / "pairs", out, eval_strategy="steps")
    run_dpo(config, tmp_path / "train.log")
    assert is_complete(out) and read_completion(out)["train_rows"] == 4
    assert "training without evaluation" in (tmp_path / "train.log").read_text()


@pytest.mark.parametrize("name", ["sft_train", "dpo_train"])
def test_both_trainer_scripts_go_through_evaluation_split(name):
    source = (REPO / "optima" / "training" / f"{name}.py").read_text()
    assert "evaluation_split(" in source and ".eval_strategy !=" not in source
