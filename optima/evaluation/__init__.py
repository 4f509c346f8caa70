"""Evaluation: the checkpoint sweep and multi-agent self-consistency (SPEC 7)."""
