"""Where the training processes run, and how every node of a multi-node training is started.

``TrainingPlacement`` (built by ``optima.hardware.plan``) says, per node, its host, machine rank and GPUs
(``CUDA_VISIBLE_DEVICES``), and how many processes each node runs. One node: ``accelerate launch`` gets
``--num_processes`` from it (the shipped accelerate configs' 8 never applies) and the GPUs through the environment.

Several nodes: accelerate's own multi-node flags (``--num_machines``, ``--machine_rank``, ``--main_process_ip``,
``--main_process_port``: torchrun's static rendezvous on every node) and a launcher that starts the same command
on every node, this module run as ``python -m optima.training.nodes``:

* ``ssh``: one ``ssh HOST 'cd REPO && env ... accelerate launch ... --machine_rank R ...'`` per host of
  ``train_hosts`` (or ``train_hostfile``), all at once; the first host is the main one (rank 0);
* ``srun``: one ``srun --nodes N --ntasks-per-node 1`` inside a Slurm allocation; on each node this module reads
  its rank from ``SLURM_NODEID`` and the main host from the allocation's first node (``scontrol show hostnames``).

The run waits for every node; when one fails the others are stopped (SIGTERM, then SIGKILL) and its exit code is
the run's. The nodes module runs under the training guard (``optima.training.launch``), so stopping the stage stops
the launchers too. The variables the trainer needs travel with the ssh command (``FORWARDED``); srun passes the
whole environment itself.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence

from optima.environments import REPO_ROOT
from optima.hardware.placement import MAIN_HOST, NODES_MODULE, RANK
from optima.serving.processes import sigterm_as_exit, stop_group

FORWARDED_PREFIXES = ("OPTIMA_", "HF_", "WANDB_", "ACCELERATE_", "NCCL_", "TORCH_", "OMP_", "TOKENIZERS_", "DS_")
FORWARDED = ("PYTHONPATH", "TENSORBOARD_LOGGING_DIR")
STOP_TIMEOUT_S = 30.0


def node_argv(argv: Sequence[str], rank: int, main_host: str | None = None) -> list[str]:
    """``argv`` with this node's rank (and the main host, when only Slurm knows it) in place of the placeholders."""
    out = [arg.replace(RANK, str(rank)) for arg in argv]
    return [arg.replace(MAIN_HOST, main_host) for arg in out] if main_host else out


def forwarded_env(environ: Mapping[str, str], gpus: str) -> dict[str, str]:
    """What an ssh command carries to its node: the trainer's variables and that node's GPUs."""
    env = {k: v for k, v in environ.items() if k in FORWARDED or k.startswith(FORWARDED_PREFIXES)}
    return env | ({"CUDA_VISIBLE_DEVICES": gpus} if gpus else {})


def ssh_command(exe: str, host: str, argv: Sequence[str], env: Mapping[str, str], cwd: str) -> list[str]:
    """``ssh -tt HOST 'cd CWD && env K=V ... ARGV'``.

    BatchMode: a password prompt fails instead of hanging; ``-tt``: the remote command gets a terminal, so closing
    the connection (the stage stopped, another node failed) hangs it up instead of leaving it running.
    """
    remote = f"cd {shlex.quote(cwd)} && " + shlex.join(["env", *(f"{k}={v}" for k, v in env.items()), *argv])
    return [exe, "-tt", "-o", "BatchMode=yes", host, remote]


def srun_command(exe: str, nodes: int, python: str, flags: Sequence[str], argv: Sequence[str]) -> list[str]:
    """One srun step with one task per node, each running this module's ``--slurm-task`` branch."""
    step = [exe, "--nodes", str(nodes), "--ntasks", str(nodes), "--ntasks-per-node", "1", "--kill-on-bad-exit=1"]
    return [*step, python, "-m", NODES_MODULE, *flags, "--slurm-task", "--", *argv]


def slurm_main_host(environ: Mapping[str, str]) -> str:
    """The allocation's first node (``scontrol show hostnames $SLURM_JOB_NODELIST``), where rank 0 runs."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST", "")
    result = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return result.stdout.split()[0]


def run_all(commands: Sequence[Sequence[str]]) -> int:
    """Start every command in its own process group, wait for all; the first failure stops the others' groups.

    SIGTERM (the training guard stopping the stage) unwinds through the same cleanup.
    """
    with sigterm_as_exit():
        procs = []
        try:
            for command in commands:
                procs.append(subprocess.Popen(list(command), stdin=subprocess.DEVNULL, start_new_session=True))
            return wait_all(procs)
        finally:
            stop([p for p in procs if p.poll() is None])


def wait_all(procs: Sequence[subprocess.Popen]) -> int:
    """Wait for every process; on the first failure stop the rest and return its exit code (else 0)."""
    code, pending = 0, list(procs)
    while pending:
        for proc in list(pending):
            try:
                returncode = proc.wait(timeout=0.5)  # poll interval of a wait on several processes
            except subprocess.TimeoutExpired:
                continue
            pending.remove(proc)
            if returncode != 0 and code == 0:
                code = returncode
                stop(pending)
    return code


def stop(procs: Sequence[subprocess.Popen]) -> None:
    """Stop each launcher's process group (ssh and what it started here: SIGTERM, wait, SIGKILL).

    A remote node stops with its ssh connection: ``-tt`` gives it a terminal, whose hang-up ends its processes.
    """
    for proc in procs:
        stop_group(proc, STOP_TIMEOUT_S, f"node launcher {proc.pid}")


def main(argv: list[str] | None = None) -> int:
    """``python -m optima.training.nodes --launcher ssh|srun --hosts H1,H2 [--gpus G/G] [--executable E] -- ARGV``."""
    parser = argparse.ArgumentParser(prog=f"python -m {NODES_MODULE}")
    parser.add_argument("--launcher", choices=("ssh", "srun"), required=True)
    parser.add_argument("--hosts", default="")
    parser.add_argument("--gpus", default="")
    parser.add_argument("--executable")
    parser.add_argument("--slurm-task", action="store_true", help="(inside srun) run this node's part")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    hosts = args.hosts.split(",")
    gpus = args.gpus.split("/") if args.gpus else [""] * len(hosts)
    if args.slurm_task:
        rank = int(os.environ["SLURM_NODEID"])
        main_host = None if hosts[0] else slurm_main_host(os.environ)
        env = os.environ | ({"CUDA_VISIBLE_DEVICES": gpus[rank]} if gpus[rank] else {})
        return subprocess.run(node_argv(command, rank, main_host), env=env, check=False).returncode
    if args.launcher == "srun":
        flags = ["--launcher", "srun", "--hosts", args.hosts] + (["--gpus", args.gpus] if args.gpus else [])
        return run_all([srun_command(args.executable or "srun", len(hosts), sys.executable, flags, command)])
    commands = [
        ssh_command(args.executable or "ssh", host, node_argv(command, rank), forwarded_env(os.environ, gpus[rank]),
                    str(REPO_ROOT))
        for rank, host in enumerate(hosts)
    ]  # fmt: skip
    return run_all(commands)


if __name__ == "__main__":
    raise SystemExit(main())
