"""Evaluation (docs/method.md#evaluation): the checkpoint sweep, self-consistency, the baselines and ``compare``,
the held-out table of a training run, and their tables and plots."""
