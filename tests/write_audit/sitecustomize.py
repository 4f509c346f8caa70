"""Test-only: record which process opens which file for writing (``OPTIMA_TEST_WRITE_AUDIT`` = a folder).

Put this folder on ``PYTHONPATH`` of a launched training run: every Python process of it (accelerate, torchrun,
each rank) then appends ``<rank>\t<path>`` to ``<folder>/<pid>.tsv`` for every file it opens for writing, so a
test can tell which rank wrote the checkpoint and whether any rank wrote into the dataset. Writes done outside
Python's ``open`` (safetensors, Arrow) are not seen; the test checks those through the files themselves.
"""

import os
import sys

_AUDIT_DIR = os.environ.get("OPTIMA_TEST_WRITE_AUDIT")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _is_write(mode, flags) -> bool:
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    return isinstance(flags, int) and bool(flags & _WRITE_FLAGS)


def _hook(event, args):
    if event != "open" or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    path = os.fsdecode(args[0])
    if path.startswith(_AUDIT_DIR) or not _is_write(
        args[1] if len(args) > 1 else None, args[2] if len(args) > 2 else 0
    ):
        return
    line = f"{os.environ.get('RANK', '-')}\t{os.path.abspath(path)}\n"
    fd = os.open(os.path.join(_AUDIT_DIR, f"{os.getpid()}.tsv"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


if _AUDIT_DIR:
    sys.addaudithook(_hook)
