"""The benchmarks: scripts that measure Optima side by side with a baseline and print ratios (never timed tests).

Run from the repository root as modules, ``.venvs/train/bin/python -m bench.<name>`` (``python -m bench.run_all``
runs them all and writes ``bench/RESULTS.md``). They sit on top of Optima and use only its public entry points: the
names its packages export (``optima.serving``, ``optima.agents``, ``optima.training``, ``optima.config``,
``optima.tasks``, ``optima.cli``) and its top-level modules (``optima.paths``, ``optima.lm_loss``, ...);
``tests/test_bench.py`` checks it.
"""
