"""A driver that holds a run's servers (the fake ``vllm``): ``python tests/servers_driver.py OUTPUT_DIR``.

It starts the policy and the loss server beside it as a run does, prints ``READY`` and
waits; the test then signals it (SIGTERM or SIGINT) and checks that no server outlives it.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from optima.hardware.placement import place_servers  # noqa: E402
from optima.paths import RunPaths  # noqa: E402
from optima.serving.holder import ServerHolder  # noqa: E402
from optima.serving.processes import sigterm_as_exit  # noqa: E402
from tests.test_layout import FAKE_ENV, sft_recipe  # noqa: E402


def main() -> int:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the suite may run with SIGINT ignored
    # A fixed policy cache: sized from this machine's memory, a warning could come before READY on a busy box.
    recipe = sft_recipe(Path(sys.argv[1]), cpu_kvcache_space_gb=1)
    holder = ServerHolder(
        recipe, FAKE_ENV, "/models/base", Path(sys.argv[1]) / "logs", layout=place_servers(recipe, [], [0, 1])
    )
    with sigterm_as_exit(), holder:
        holder.serve("/models/base", RunPaths.from_recipe(recipe).stage(0))
        holder.loss_urls()
        print("READY", flush=True)
        threading.Event().wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
