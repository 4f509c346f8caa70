"""The trainer YAML and the ``accelerate launch`` command line of a fine-tuning stage (pure: starts nothing).

A fine-tuning stage is the handbook-style base YAML of the recipe (``origin_yaml_path``) plus this iteration's
model, dataset and output folder, written into the run directory and handed to
``alignment-handbook/scripts/run_{sft,dpo}.py`` in the training environment::

    <train python> -m accelerate.commands.launch --config_file <accelerate yaml> \
        alignment-handbook/scripts/run_sft.py --config <run>/iteration_<i>/trainer.yaml

The process count, the GPUs and, on several nodes, accelerate's multi-node flags (one ``srun`` step,
``optima.serving.node_servers.srun_step``, each task adding its node's ``--machine_rank``) come from the hardware
allocation's ``TrainingPlacement``. ``optima.training.launch`` runs the command.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optima.config import LoopRecipe
from optima.environments import REPO_ROOT, PythonEnv
from optima.hardware.machine import read_accelerate_config, resolve_accelerate_config
from optima.hardware.placement import TrainingPlacement
from optima.methods import DPO, SFT, TrainerKind
from optima.serving.node_servers import srun_step
from optima.store import write_yaml

logger = logging.getLogger(__name__)

HANDBOOK = REPO_ROOT / "alignment-handbook"
SCRIPTS = {SFT: HANDBOOK / "scripts" / "run_sft.py", DPO: HANDBOOK / "scripts" / "run_dpo.py"}
# glibc serves each large tensor (activations, logits, gradients) with its own mmap and gives its pages back at
# free, so every training step faults the same gigabytes in again: 15-20% of a CPU trainer's time went into the
# kernel. Served from the heap and never trimmed, the pages stay mapped from one step to the next (the same
# losses, 11% less train_runtime, up to 8% more peak memory; docs/cpu.md#the-trainers-allocator). Read by glibc at
# process start, so they are in the environment the trainer starts with.
CPU_ALLOCATOR_ENV = {
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(64 * 1024**3),
    "MALLOC_TOP_PAD_": str(1024**3),
}


# One srun step runs the same command on every node; each task puts its node's rank before accelerate's other flags
# (SLURM_PROCID: one task per node). The script is constant: the command comes as arguments, its length first.
WITH_NODE_RANK = ["bash", "-c", 'n=$1; shift; exec "${@:1:$n}" --machine_rank "$SLURM_PROCID" "${@:$((n + 1))}"', "-"]


def cpu_allocator_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """``CPU_ALLOCATOR_ENV`` without the variables the user's environment sets already (theirs win)."""
    return {name: value for name, value in CPU_ALLOCATOR_ENV.items() if name not in environ}


def read_trainer_base(base_yaml: Path) -> dict[str, Any]:
    """The handbook base YAML of a trainer as a mapping."""
    import yaml

    config = yaml.safe_load(Path(base_yaml).read_text()) or {}
    if not isinstance(config, dict):
        raise ValueError(f"{base_yaml}: a trainer recipe must be a mapping, got {type(config).__name__}")
    return config


