"""HotpotQA, distractor setting (Yang et al. 2018): information exchange over ten Wikipedia paragraphs.

Hub: `hotpotqa/hotpot_qa`, config `distractor`; local folder `hotpotqa/` with `train.jsonl` and `validation.jsonl`
in HotpotQA's release schema. Eval: first 1000 validation questions.
"""

from __future__ import annotations

from optima.tasks.multihop import MultiHopTask


class HotpotQA(MultiHopTask):
    """HotpotQA distractor: question, answer and paragraphs split between Alice and Bob."""

    name = "hotpot_qa"
    train_split = "train"
    eval_split = "validation"
    hub_name = "hotpotqa/hotpot_qa"
    hub_configs = ("distractor",)
    local_folder = "hotpotqa"
