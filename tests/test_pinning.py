"""Pinning a server's API server and engine core away from its compute threads (``optima.serving.pinning``).

A stand-in process group: a leader (the API server's place) and a child that names itself ``VLLM::Worker`` the way
vLLM's workers do; no vLLM needed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from optima.hardware.placement import Placement
from optima.serving.pinning import SERVICE_CPUS_ENV, parse_cpu_list, pin_service_processes, service_processes
from optima.serving.vllm_server import build_serve_env
from tests.test_layout import VENV, sft_recipe

LEADER = """
import subprocess, sys
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
worker.stdout.readline()
print(worker.pid, flush=True)
sys.stdin.read()
"""
WORKER = """
import ctypes, sys
ctypes.CDLL(None).prctl(15, b"VLLM::Worker", 0, 0, 0)  # PR_SET_NAME, as vLLM's setproctitle does
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize(("text", "expected"), [("0", {0}), ("0,2-3", {0, 2, 3}), (" 1 , 5 ", {1, 5})])
def test_parse_cpu_list(text, expected):
    assert parse_cpu_list(text) == expected


@pytest.mark.parametrize("text", ["", "a", "1-b", ","])
def test_parse_cpu_list_quotes_what_it_rejects(text):
    with pytest.raises(ValueError, match=f"not a CPU list: {text!r}"):
        parse_cpu_list(text)


def test_service_processes_move_and_the_worker_keeps_its_cores():
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two allowed CPUs")
    leader = subprocess.Popen(
        [sys.executable, "-c", LEADER, WORKER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        worker = int(leader.stdout.readline())
        assert service_processes(leader.pid) == [leader.pid]
        moved = pin_service_processes(leader.pid, str(cpus[-1]))
        assert moved >= 1
        threads = os.listdir(f"/proc/{leader.pid}/task")
        assert all(os.sched_getaffinity(int(t)) == {cpus[-1]} for t in threads)
        assert os.sched_getaffinity(worker) == set(cpus)  # the compute threads are not moved
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait(timeout=10)


def test_the_service_cores_travel_in_the_servers_environment(tmp_path):
    recipe = sft_recipe(tmp_path, cpu_kvcache_space_gb=1)
    env = build_serve_env(recipe, VENV, Placement(cpu_bind="0", service_bind="1"), tmp_path, "/m")
    assert env[SERVICE_CPUS_ENV] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert SERVICE_CPUS_ENV not in build_serve_env(recipe, VENV, Placement(cpu_bind="0"), tmp_path, "/m")
