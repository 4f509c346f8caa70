"""Where the training processes run, and how every node of a multi-node training is started.

``TrainingPlacement`` (built by ``optima.hardware``) says, per node, its host, machine rank and GPUs
(``CUDA_VISIBLE_DEVICES``), and how many processes each node runs. One node: ``accelerate launch`` gets
``--num_processes`` from it (the shipped accelerate configs' 8 never applies) and the GPUs through the environment.

Several nodes: accelerate's own multi-node flags (``--num_machines``, ``--machine_rank``, ``--main_process_ip``,
``--main_process_port``: torchrun's static rendezvous on every node) and a launcher that starts the same command
on every node, this module run as ``python -m optima.training.nodes``:

* ``ssh``: one ``ssh HOST 'cd REPO && env ... accelerate launch ... --machine_rank R ...'`` per host of
  ``train_hosts`` (or ``train_hostfile``), all at once; the first host is the main one (rank 0);
* ``srun``: one ``srun --nodes N --ntasks-per-node 1`` inside a Slurm allocation; on each node this module reads
  its rank from ``SLURM_NODEID`` and the main host from the allocation's first node (``scontrol show hostnames``).

Before any ssh starts, the hosts are checked (``optima.training.hosts``: resolved through ``ssh -G``, the first one
this machine, reachable at a non-loopback address, which every node gets as ``--main_process_ip``). The run waits
for every node; when one fails the others are stopped (SIGTERM, then SIGKILL) and its exit code is the run's. The
nodes module leads the training's process group (``optima.training.launch``), so stopping the stage stops the launchers
too. The variables on an allow-list travel with the ssh command (``FORWARDED_ENV``, or the recipe's
``train_forward_env``); srun passes the whole environment itself.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence

from optima.config import RecipeError
from optima.environments import REPO_ROOT
from optima.hardware.placement import MAIN_HOST, NODES_MODULE, RANK, TrainingPlacement
from optima.serving.processes import sigterm_as_exit, stop_group
from optima.training.hosts import Resolver, bare_host, is_address, verify_hosts

# What an ssh command carries to its node (a name, or a prefix ending in ``*``): the trainer's own settings, the
# interconnect's (NCCL, libfabric/EFA ``FI_*``, UCX, gloo; without them NCCL over EFA or InfiniBand may fall back to
# TCP silently) and the CUDA toolchain's paths. ``train_forward_env`` in the recipe replaces the list.
FORWARDED_ENV = (
    "OPTIMA_*", "HF_*", "WANDB_*", "ACCELERATE_*", "TORCH_*", "PYTORCH_*", "OMP_*", "TOKENIZERS_*", "DS_*",
    "NCCL_*", "FI_*", "UCX_*", "GLOO_*", "CUDA_HOME", "PATH", "LD_LIBRARY_PATH", "PYTORCH_CUDA_ALLOC_CONF",
    "PYTHONPATH", "TENSORBOARD_LOGGING_DIR",
)  # fmt: skip
STOP_TIMEOUT_S = 30.0

logger = logging.getLogger(__name__)


def node_argv(argv: Sequence[str], rank: int, main_host: str | None = None) -> list[str]:
    """``argv`` with this node's rank (and the main host, when only Slurm knows it) in place of the placeholders."""
    out = [arg.replace(RANK, str(rank)) for arg in argv]
    return [arg.replace(MAIN_HOST, main_host) for arg in out] if main_host else out


def forwarded(name: str, patterns: Sequence[str]) -> bool:
    """Whether ``name`` is on the allow-list: equal to a pattern, or starting with one that ends in ``*``."""
    return any(name == p or (p.endswith("*") and name.startswith(p[:-1])) for p in patterns)


def forwarded_env(environ: Mapping[str, str], gpus: str, patterns: Sequence[str] = FORWARDED_ENV) -> dict[str, str]:
    """What an ssh command carries to its node: the allow-listed variables and that node's GPUs."""
    env = {k: v for k, v in environ.items() if forwarded(k, patterns)}
    return env | ({"CUDA_VISIBLE_DEVICES": gpus} if gpus else {})


def ssh_command(exe: str, host: str, argv: Sequence[str], env: Mapping[str, str], cwd: str) -> list[str]:
    """``ssh -tt HOST 'cd CWD && env K=V ... ARGV'``.

    BatchMode: a password prompt fails instead of hanging; ``-tt``: the remote command gets a terminal, so closing
    the connection (the stage stopped, another node failed) hangs it up instead of leaving it running.
    """
    remote = f"cd {shlex.quote(cwd)} && " + shlex.join(["env", *(f"{k}={v}" for k, v in env.items()), *argv])
    return [exe, "-tt", "-o", "BatchMode=yes", host, remote]


