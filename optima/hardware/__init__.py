"""The hardware plan: which process runs where, and whether it fits, decided before anything starts.

``spec`` and ``gpus`` (the machine: given or detected), ``memory`` and ``vllm_memory`` (estimates of weights, KV
caches, vLLM's own memory and the trainer's peak), ``placement`` (where one server or the training runs),
``layout`` (the servers' placements and the replicas), ``accelerate`` (the accelerate configs), ``training``
(training ranks per node and the trainer's peak), ``claims`` (the per-GPU claims and ``HardwarePlan``) and
``plan`` (``plan_hardware``, and ``plan_this_machine`` for the machine this runs on). docs/gpu.md describes the
plan. Imports neither serving nor training: they run what this plans.
"""

from optima import lazy_exports

# Public names, imported on first use (``gpus`` must stay importable with the standard library alone: setup).
_EXPORTS = {
    "HardwarePlan": "claims",
    "ServerLayout": "layout",
    "plan_layout": "layout",
    "Placement": "placement",
    "TrainingPlacement": "placement",
    "plan_hardware": "plan",
    "plan_this_machine": "plan",
    "Hardware": "spec",
    "detect_hardware": "spec",
}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
