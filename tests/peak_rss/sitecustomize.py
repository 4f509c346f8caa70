"""Records each training rank's peak resident memory at exit (``tests/test_trainer_memory.py``, slow).

On ``PYTHONPATH`` ahead of ``tests/write_audit``: every process with ``RANK`` set writes ``ru_maxrss`` (bytes) to
``$OPTIMA_TEST_PEAK_RSS/rank<R>.<pid>``, then runs the write audit's own ``sitecustomize`` when
``OPTIMA_TEST_AUDIT_SITE`` names it (only one ``sitecustomize`` is imported per interpreter).
"""

import atexit
import os
import resource
import runpy


def _write_peak() -> None:
    folder = os.environ.get("OPTIMA_TEST_PEAK_RSS")
    if folder and os.environ.get("RANK") is not None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        with open(os.path.join(folder, f"rank{os.environ['RANK']}.{os.getpid()}"), "w") as out:
            out.write(str(peak))


atexit.register(_write_peak)
if os.environ.get("OPTIMA_TEST_AUDIT_SITE"):
    runpy.run_path(os.environ["OPTIMA_TEST_AUDIT_SITE"])
