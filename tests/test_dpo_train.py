"""DPO trainer: length checks, prompt truncation, the RPO mapping, chat rendering, and real TRL runs.

See docs/method.md#dpo-and-rpo.

The real runs train the tiny random Llama (``tests/tiny_model.py``) for two steps under ``accelerate launch`` on
four pairs written with its vocabulary, once as iDPO (``rpo_alpha: 1.0``) and once as plain DPO, then check the
weights changed, the logged first-step loss is log 2 (+ the chosen NLL for RPO), and the DPO loss on the batch,
recomputed here with a few lines of torch against the untouched reference, went down.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from optima.identity import PROBE_KEY
from optima.selection.dpo import build_pair_row
from optima.store import save_splits
from optima.training.common import is_complete, read_completion
from optima.training.dpo_train import apply_rpo, truncate_pair, validate_lengths
from tests.conftest import SMOLLM2, requires_smollm2
from tests.helpers import arc_examples, tiny_trainer_yaml

REPO = Path(__file__).resolve().parent.parent
ACCELERATE_CPU = REPO / "alignment-handbook/recipes/accelerate_configs/cpu.yaml"
RUN_DPO = REPO / "alignment-handbook/scripts/run_dpo.py"
BETA = 0.1

# Four pairs in the tiny model's vocabulary: chosen answers with the tag, rejected ramble (same pattern each time).
PAIRS = [
    {
        "prompt": [
            {"role": "system", "content": "Alice and Bob answer ."},
            {"role": "user", "content": f"the answer of {a} + {b} is"},
        ],
        "chosen": [{"role": "assistant", "content": f"Alice : the answer is <A> {a + b} </A>"}],
        "rejected": [{"role": "assistant", "content": f"Alice : {b} {b} + {a} = {a} {b} ."}],
        "task_id": f"q{a}",  # metadata columns, dropped by the trainer
        "chosen_value": 1.0,
    }
    for a, b in ((1, 2), (2, 5), (3, 3), (4, 1))
]


# ---------------------------------------------------------------- pure helpers


@pytest.mark.parametrize(
    ("max_length", "max_prompt_length", "error"),
    [
        (1024, 768, None),
        (1024, None, None),
        (None, None, None),
        (512, 1024, "must be smaller than max_length"),  # the original's four qa iSFT-DPO recipes
        (512, 512, "must be smaller than max_length"),
        (None, 128, "needs max_length"),
        (512, 0, ">= 1"),
    ],
)
def test_validate_lengths(max_length, max_prompt_length, error):
    if error is None:
        validate_lengths(max_length, max_prompt_length)
    else:
        with pytest.raises(ValueError, match=error):
            validate_lengths(max_length, max_prompt_length)


def test_truncate_pair_keeps_the_prompt_end_then_cuts_completions():
    prompt, chosen, rejected = list(range(100)), [1000, 1001, 1002], [2000]
    fits = truncate_pair(prompt, chosen, rejected, 103, 50)  # untouched, even above max_prompt_length
    assert fits == {"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected}
    cut = truncate_pair(prompt, chosen, rejected, 102, 50)
    assert cut["prompt_ids"] == list(range(50, 100)) and cut["chosen_ids"] == chosen
    long_completion = list(range(500, 580))
    cut = truncate_pair(prompt, long_completion, rejected, 120, 50)
    assert cut["prompt_ids"] == list(range(50, 100)) and cut["chosen_ids"] == long_completion[:70]
    assert len(cut["prompt_ids"]) + len(cut["chosen_ids"]) == 120 and cut["rejected_ids"] == rejected


def test_apply_rpo_adds_the_weighted_nll_term():
    args = SimpleNamespace(loss_type=["sigmoid"], loss_weights=None)
    apply_rpo(args, 1.0)
    assert (args.loss_type, args.loss_weights) == (["sigmoid", "sft"], [1.0, 1.0])
    args = SimpleNamespace(loss_type=["sigmoid", "sigmoid_norm"], loss_weights=[1.0, 0.5])
    apply_rpo(args, 0.25)
    assert (args.loss_type, args.loss_weights) == (["sigmoid", "sigmoid_norm", "sft"], [1.0, 0.5, 0.25])
    for alpha in (None, 0.0):
        plain = SimpleNamespace(loss_type=["sigmoid"], loss_weights=None)
        apply_rpo(plain, alpha)
        assert (plain.loss_type, plain.loss_weights) == (["sigmoid"], None)
    with pytest.raises(ValueError, match="already has it"):
        apply_rpo(SimpleNamespace(loss_type=["sigmoid", "sft"], loss_weights=None), 1.0)


# ---------------------------------------------------------------- chat rendering of the pair rows


def _pair_row():
    """A pair at depth 2 (Alice to speak) built by ``optima.selection.dpo``."""
    path = [("Alice", "I pick <A>B</A>"), ("Bob", "Step 1 is wrong.")]
    chosen = {"speaker": "Alice", "text": "Fixed: <A>C</A>", "value": 0.9}
    rejected = {"speaker": "Alice", "text": "<A>B</A>", "value": 0.1}
    return build_pair_row(arc_examples(1)[0], path, chosen, rejected, {"id": 2, "depth": 2})


def _tokenizers():
    from tests.tiny_model import build_tiny_tokenizer

    yield build_tiny_tokenizer()
    if (SMOLLM2 / "tokenizer_config.json").exists():
        from transformers import AutoTokenizer

        yield AutoTokenizer.from_pretrained(SMOLLM2)


def test_pair_rows_render_as_prompt_then_one_assistant_turn_with_chatml():
    row = _pair_row()
    assert row["prompt"][-1]["role"] == "user"
    for tokenizer in _tokenizers():
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        for key in ("chosen", "rejected"):
            full = tokenizer.apply_chat_template(row["prompt"] + row[key], tokenize=False)
            assert full.startswith(prompt) and prompt.endswith("<|im_start|>assistant\n")
            assert full[len(prompt) :] == row[key][0]["content"] + "<|im_end|>\n"


@requires_smollm2
def test_smollm2_tokenises_the_prompt_as_a_prefix_of_prompt_plus_completion():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    row = _pair_row()
    prompt_ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, return_dict=True)
    full_ids = tokenizer.apply_chat_template(row["prompt"] + row["chosen"], return_dict=True)
    prompt_ids, full_ids = prompt_ids["input_ids"], full_ids["input_ids"]
    assert full_ids[: len(prompt_ids)] == prompt_ids
    assert tokenizer.decode(full_ids[len(prompt_ids) :]) == "Alice: Fixed: <A>C</A><|im_end|>\n"


# ---------------------------------------------------------------- the trainer class and the script


def test_trainer_truncates_long_prompts_instead_of_dropping_them(tiny_model, tmp_path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig

    from optima.training.dpo_train import build_trainer_class

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    long_row = dict(PAIRS[0], prompt=[PAIRS[0]["prompt"][0], {"role": "user", "content": "1 + 2 = 3 . " * 30}])
    rows = [{key: row[key] for key in ("prompt", "chosen", "rejected")} for row in (long_row, PAIRS[1])]
    args = DPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, activation_checkpointing=False, max_length=64,
        report_to="none", precompute_ref_log_probs=True, precompute_ref_batch_size=2,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    trainer = build_trainer_class()(
        model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer, max_prompt_length=40
    )
    long, short = trainer.train_dataset[0], trainer.train_dataset[1]
    full_prompt = tokenizer.apply_chat_template(long_row["prompt"], add_generation_prompt=True, return_dict=True)
    assert len(full_prompt["input_ids"]) > 64  # alone longer than max_length: TRL 1.16 would drop this pair
    assert long["prompt_ids"] == full_prompt["input_ids"][-40:]  # the most recent tokens, generation prompt last
    assert len(long["prompt_ids"]) + max(len(long["chosen_ids"]), len(long["rejected_ids"])) <= 64
    assert tokenizer.decode(long["chosen_ids"]) == "Alice : the answer is < A > 3 < / A > <|im_end|>"
    short_prompt = tokenizer.apply_chat_template(PAIRS[1]["prompt"], add_generation_prompt=True, return_dict=True)
    assert short["prompt_ids"] == short_prompt["input_ids"]  # short pairs are untouched


def write_config(path: Path, model: Path, dataset: Path, output: Path, **extra) -> Path:
    """A handbook-style DPO trainer YAML for the tiny model on CPU."""
    dpo = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "max_steps": 2}
    dpo |= {"learning_rate": 3.0e-3, "beta": BETA, "max_length": 128, "max_prompt_length": 96}
    return tiny_trainer_yaml(path, model, dataset, output, **(dpo | extra))


def test_the_script_rejects_max_prompt_length_not_below_max_length(tmp_path):
    from optima.training.dpo_train import main

    config = write_config(tmp_path / "dpo.yaml", tmp_path / "no-model", tmp_path / "no-data", tmp_path / "out")
    config.write_text(config.read_text().replace("max_prompt_length: 96", "max_prompt_length: 128"))
    with pytest.raises(ValueError, match=r"max_prompt_length \(128\) must be smaller than max_length \(128\)"):
        main(["--config", str(config)])  # fails before loading anything (the model path does not exist)


def completion_logps(model, tokenizer, row: dict, key: str):
    """Per-token log-probs of ``row[key]`` after ``row["prompt"]``, tokenised as TRL does."""
    import torch

    prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, return_dict=True)["input_ids"]
    full = tokenizer.apply_chat_template(row["prompt"] + row[key], return_dict=True)["input_ids"]
    assert full[: len(prompt)] == prompt
    ids = torch.tensor([full])
    with torch.no_grad():
        logps = model(ids).logits[0, :-1].log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0]
    return logps[len(prompt) - 1 :]


def dpo_loss(policy, reference, tokenizer, rows) -> float:
    """Mean sigmoid DPO loss of ``rows`` (sequence log-prob sums over the completion tokens)."""
    import torch.nn.functional as F

    def log_ratio(row, key):
        return (
            completion_logps(policy, tokenizer, row, key).sum()
            - completion_logps(reference, tokenizer, row, key).sum()
        )

    losses = [-F.logsigmoid(BETA * (log_ratio(row, "chosen") - log_ratio(row, "rejected"))) for row in rows]
    return float(sum(losses) / len(losses))


def chosen_nll(model, tokenizer, rows) -> float:
    """Mean NLL of all chosen completion tokens of the batch (TRL's ``"sft"`` loss)."""
    import torch

    return float(-torch.cat([completion_logps(model, tokenizer, row, "chosen") for row in rows]).mean())


def run_dpo(config: Path, log: Path) -> None:
    run_trainer(RUN_DPO, config, log)


def run_trainer(script: Path, config: Path, log: Path) -> None:
    """Run a handbook trainer script under ``accelerate launch`` on the CPU; fail with its log's tail."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CPU), str(script)]
    with log.open("w") as handle:
        result = subprocess.run(
            [*argv, "--config", str(config)], cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT, check=False
        )
    assert result.returncode == 0, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def pair_dataset(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dpo_data") / "pairs"
    save_splits({"train": PAIRS, "test": PAIRS[:1]}, path)
    return path


LORA = {"use_peft": True, "lora_r": 8, "lora_alpha": 16, "learning_rate": 0.03}  # reference = adapter disabled


@pytest.mark.parametrize(
    ("rpo_alpha", "extra"),
    [
        pytest.param(1.0, {}, id="idpo_rpo"),
        pytest.param(None, {}, id="plain_dpo"),
        pytest.param(1.0, LORA, id="idpo_lora", marks=pytest.mark.slow),
    ],
)
def test_dpo_training_lowers_the_dpo_loss(rpo_alpha, extra, tiny_model, pair_dataset, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "checkpoint"
    extra = extra | ({} if rpo_alpha is None else {"rpo_alpha": rpo_alpha})
    run_dpo(write_config(tmp_path / "dpo.yaml", tiny_model, pair_dataset, out, **extra), tmp_path / "train.log")

    assert is_complete(out) and (out / "tokenizer_config.json").exists()
    metrics = read_completion(out)
    assert metrics["loss_type"] == (["sigmoid"] if rpo_alpha is None else ["sigmoid", "sft"])
    assert (
        metrics["train_rows"] == 4 and len(metrics["losses"]) == 2 and metrics["final_loss"] == metrics["losses"][-1]
    )

    before, after = load_file(tiny_model / "model.safetensors"), load_file(out / "model.safetensors")
    assert any(not torch.equal(before[name], after[name]) for name in before)

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    policy = AutoModelForCausalLM.from_pretrained(out).eval()
    # Step 1 sees policy == reference: the DPO term is log 2, RPO adds the chosen NLL of the initial model.
    expected_first = math.log(2) + (0.0 if rpo_alpha is None else rpo_alpha * chosen_nll(reference, tokenizer, PAIRS))
    assert metrics["losses"][0] == pytest.approx(expected_first, abs=2e-3)
    assert metrics["losses"][1] < metrics["losses"][0]
    assert dpo_loss(policy, reference, tokenizer, PAIRS) < math.log(2) - 0.01
    marker = json.loads((out / "optima_complete.json").read_text())
    assert marker.pop(PROBE_KEY)["continuation_ids"] and marker == metrics  # the metrics and the weights probe
