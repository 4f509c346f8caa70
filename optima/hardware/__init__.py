"""The hardware: where every process of a run runs, and what the engines are given; decided before anything starts.

``machine`` (the GPUs and nodes, given or detected; standard library only: setup reads it with a bare Python),
``placement`` (where a server or the training runs, and how a recipe's servers are placed), ``memory`` (the memory
shares and CPU KV caches the engines are given, and the libraries' estimates the dry run shows) and ``allocation``
(``allocate_hardware``: the whole run placed, with what needs no memory model refused). Each vLLM server checks its
memory at start-up and the preflight the trainer's; docs/gpu.md and docs/cpu.md.
"""

from optima import lazy_exports

# The public names, imported on first use (``machine`` must stay importable with the standard library alone).
_EXPORTS = {
    "HardwareAllocation": "allocation",
    "allocate_hardware": "allocation",
    "allocate_this_machine": "allocation",
    "Hardware": "machine",
    "detect_hardware": "machine",
    "parse_hardware": "machine",
    "Placement": "placement",
    "ServerLayout": "placement",
    "TrainingPlacement": "placement",
    "place_servers": "placement",
}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
