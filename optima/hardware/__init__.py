"""The hardware plan: which process runs where, and whether it fits, decided before anything starts.

``spec`` (the machine: given or detected), ``memory`` (estimates of weights, KV caches and the trainer's peak),
``plan`` (servers and per-GPU claims; ``plan_hardware`` is the entry point) and ``training`` (training ranks per
node). docs/gpu.md describes the plan.
"""
