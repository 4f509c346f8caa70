"""The hardware allocation: which process runs where, and whether it fits, decided before anything starts.

``spec`` and ``gpus`` (the machine: given or detected), ``memory`` and ``vllm_memory`` (estimates of weights, KV
caches, vLLM's own memory and the trainer's peak), ``placement`` (where one server or the training runs),
``layout`` (the servers' placements and the replicas), ``accelerate`` (the accelerate configs), ``training``
(training ranks per node and the trainer's peak), ``claims`` (the per-GPU claims and ``HardwareAllocation``) and
``allocation`` (``allocate_hardware``, and ``allocate_this_machine`` for the machine this runs on). docs/gpu.md
describes the allocation. Imports neither serving nor training: they run what this allocates.
"""

from optima import lazy_exports

# Public names, imported on first use (``gpus`` must stay importable with the standard library alone: setup).
_EXPORTS = {
    "HardwareAllocation": "claims",
    "ServerLayout": "layout",
    "place_servers": "layout",
    "Placement": "placement",
    "TrainingPlacement": "placement",
    "allocate_hardware": "allocation",
    "allocate_this_machine": "allocation",
    "Hardware": "spec",
    "detect_hardware": "spec",
}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
