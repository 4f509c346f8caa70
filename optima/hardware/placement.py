"""Where each process of a run runs: a server's ``Placement`` and the training's ``TrainingPlacement``.

The hardware allocation (``optima.hardware.allocation``) makes them; serving starts each server where its placement
says (``optima.serving.vllm_server``), and the training launch starts the trainer on the nodes and GPUs of the training
placement (``optima.training.launch_config``; on several nodes ``optima.training.nodes`` starts every node).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

NODES_MODULE = "optima.training.nodes"  # run on every node of a multi-node training (``TrainingPlacement.wrap``)
RANK = "{machine_rank}"  # placeholder in the per-node command, replaced by each node's rank
MAIN_HOST = "{main_host}"  # placeholder for the main host's address, found at start on the driver or by Slurm


@dataclass(frozen=True)
class Placement:
    """Where one replica runs.

    Args:
        gpus: ``CUDA_VISIBLE_DEVICES`` entries of the replica (``None`` on CPU).
        cpu_bind: ``VLLM_CPU_OMP_THREADS_BIND`` (``None``: vLLM's automatic binding).
        service_bind: CPUs of its API server and engine core, pinned once it is ready (``optima.serving.pinning``;
            ``None``: wherever the kernel puts them).
        cpu_kvcache_gb: A fixed CPU KV cache in GiB (the loss server: what scoring needs,
            ``optima.hardware.capacity.loss_kvcache_gb``); ``None``: the policy's, sized when it starts.
        gpu_memory_utilization: This server's share of each GPU (``None``: the recipe's); a loss server beside
            the policy takes part of it.
        carry_over: The process carries over to the next checkpoint (``optima.serving.sleep_mode``): the
            development endpoints (``/collective_rpc``, ``/reset_prefix_cache``; ``/sleep``, ``/wake_up``), and on a
            GPU ``--enable-sleep-mode``.
        scoring: The loss server: on a GPU it gets the context, sequences and batched tokens scoring needs
            (``optima.config.rules.loss_server_limits``) instead of vLLM's defaults and the recipe's ``max_model_len``.
    """

    gpus: tuple[str, ...] | None = None
    cpu_bind: str | None = None
    service_bind: str | None = None
    cpu_kvcache_gb: int | None = None
    gpu_memory_utilization: float | None = None
    carry_over: bool = False
    scoring: bool = False

    @property
    def on_cpu(self) -> bool:
        return self.gpus is None


@dataclass(frozen=True)
class NodeRanks:
    """One node of the training: its host, machine rank and GPUs (``CUDA_VISIBLE_DEVICES`` entries; () on CPU)."""

    host: str
    machine_rank: int
    gpus: tuple[str, ...] = ()


@dataclass(frozen=True)
class TrainingPlacement:
    """The training processes of a run.

    Args:
        nodes: One entry per node, rank 0 first.
        processes_per_node: Processes each node runs (equal on every node: torchrun's rule).
        launcher: ``local`` (this machine only), ``ssh`` or ``srun``.
        executable: The ssh/srun program (``None``: the one on ``PATH``).
        main_port: ``--main_process_port`` of a multi-node run.
        forward: The variables ssh carries to each node (names, or prefixes ending in ``*``; empty: the launcher's
            allow-list, ``optima.training.nodes.FORWARDED_ENV``): the recipe's ``train_forward_env``.
    """

    nodes: tuple[NodeRanks, ...]
    processes_per_node: int
    launcher: str = "local"
    executable: str | None = None
    main_port: int = 29500
    forward: tuple[str, ...] = ()

    @property
    def num_processes(self) -> int:
        return self.processes_per_node * len(self.nodes)

    @property
    def multi_node(self) -> bool:
        return len(self.nodes) > 1

    def accelerate_args(self) -> list[str]:
        """``accelerate launch`` flags: the process count, and on several nodes the rendezvous (rank placeholder)."""
        args = ["--num_processes", str(self.num_processes)]
        if self.multi_node:  # the main host's address is found at start (optima.training.hosts, or Slurm's)
            args += ["--num_machines", str(len(self.nodes)), "--machine_rank", RANK]
            args += ["--main_process_ip", MAIN_HOST, "--main_process_port", str(self.main_port)]
        return args

    def local_env(self) -> dict[str, str]:
        """The GPUs of a one-node training (nothing on CPU)."""
        gpus = self.nodes[0].gpus if len(self.nodes) == 1 else ()
        return {"CUDA_VISIBLE_DEVICES": ",".join(gpus)} if gpus else {}

    def wrap(self, python: Sequence[str], argv: Sequence[str]) -> list[str]:
        """The command that starts ``argv`` (with ``RANK``) on every node: this module with the launcher's flags."""
        flags = ["--launcher", self.launcher, "--hosts", ",".join(n.host for n in self.nodes)]
        if any(n.gpus for n in self.nodes):
            flags += ["--gpus", "/".join(",".join(n.gpus) for n in self.nodes)]
        if self.executable:
            flags += ["--executable", self.executable]
        if self.forward:
            flags += ["--forward", ",".join(self.forward)]
        return [*python, "-m", NODES_MODULE, *flags, "--", *argv]
