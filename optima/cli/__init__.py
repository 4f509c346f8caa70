"""The command line of Optima, one module per kind of command (``python -m optima ...`` and the five scripts).

* ``common``: the flags and guard every command shares (environments, ``--set``, ``--dry-run``, exit codes);
* ``loop``: the three training scripts; ``evaluate``: the two evaluation scripts;
* ``compare``: ``python -m optima compare``; ``folders``: ``report`` and ``show``;
* ``demo``: ``demo`` and ``times`` (the run's time per iteration: ``iteration_times``, the busy share: ``cpu_busy``);
* ``gpu_check``: ``gpu-check`` (imports only the standard library at the top: it runs before set-up);
  ``gpu_stages``: its checks that drive the run's servers and saves (``python -m optima.cli.gpu_stages``, run in the
  training environment; not imported here).
"""

from optima.cli.compare import run_compare_script
from optima.cli.cpu_busy import CpuSampler, busy_share, read_cpu_jiffies, read_samples
from optima.cli.demo import print_times, run_demo_command, run_sampled, run_times_command
from optima.cli.evaluate import run_eval_script
from optima.cli.folders import run_report_command, run_show_command
from optima.cli.gpu_check import run_gpu_check_command
from optima.cli.iteration_times import measure_run, ratio_target, render_times
from optima.cli.loop import build_loop_parser, run_loop_script, trainer_set_overrides

__all__ = [
    "CpuSampler",
    "busy_share",
    "build_loop_parser",
    "measure_run",
    "print_times",
    "ratio_target",
    "read_cpu_jiffies",
    "read_samples",
    "render_times",
    "run_demo_command",
    "run_gpu_check_command",
    "run_sampled",
    "run_times_command",
    "run_compare_script",
    "run_eval_script",
    "run_loop_script",
    "run_report_command",
    "run_show_command",
    "trainer_set_overrides",
]
