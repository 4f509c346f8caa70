"""Handbook-style DPO entry point: ``accelerate launch ... run_dpo.py --config trainer.yaml`` (optima.training)."""

import os
import signal
import sys
from pathlib import Path

if __name__ == "__main__":
    launcher = os.getppid()  # accelerate launch (or torchrun's agent)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for `import optima`
    from optima.serving.processes import set_pdeathsig

    set_pdeathsig(signal.SIGKILL)  # its launcher gone (the driver killed), nothing may keep writing the checkpoint
    if os.getppid() != launcher:
        raise SystemExit("the launcher exited before training started")
    from optima.training.dpo_train import main

    raise SystemExit(main())
