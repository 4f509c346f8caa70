"""The machine's busy share from ``/proc/stat`` while a run goes on: a process's ``rusage`` misses the vLLM servers
and the trainer's children, so the kernel's per-machine counters are sampled instead (one JSON line per second:
``{"t", "busy", "total"}`` jiffies; busy = user + nice + system + irq + softirq).
"""

from __future__ import annotations

import json
import threading
import time
from bisect import bisect_left, bisect_right
from pathlib import Path

BUSY_FIELDS = (0, 1, 2, 5, 6)  # user, nice, system, irq, softirq (guest time is inside user already)
ALL_FIELDS = 8  # ... idle 3, iowait 4, steal 7


def read_cpu_jiffies(stat_text: str) -> tuple[int, int]:
    """(busy, total) jiffies of all cores together, from the text of ``/proc/stat``."""
    for line in stat_text.splitlines():
        if line.startswith("cpu "):
            values = [int(v) for v in line.split()[1 : 1 + ALL_FIELDS]]
            return sum(values[i] for i in BUSY_FIELDS), sum(values)
    raise ValueError("/proc/stat has no 'cpu ' line")


class CpuSampler:
    """Appends ``{"t", "busy", "total"}`` to ``path`` every ``interval_s`` from a background thread.

    Args:
        path: The JSON-lines file (appended to: a resumed run keeps its earlier samples).
        interval_s: Seconds between samples.
        stat_path: The counters' file (a test gives its own).
    """

    def __init__(self, path: Path, interval_s: float = 1.0, stat_path: Path = Path("/proc/stat")):
        self.path, self.interval_s, self.stat_path = Path(path), interval_s, stat_path
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        busy, total = read_cpu_jiffies(self.stat_path.read_text())
        with self.path.open("a") as out:
            out.write(json.dumps({"t": round(time.time(), 3), "busy": busy, "total": total}) + "\n")

    def _run(self) -> None:
        self.sample()
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> CpuSampler:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.sample()  # the last instant, so that the run's end is covered


def read_samples(path: Path) -> list[dict]:
    """The samples in time order ([] when the file is missing); a torn last line is skipped."""
    if not Path(path).exists():
        return []
    samples = []
    for line in Path(path).read_text().splitlines():
        try:
            samples.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return sorted(samples, key=lambda s: s["t"])


def busy_share(samples: list[dict], start: float | None = None, end: float | None = None) -> float | None:
    """Busy jiffies / all jiffies between the first sample at or after ``start`` and the last at or before ``end``
    (None: the first / last sample); None when fewer than two samples fall inside."""
    times = [s["t"] for s in samples]
    first = 0 if start is None else bisect_left(times, start)
    last = len(samples) - 1 if end is None else bisect_right(times, end) - 1
    if last - first < 1:
        return None
    total = samples[last]["total"] - samples[first]["total"]
    return (samples[last]["busy"] - samples[first]["busy"]) / total if total > 0 else None
