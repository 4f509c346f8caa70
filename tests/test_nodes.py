"""The multi-node launcher (``python -m optima.training.nodes``): per-node commands, ssh and srun, one failing node.

Fast: the nodes run a one-line Python command through an ssh stand-in; the real two-node training is in
``tests/test_multinode.py`` (slow).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from optima.hardware.placement import MAIN_HOST, RANK, NodeRanks, TrainingPlacement
from optima.training.nodes import forwarded_env, node_argv, srun_command, ssh_command

REPO = Path(__file__).resolve().parent.parent
FAKE_SSH = """#!{python}
import subprocess, sys
args = sys.argv[1:]
while args[0].startswith("-"):
    args = args[1:] if args[0] == "-tt" else args[2:]
# A fresh login: nothing of the caller's environment but what the command itself sets.
raise SystemExit(subprocess.call(["/bin/sh", "-c", " ".join(args[1:])], env={{"PATH": "/usr/bin:/bin"}}))
"""


def fake_ssh(folder: Path) -> Path:
    path = folder / "ssh"
    path.write_text(FAKE_SSH.format(python=sys.executable))
    path.chmod(0o755)
    return path


def run_nodes(tmp_path: Path, hosts: str, command: list[str]) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "optima.training.nodes", "--launcher", "ssh", "--hosts", hosts]
    argv += ["--gpus", "0,1/2,3", "--executable", str(fake_ssh(tmp_path)), "--", *command]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "OPTIMA_MARK": "x", "SECRET_TOKEN": "no"}
    return subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=env, timeout=120, check=False)


def test_each_node_runs_the_command_with_its_rank_gpus_and_forwarded_variables(tmp_path):
    report = "import os, sys; print('node', sys.argv[1], os.environ.get('CUDA_VISIBLE_DEVICES'), " + (
        "os.environ.get('OPTIMA_MARK'), os.environ.get('SECRET_TOKEN'), os.getcwd())"
    )
    result = run_nodes(tmp_path, "127.0.0.1,localhost", [sys.executable, "-c", report, RANK])
    assert result.returncode == 0, result.stderr
    lines = sorted(result.stdout.splitlines())
    # The trainer's variables travel with the command, the rest of the driver's environment does not.
    assert lines == [f"node 0 0,1 x None {REPO}", f"node 1 2,3 x None {REPO}"]


def test_a_failing_node_stops_the_others_and_its_exit_code_is_the_runs(tmp_path):
    code = "import sys, time; sys.exit(3) if sys.argv[1] == '1' else time.sleep(120)"
    started = time.monotonic()
    result = run_nodes(tmp_path, "127.0.0.1,127.0.0.1", [sys.executable, "-c", code, RANK])
    assert result.returncode == 3
    assert time.monotonic() - started < 60  # node 0 was stopped, not waited for


def test_command_lines():
    argv = ["accelerate", "--machine_rank", RANK, "--main_process_ip", MAIN_HOST]
    assert node_argv(argv, 1) == ["accelerate", "--machine_rank", "1", "--main_process_ip", MAIN_HOST]
    assert node_argv(argv, 0, "n0")[-1] == "n0"
    ssh = ssh_command("ssh", "n1", ["python", "a b"], {"K": "v w"}, "/repo dir")
    assert ssh == ["ssh", "-tt", "-o", "BatchMode=yes", "n1", "cd '/repo dir' && env 'K=v w' python 'a b'"]
    srun = srun_command("srun", 2, "/py", ["--launcher", "srun"], ["accelerate"])
    assert srun[:7] == ["srun", "--nodes", "2", "--ntasks", "2", "--ntasks-per-node", "1"]
    assert srun[-3:] == ["--slurm-task", "--", "accelerate"]
    assert forwarded_env({"HF_HOME": "/h", "HOME": "/root", "PYTHONPATH": "/r"}, "1") == {
        "HF_HOME": "/h",
        "PYTHONPATH": "/r",
        "CUDA_VISIBLE_DEVICES": "1",
    }


def test_placement_flags():
    one = TrainingPlacement((NodeRanks("localhost", 0, ("1", "2")),), 2)
    assert one.accelerate_args() == ["--num_processes", "2"] and one.local_env() == {"CUDA_VISIBLE_DEVICES": "1,2"}
    two = TrainingPlacement((NodeRanks("a", 0, ("0",)), NodeRanks("b", 1, ("0",))), 1, "ssh", main_port=1234)
    assert two.accelerate_args() == [
        "--num_processes", "2", "--num_machines", "2", "--machine_rank", RANK,
        "--main_process_ip", MAIN_HOST, "--main_process_port", "1234",
    ]  # fmt: skip
    assert two.local_env() == {}
    slurm = TrainingPlacement((NodeRanks("", 0), NodeRanks("", 1)), 8, "srun")
    assert MAIN_HOST in slurm.accelerate_args()
