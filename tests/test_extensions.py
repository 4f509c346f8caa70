"""A killed JIT build's lock no longer hangs the next ZeRO-3 start (``optima.training.extensions``), and the launchers
(``run_training``, ``run_ranks``) clear it before they start anything. DeepSpeed itself is not run: the lock is the
one torch's ``FileBaton`` would wait on, planted as a killed build leaves it."""

from __future__ import annotations

import os
import sys
import time

import pytest

from optima.environments import resolve_env
from optima.hardware.machine import ACCELERATE_CONFIGS
from optima.training import extensions
from optima.training.launch import run_ranks, run_training
from optima.training.launch_config import TrainLaunch


def plant_lock(root, age_s: float = 60.0):
    """``<root>/py311_cpu/deepspeed_shm_comm/lock`` with no built library beside it, created ``age_s`` ago."""
    folder = root / "py311_cpu" / "deepspeed_shm_comm"
    folder.mkdir(parents=True)
    (folder / "build.ninja").write_text("")  # the build started, and no deepspeed_shm_comm.so was written
    lock = folder / "lock"
    lock.write_text("")
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_a_stale_lock_is_removed_and_torchs_baton_is_free_again(tmp_path):
    from torch.utils.file_baton import FileBaton

    lock = plant_lock(tmp_path)
    assert not FileBaton(str(lock)).try_acquire()  # what every rank would wait on, forever
    assert extensions.remove_stale_build_locks(tmp_path) == [lock]
    baton = FileBaton(str(lock))
    assert baton.try_acquire()  # the next build takes the baton at once
    baton.release()


def test_a_lock_held_open_by_a_live_build_is_kept(tmp_path):
    lock = plant_lock(tmp_path)
    fd = os.open(lock, os.O_RDONLY)  # as torch's builder holds it until its build ends
    try:
        assert extensions.lock_holders(lock) == [os.getpid()]
        assert extensions.remove_stale_build_locks(tmp_path) == [] and lock.exists()
    finally:
        os.close(fd)
    assert extensions.lock_holders(lock) == [] and extensions.remove_stale_build_locks(tmp_path) == [lock]


def test_a_lock_just_created_is_kept(tmp_path):
    lock = plant_lock(tmp_path, age_s=0.0)
    assert extensions.remove_stale_build_locks(tmp_path) == [] and lock.exists()


@pytest.mark.parametrize(
    ("environ", "root"),
    [
        ({"TORCH_EXTENSIONS_DIR": "/x/ext", "XDG_CACHE_HOME": "/c", "HOME": "/h"}, "/x/ext"),
        ({"XDG_CACHE_HOME": "/c", "HOME": "/h"}, "/c/torch_extensions"),
        ({"HOME": "/h"}, "/h/.cache/torch_extensions"),
    ],
)
def test_the_root_is_where_torch_builds(environ, root):
    assert str(extensions.extensions_root(environ)) == root


def test_the_root_matches_torchs_own_default(monkeypatch):
    from torch.utils.cpp_extension import get_default_build_root

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert os.path.realpath(extensions.extensions_root()) == get_default_build_root()


def test_run_ranks_clears_a_stale_lock_and_gives_each_rank_its_ids(tmp_path):
    lock = plant_lock(tmp_path / "ext")
    ids = "import os; print(*(os.environ[k] for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE')))"
    argv = [sys.executable, "-c", ids]
    logs = [tmp_path / "rank0.log", tmp_path / "rank1.log"]
    env = os.environ | {"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    assert run_ranks(argv, env, logs, timeout_s=60, local_ranks=[0, 0]) == [0, 0]
    assert [log.read_text() for log in logs] == ["0 0 2\n", "1 0 2\n"]  # two ranks sharing device 0
    assert not lock.exists()


def test_run_ranks_kills_every_rank_at_its_deadline(tmp_path):
    argv = [sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(60)"]
    logs = [tmp_path / "rank0.log", tmp_path / "rank1.log"]
    started = time.monotonic()
    assert run_ranks(argv, dict(os.environ), logs, timeout_s=4) is None  # printed its pid well before
    assert time.monotonic() - started < 40
    for log in logs:
        assert not os.path.exists(f"/proc/{int(log.read_text())}")  # killed and reaped


def test_run_training_clears_a_stale_lock_before_the_trainer_starts(tmp_path):
    lock = plant_lock(tmp_path / "ext")
    trainer = tmp_path / "py"  # stands for the training env's python: reports whether the lock is still there
    trainer.write_text(f"#!/bin/sh\ntest -e {lock} && echo 'lock still there' && exit 4\nexit 0\n")
    trainer.chmod(0o755)
    launch = TrainLaunch("sft", resolve_env(str(trainer), "train"), ACCELERATE_CONFIGS / "cpu.yaml", tmp_path / "t")
    run_training(launch, tmp_path / "train.log", extra_env={"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")})
    assert not lock.exists()