def ssh_destination(host: str, exe: str = "ssh") -> str:
    """The host name ssh connects to for ``host`` (``ssh -G``: ``user@``, aliases, ``HostName``); an address as
    it is. Without a working ``ssh -G``, the host after any ``user@``."""
    bare = bare_host(host)
    if is_address(bare):
        return bare
    try:
        result = subprocess.run([exe, "-G", host], capture_output=True, text=True, check=False, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return bare
    names = [
        line.split(None, 1)[1].strip() for line in result.stdout.splitlines() if line.lower().startswith("hostname ")
    ]
    return names[0] if result.returncode == 0 and names and names[0] else bare


def ssh_resolver(exe: str | None) -> Resolver:
    """How the hosts of an ssh launcher resolve: as ``exe -G`` says (``train_launcher_executable``, else ssh)."""
    return Resolver(destination=functools.partial(ssh_destination, exe=exe or "ssh"))


def srun_command(exe: str, nodes: int, python: str, flags: Sequence[str], argv: Sequence[str]) -> list[str]:
    """One srun step with one task per node, each running this module's ``--slurm-task`` branch."""
    step = [exe, "--nodes", str(nodes), "--ntasks", str(nodes), "--ntasks-per-node", "1", "--kill-on-bad-exit=1"]
    return [*step, python, "-m", NODES_MODULE, *flags, "--slurm-task", "--", *argv]


def slurm_main_host(environ: Mapping[str, str]) -> str:
    """The allocation's first node, where rank 0 runs."""
    return slurm_hosts(environ)[0]


def slurm_hosts(environ: Mapping[str, str]) -> list[str]:
    """The allocation's nodes in rank order (``scontrol show hostnames $SLURM_JOB_NODELIST``)."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST", "")
    result = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return result.stdout.split()


class NodeCommands:
    """Commands on the other nodes of a training, started as its trainer is (``optima.serving.node_servers``).

    ssh: ``ssh -tt -L PORT:127.0.0.1:PORT HOST 'cd REPO && env ... ARGV'`` with the variables the trainer's command
    carries (``FORWARDED``) and the command's own: the server binds to the node's loopback and is reached through
    the tunnel at the same port here (its reload routes stay off the network); srun: one step on node RANK of the
    allocation (``--relative``, ``--overlap`` beside the driver's step), which passes the whole environment itself,
    and the server binds to the node's name.

    Args:
        placement: The training placement (hosts, launcher, its executable).
    """

    def __init__(self, placement: TrainingPlacement):
        self.placement = placement
        self._slurm: list[str] | None = None

    def host(self, rank: int) -> str:
        """The address node ``rank``'s servers bind to, and are reached at from here."""
        if self.placement.launcher != "srun":
            return "127.0.0.1"  # through the ssh tunnel
        if self._slurm is None:
            self._slurm = slurm_hosts(os.environ)
        return self._slurm[rank]

    def command(self, rank: int, argv: Sequence[str], env: Mapping[str, str], port: int) -> list[str]:
        """The local command that runs ``argv`` with ``env`` on node ``rank``, serving ``port``."""
        exe, assigned = self.placement.executable, [f"{k}={v}" for k, v in env.items()]
        if self.placement.launcher == "srun":
            step = [exe or "srun", "--nodes", "1", "--ntasks", "1", "--relative", str(rank), "--overlap"]
            return [*step, "--kill-on-bad-exit=1", "env", *assigned, *argv]
        forwarded = forwarded_env(os.environ, "", self.placement.forward or FORWARDED_ENV) | dict(env)
        command = ssh_command(exe or "ssh", self.placement.nodes[rank].host, argv, forwarded, str(REPO_ROOT))
        tunnel = ["-o", "ExitOnForwardFailure=yes", "-L", f"{port}:127.0.0.1:{port}"]
        return [command[0], *tunnel, *command[1:]]


def run_all(commands: Sequence[Sequence[str]]) -> int:
    """Start every command in its own process group, wait for all; the first failure stops the others' groups.

    SIGTERM (the driver stopping the stage) unwinds through the same cleanup.
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
    parser.add_argument("--forward", default="", help="variables ssh carries, comma-separated (default FORWARDED_ENV)")
    parser.add_argument("--slurm-task", action="store_true", help="(inside srun) run this node's part")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    hosts = args.hosts.split(",")
    gpus = args.gpus.split("/") if args.gpus else [""] * len(hosts)
    if args.slurm_task:
        rank = int(os.environ["SLURM_NODEID"])
        main_host = hosts[0] or slurm_main_host(os.environ)
        env = os.environ | ({"CUDA_VISIBLE_DEVICES": gpus[rank]} if gpus[rank] else {})
        return subprocess.run(node_argv(command, rank, main_host), env=env, check=False).returncode
    if args.launcher == "srun":
        flags = ["--launcher", "srun", "--hosts", args.hosts] + (["--gpus", args.gpus] if args.gpus else [])
        return run_all([srun_command(args.executable or "srun", len(hosts), sys.executable, flags, command)])
    exe = args.executable or "ssh"
    try:
        main_host = verify_hosts(hosts, ssh_resolver(exe))
    except RecipeError as error:
        logger.error("%s", error)
        return 2
    patterns = args.forward.split(",") if args.forward else FORWARDED_ENV
    commands = [
        ssh_command(exe, host, node_argv(command, rank, main_host), forwarded_env(os.environ, gpus[rank], patterns),
                    str(REPO_ROOT))
        for rank, host in enumerate(hosts)
    ]  # fmt: skip
    return run_all(commands)


if __name__ == "__main__":
    raise SystemExit(main())
