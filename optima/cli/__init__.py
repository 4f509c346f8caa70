"""The command line of the five scripts: ``loop`` (the three training scripts), ``evaluate`` (the two evaluation
scripts and ``python -m optima compare``), ``common`` (the flags and the error guard they share)."""

from optima.cli.loop import build_loop_parser, run_loop_script, trainer_set_overrides

__all__ = ["build_loop_parser", "run_loop_script", "trainer_set_overrides"]
