"""Evaluation: the checkpoint sweep and multi-agent self-consistency (docs/method.md#evaluation)."""
