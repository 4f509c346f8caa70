"""Two training "nodes" on the loopback, started by the project's own launch path through a stand-in for srun.

The recipe says ``train_launcher: srun`` on two nodes; the hardware allocation makes them machine ranks 0 and 1 with
one CPU process each (gloo), ``launch_for`` builds the one srun step (one task per node, the same ``accelerate
launch`` on each, with its task's ``--machine_rank``) and ``run_training`` runs it as a train stage does. The
stand-in (``tests/helpers.write_fake_slurm``) runs the step's command once per node here. The checkpoint equals the
one of a 2-process run on one node with the same seed and data.
"""

from __future__ import annotations

import json
import socket
import sys

import pytest

from optima.config import SFTRecipe, load_recipe
from optima.environments import resolve_env
from optima.hardware.allocation import allocate_hardware
from optima.hardware.machine import Hardware
from optima.store import save_splits
from optima.training.common import is_complete
from optima.training.launch import run_training
from optima.training.launch_config import launch_for
from tests.helpers import slurm_env, tiny_trainer_yaml, write_fake_slurm
from tests.test_sharded_training import SFT_ROWS, cpu_accelerate_config, launch_env, load_weights, train

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_loopback_nodes_train_the_checkpoint_of_one_node_with_two_processes(tmp_path, tiny_model, monkeypatch):
    import torch

    save_splits({"train": SFT_ROWS}, tmp_path / "data")
    accelerate = cpu_accelerate_config(tmp_path, "ddp")  # the CPU config, 2 processes
    reference = tmp_path / "one_node"
    train(
        "sft", accelerate, tiny_trainer_yaml(tmp_path / "one.yaml", tiny_model, tmp_path / "data", reference), tmp_path
    )

    folder, calls = write_fake_slurm(tmp_path / "slurm", nodes=2)
    for name, value in slurm_env(folder).items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "two_nodes"
    trainer_yaml = tiny_trainer_yaml(tmp_path / "two.yaml", tiny_model, tmp_path / "data", out)
    values = {
        "dataset_type": "arc",
        "initial_model_path": str(tiny_model),
        "origin_yaml_path": str(trainer_yaml),
        "output_dir": str(tmp_path / "run"),
        "accelerate_config": str(accelerate),
        "num_processes": 2,
        "train_launcher": "srun",
        "api_key": "k",  # the other nodes' policy servers would bind to their names
        "sleep_mode": False,
        "main_process_port": free_port(),
    }
    recipe = load_recipe(SFTRecipe, None, values, check_paths=False)
    allocation = allocate_hardware(recipe, Hardware(2, 0, 0.0), [0])
    allocation.check()
    assert [(n.host, n.machine_rank) for n in allocation.training.nodes] == [("", 0), ("", 1)]
    launch = launch_for(recipe, "sft", resolve_env(sys.executable, "train"), trainer_yaml, False, allocation.training)
    run_training(launch, tmp_path / "two_nodes.log", extra_env=launch_env(tmp_path / "audit"))

    (step,) = [json.loads(line) for line in calls.read_text().splitlines()]  # one srun step for both nodes
    assert step[:6] == ["--nodes", "2", "--ntasks", "2", "--ntasks-per-node", "1"]
    command = " ".join(step)
    assert "--overlap" in command and "--num_processes 2 --num_machines 2" in command
    assert f"--main_process_ip 127.0.0.1 --main_process_port {values['main_process_port']}" in command
    log = (tmp_path / "two_nodes.log").read_text()
    for rank in (1, 2):
        assert f"train | process {rank} of 2 | replicated (multi_cpu)" in log
    assert is_complete(out)
    saved, expected = load_weights(out), load_weights(reference)
    assert set(saved) == set(expected)
    for name in expected:
        torch.testing.assert_close(saved[name], expected[name], atol=1e-6, rtol=1e-5, msg=name)