def render_trainer_config(
    base_yaml: Path, overrides: dict[str, Any], user: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The base handbook YAML, the recipe's ``trainer_overrides``, then this iteration's values on top.

    Args:
        base_yaml: The handbook base YAML.
        overrides: The orchestrator's values (model, dataset, output, seed, trackers; ``None`` deletes a key).
        user: The recipe's ``trainer_overrides`` of this trainer (``--trainer_set``); a base key they change is
            logged as a warning.
    """
    config = read_trainer_base(base_yaml)
    for key, value in (user or {}).items():
        if key in config and config[key] != value:
            logger.warning(
                "%s: trainer_overrides %s=%r replaces the base value %r", base_yaml, key, value, config[key]
            )
        config[key] = value
    for key, value in overrides.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    return config


def describe_trainer_overrides(base_yaml: Path, user: dict[str, Any]) -> str:
    """``key=value (base: old)`` for each override, ``(new)`` for keys the base YAML lacks (``--dry-run``)."""
    try:
        base = read_trainer_base(base_yaml)
    except (OSError, ValueError):
        base = {}  # a missing base YAML is reported by the plan's inputs
    parts = [f"{k}={v!r} ({f'base: {base[k]!r}' if k in base else 'new'})" for k, v in user.items()]
    return ", ".join(parts) or "none"


def method_values(recipe: LoopRecipe, kind: TrainerKind) -> dict[str, Any]:
    """The trainer YAML values a method adds to its base YAML: DPO's ``rpo_alpha`` (None deletes the key)."""
    return {"rpo_alpha": recipe.rpo_alpha} if kind == DPO else {}


def write_trainer_config(config: dict[str, Any], path: Path) -> Path:
    """Write the rendered trainer YAML atomically (a killed write never leaves a half file)."""
    return write_yaml(path, config)


@dataclass(frozen=True)
class TrainLaunch:
    """One fine-tuning subprocess.

    Args:
        kind: ``sft`` or ``dpo`` (picks the handbook script).
        env: The training environment.
        accelerate_config: Resolved accelerate YAML.
        trainer_yaml: Rendered trainer recipe.
        num_processes: Overrides the accelerate config's process count (without a placement).
        extra_launch_args: More ``accelerate launch`` flags.
        placement: The hardware allocation's training processes: process count, GPUs, nodes (wins over num_processes).
    """

    kind: TrainerKind
    env: PythonEnv
    accelerate_config: Path
    trainer_yaml: Path
    num_processes: int | None = None
    extra_launch_args: tuple[str, ...] = field(default_factory=tuple)
    placement: TrainingPlacement | None = None

    def argv(self) -> list[str]:
        """The exact command line (starts nothing; shown by ``--dry-run``); on several nodes inside one srun step."""
        launcher = self.env.module_argv("accelerate.commands.launch")
        if self.placement is None or not self.placement.multi_node:
            return [*launcher, *self.launch_args(), *self.script_argv()]
        nodes, gpus = self.placement.nodes, self.placement.nodes[0].gpus
        step = srun_step(len(nodes), gpus, node_gpus=self.placement.gpus_per_node)
        return [*step, *WITH_NODE_RANK, str(len(launcher)), *launcher, *self.launch_args(), *self.script_argv()]

    def script_argv(self) -> list[str]:
        """The handbook script and its arguments: what ``accelerate launch`` runs."""
        return [str(SCRIPTS[self.kind]), "--config", str(self.trainer_yaml)]

    def launch_args(self) -> list[str]:
        """The ``accelerate launch`` flags before the script."""
        launch = ["--config_file", str(self.accelerate_config)]
        if self.placement is not None:
            launch += ["--num_processes", str(self.placement.num_processes)]
            if self.placement.multi_node:  # torchrun's rendezvous on this node, the allocation's first
                main = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
                launch += ["--num_machines", str(len(self.placement.nodes))]
                launch += ["--main_process_ip", main, "--main_process_port", str(self.placement.main_port)]
        elif self.num_processes is not None:
            launch += ["--num_processes", str(self.num_processes)]
        if self.is_multi_cpu():
            # accelerate starts a CPU config's processes with its simple launcher, i.e. ONE process whatever
            # num_processes says; its torchrun-based launcher (--multi_gpu) starts them all, and with
            # ACCELERATE_USE_CPU (env_vars) each one joins a gloo process group on the CPU.
            launch.append("--multi_gpu")
        return launch + list(self.extra_launch_args)

    def processes(self) -> int:
        """Processes of the run: the placement's, else ``num_processes``, else the accelerate config's."""
        if self.placement is not None:
            return self.placement.num_processes
        if self.num_processes is not None:
            return self.num_processes
        return int(read_accelerate_config(self.accelerate_config).get("num_processes", 1))

    def is_multi_cpu(self) -> bool:
        """A CPU-only accelerate config (``use_cpu``, no DeepSpeed/FSDP) asked to run more than one process."""
        config = read_accelerate_config(self.accelerate_config)
        cpu_only = config.get("use_cpu") and config.get("distributed_type") in ("NO", "MULTI_CPU", None)
        return bool(cpu_only) and self.processes() > 1

    def env_vars(self) -> dict[str, str]:
        """Environment the launch needs on top of the training env's: CPU processes for a multi-CPU run, the GPUs,
        the allocator settings of a CPU trainer (``CPU_ALLOCATOR_ENV``)."""
        env = {"ACCELERATE_USE_CPU": "true"} if self.is_multi_cpu() else {}
        if read_accelerate_config(self.accelerate_config).get("use_cpu"):
            env |= cpu_allocator_env()
        return env | (self.placement.local_env() if self.placement is not None else {})


def launch_for(
    recipe: LoopRecipe,
    kind: TrainerKind,
    env: PythonEnv,
    trainer_yaml: Path,
    gpu: bool,
    placement: TrainingPlacement | None = None,
) -> TrainLaunch:
    """The training subprocess of a recipe's stage (accelerate config, the allocated processes, extra launch flags)."""
    return TrainLaunch(
        kind,
        env,
        resolve_accelerate_config(recipe.accelerate_config, gpu),
        trainer_yaml,
        recipe.num_processes,
        (),
        placement,
    )
