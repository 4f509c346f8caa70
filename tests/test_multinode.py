"""Two training "nodes" on the loopback, each started by the project's own launch path through a stand-in for ssh.

The recipe names two hosts (``train_hosts: [127.0.0.1, 127.0.0.1]``); the hardware allocation makes them machine ranks
0 and 1 with one CPU process each (gloo), ``launch_for`` builds the nodes launcher (``optima.training.nodes``) and
``run_training`` runs it as a train stage does. ``train_launcher_executable`` points at a shim that takes ssh's
command line (``ssh -tt -o BatchMode=yes HOST COMMAND``) and runs COMMAND here in a fresh environment (only what the
command carries: as on another machine), recording each call. The checkpoint equals
the one of a 2-process run on one node with the same seed and data.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from optima.config import SFTRecipe, load_recipe
from optima.environments import resolve_env
from optima.hardware.allocation import allocate_hardware
from optima.hardware.machine import Hardware
from optima.store import save_splits
from optima.training.common import is_complete
from optima.training.launch import run_training
from optima.training.launch_config import launch_for
from tests.helpers import tiny_trainer_yaml
from tests.test_sharded_training import SFT_ROWS, cpu_accelerate_config, launch_env, load_weights, train

pytestmark = pytest.mark.slow

SHIM = '''#!{python}
"""Stands in for ssh: ssh [-o OPTION]... HOST COMMAND runs COMMAND on this machine."""
import subprocess, sys
args = sys.argv[1:]
while args and args[0].startswith("-"):
    args = args[2:] if args[0] in ("-o", "-p", "-i", "-l") else args[1:]  # -tt takes no value
host, command = args[0], " ".join(args[1:])
with open({calls!r}, "a") as calls:
    calls.write(host + "\\t" + command + "\\n")
# A fresh login, as on another machine: the caller's environment does not come along, only what the command sets.
raise SystemExit(subprocess.call(["/bin/sh", "-c", command], env={{"PATH": "/usr/bin:/bin", "HOME": {home!r}}}))
'''


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_shim(folder: Path) -> tuple[Path, Path]:
    calls = folder / "ssh_calls.tsv"
    shim = folder / "fake_ssh"
    shim.write_text(SHIM.format(python=sys.executable, calls=str(calls), home=str(folder)))
    shim.chmod(0o755)
    return shim, calls


def test_two_loopback_nodes_train_the_checkpoint_of_one_node_with_two_processes(tmp_path, tiny_model):
    import torch

    save_splits({"train": SFT_ROWS}, tmp_path / "data")
    accelerate = cpu_accelerate_config(tmp_path, "ddp")  # the CPU config, 2 processes
    reference = tmp_path / "one_node"
    train(
        "sft", accelerate, tiny_trainer_yaml(tmp_path / "one.yaml", tiny_model, tmp_path / "data", reference), tmp_path
    )

    shim, calls = write_shim(tmp_path)
    out = tmp_path / "two_nodes"
    trainer_yaml = tiny_trainer_yaml(tmp_path / "two.yaml", tiny_model, tmp_path / "data", out)
    values = {
        "dataset_type": "arc",
        "initial_model_path": str(tiny_model),
        "origin_yaml_path": str(trainer_yaml),
        "output_dir": str(tmp_path / "run"),
        "accelerate_config": str(accelerate),
        "num_processes": 2,
        "train_hosts": ["127.0.0.1", "127.0.0.1"],
        "train_launcher_executable": str(shim),
        "main_process_port": free_port(),
    }
    recipe = load_recipe(SFTRecipe, None, values, check_paths=False)
    allocation = allocate_hardware(recipe, Hardware(1, 0, 0.0), [0])
    allocation.check()
    assert [(n.host, n.machine_rank) for n in allocation.training.nodes] == [("127.0.0.1", 0), ("127.0.0.1", 1)]
    launch = launch_for(recipe, "sft", resolve_env(sys.executable, "train"), trainer_yaml, False, allocation.training)
    assert launch.argv()[1:6] == ["-m", "optima.training.nodes", "--launcher", "ssh", "--hosts"]
    run_training(launch, tmp_path / "two_nodes.log", extra_env=launch_env(tmp_path / "audit"))

    started = [line.split("\t") for line in calls.read_text().splitlines()]
    assert [host for host, _ in started] == ["127.0.0.1", "127.0.0.1"]
    for rank in (0, 1):  # each node got its own rank, the same rendezvous and one process of two
        assert sum(f"--machine_rank {rank} " in command for _, command in started) == 1
    assert all("--num_processes 2 --num_machines 2" in command for _, command in started)
    log = (tmp_path / "two_nodes.log").read_text()
    for rank in (1, 2):
        assert f"train | process {rank} of 2 | replicated (multi_cpu)" in log
    assert is_complete(out)
    saved, expected = load_weights(out), load_weights(reference)
    assert set(saved) == set(expected)
    for name in expected:
        torch.testing.assert_close(saved[name], expected[name], atol=1e-6, rtol=1e-5, msg=name)
