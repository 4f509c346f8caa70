"""2WikiMultiHopQA (Ho et al. 2020): information exchange over Wikipedia paragraphs (task `mwh_qa`).

There is no canonical hub copy, so this task only loads from a local folder `2wikimultihopqa/` with `train.jsonl`
and `dev.jsonl`, or the release's own `train.json` / `dev.json` arrays, in the release's schema.
Eval: first 1000 dev questions.
"""

from __future__ import annotations

from optima.tasks.multihop import MultiHopTask


class MultiWikiHopQA(MultiHopTask):
    """2WikiMultiHopQA: question, answer and paragraphs split between Alice and Bob."""

    name = "mwh_qa"
    train_split = "train"
    eval_split = "dev"
    hub_name = None
    local_folder = "2wikimultihopqa"
