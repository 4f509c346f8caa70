"""Fine-tuning: handbook-style TRL scripts (run in the training env) and their launcher (run by the driver)."""

from optima import lazy_exports

# Public names, imported on first use (the trainer scripts import this package inside the training env).
_EXPORTS = {
    "SCRIPTS": "launch_config",
    "TrainLaunch": "launch_config",
    "render_trainer_config": "launch_config",
    "resolve_accelerate_config": "optima.hardware.machine",
    "write_trainer_config": "launch_config",
    "SENTINEL": "optima.lm_loss",
}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
