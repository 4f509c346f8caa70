"""The command line of Optima, one module per kind of command (``python -m optima ...`` and the five scripts).

* ``common``: the flags and guard every command shares (environments, ``--set``, ``--dry-run``, exit codes);
* ``loop``: the three training scripts; ``evaluate``: the two evaluation scripts;
* ``compare``: ``python -m optima compare``; ``folders``: ``report`` and ``show``.
"""

from optima.cli.compare import run_compare_script
from optima.cli.evaluate import run_eval_script
from optima.cli.folders import run_report_command, run_show_command
from optima.cli.loop import build_loop_parser, run_loop_script, trainer_set_overrides

__all__ = [
    "build_loop_parser",
    "run_compare_script",
    "run_eval_script",
    "run_loop_script",
    "run_report_command",
    "run_show_command",
    "trainer_set_overrides",
]
