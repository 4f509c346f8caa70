"""Handbook-style DPO entry point: ``accelerate launch ... run_dpo.py --config trainer.yaml`` (optima.training)."""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for `import optima`
    from optima.training.dpo_train import main

    raise SystemExit(main())
