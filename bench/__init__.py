"""The benchmarks: scripts that measure Optima side by side with a baseline and print ratios (never timed tests).

Run from the repository root as modules, ``.venvs/train/bin/python -m bench.<name>`` (``python -m bench.run_all``
runs them all and writes ``bench/RESULTS.md``). They sit on top of Optima (docs/layers.md) and may import any of its
modules, by its public names only; ``tests/test_bench.py`` checks it.
"""
