"""optima.serving without vLLM: command lines, placement, ports, and VLLMServer against a fake ``vllm``."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from optima.config import RecipeError
from optima.environments import PythonEnv
from optima.hardware.placement import Placement, place_replicas
from optima.paths import RunPaths
from optima.serving.client import ServerStartupError
from optima.serving.processes import group_members
from optima.serving.reload import normalize_base_url, sync_endpoints
from optima.serving.vllm_server import (
    ReplicaLayout,
    ServerSpec,
    VLLMServer,
    build_replica_specs,
    build_serve_command,
    build_serve_env,
    find_free_port,
    serve,
    start_replicas,
)
from tests.fake_vllm import CRASH_MARKER
from tests.helpers import child_groups

FAKE_VLLM = Path(__file__).with_name("fake_vllm.py")
# A "vLLM environment" whose `python -m optima.serving.launcher serve ...` runs the fake instead.
FAKE_ENV = PythonEnv("fake", "python", (sys.executable, str(FAKE_VLLM)))
VENV = PythonEnv("venv", "venv", ("/venv/bin/python",))


def test_cpu_command_runs_the_launcher_with_the_cpu_fixes(make_recipe):
    recipe = make_recipe(seed=7, served_model_name="m", vllm_extra_args=["--max-num-seqs", "8"])
    argv = build_serve_command(recipe, "/models/x", 8001, VENV, Placement())
    assert argv[:5] == ["/venv/bin/python", "-m", "optima.serving.launcher", "serve", "/models/x"]
    text = " ".join(argv)
    for part in (
        "--host 127.0.0.1",
        "--port 8001",
        "--served-model-name m",
        "--enable-prefix-caching",
        "--seed 7",
        "--dtype float32",
        "--enforce-eager",
        "--no-enable-chunked-prefill",
        "--max-num-batched-tokens 8192",
        "--generation-config vllm",
    ):
        assert part in text
    assert argv[-2:] == ["--max-num-seqs", "8"]
    assert "--tensor-parallel-size" not in argv and "--gpu-memory-utilization" not in argv


def test_gpu_command_and_batched_tokens_follow_the_recipe(make_recipe):
    recipe = make_recipe(tensor_parallel_size=2, gpu_memory_utilization=0.8, max_model_len=16384)
    argv = build_serve_command(recipe, "org/model", 8000, VENV, Placement(gpus=("0", "1")))
    text = " ".join(argv)
    assert "--tensor-parallel-size 2" in text and "--gpu-memory-utilization 0.8" in text
    assert "--max-model-len 16384" in text and "--enforce-eager" not in text and "--dtype" not in text
    cpu = " ".join(build_serve_command(recipe, "org/model", 8000, VENV, Placement()))
    assert "--max-num-batched-tokens 16384" in cpu  # without chunked prefill a batch must hold a whole prompt


def test_serve_env_keeps_the_api_key_out_of_argv(make_recipe, tmp_path):
    recipe = make_recipe(api_key="secret")
    assert "secret" not in build_serve_command(recipe, str(tmp_path), 8000, VENV, Placement())
    env = build_serve_env(recipe, VENV, Placement(cpu_bind="1"), tmp_path / "cache", str(tmp_path))
    assert env["VLLM_API_KEY"] == "secret" and env["VLLM_TARGET_DEVICE"] == "cpu"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "cache") and env["HF_HUB_OFFLINE"] == "1"
    gpu = build_serve_env(make_recipe(), VENV, Placement(gpus=("2", "3")), tmp_path, "org/model")
    assert gpu["CUDA_VISIBLE_DEVICES"] == "2,3" and "VLLM_TARGET_DEVICE" not in gpu and "HF_HUB_OFFLINE" not in gpu


@pytest.mark.parametrize(
    ("devices", "tp", "gpus", "expected"),
    [
        (None, 1, ["0", "1"], [("0",), ("1",)]),
        ([0, 1, 2, 3], 2, ["0", "1", "2", "3"], [("0", "1"), ("2", "3")]),
        ([1], 1, ["4", "5"], [("5",)]),  # ordinals index the visible GPUs (CUDA_VISIBLE_DEVICES=4,5)
        ([0, 2, 3], 1, ["0", "1", "2", "3"], [("0",), ("2",), ("3",)]),
    ],
)
def test_one_replica_per_tensor_parallel_group(make_recipe, devices, tp, gpus, expected):
    recipe = make_recipe(devices=devices, tensor_parallel_size=tp)
    assert [p.gpus for p in place_replicas(recipe, gpus, [0])] == expected


@pytest.mark.parametrize(("devices", "tp"), [([0, 1, 2], 2), ([5], 1)])
def test_impossible_gpu_layouts_fail(make_recipe, devices, tp):
    with pytest.raises(RecipeError, match="devices"):
        place_replicas(make_recipe(devices=devices, tensor_parallel_size=tp), ["0", "1", "2"], [0])


@pytest.mark.parametrize(
    ("replicas", "cpus", "binds"),
    [(1, [0, 1], [None]), (2, [0, 1], ["0", "1"]), (2, [0, 1, 2, 3], ["0,1", "2,3"]), (3, [0, 1], ["0", "1", "0"])],
)
def test_cpu_replicas_split_the_cores(make_recipe, replicas, cpus, binds):
    placements = place_replicas(make_recipe(), [], cpus, replicas)
    assert [p.cpu_bind for p in placements] == binds and all(p.on_cpu for p in placements)


def test_ports_skip_busy_ones_and_each_other(make_recipe, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        port = busy.getsockname()[1]
        assert find_free_port("127.0.0.1", port) > port
        assert find_free_port("127.0.0.1", port + 1, exclude=[port + 1]) >= port + 2
        recipe = make_recipe(port=port)
        specs = build_replica_specs(
            recipe, str(tmp_path), VENV, RunPaths(tmp_path).stage(0), ReplicaLayout([Placement()] * 2)
        )
    assert port < specs[0].port < specs[1].port
    assert specs[1].log_path == tmp_path / "iteration_0" / "logs" / "vllm_1.log"
    assert specs[0].api_url == f"http://127.0.0.1:{specs[0].port}/v1"


def fake_spec(tmp_path: Path, replica: int = 0, **env) -> ServerSpec:
    port = find_free_port("127.0.0.1", 20000 + os.getpid() % 20000)
    argv = (sys.executable, str(FAKE_VLLM), "serve", "model", "--port", str(port))
    return ServerSpec(replica, argv, {**os.environ, **env}, "127.0.0.1", port, tmp_path / f"vllm_{replica}.log")


def test_server_becomes_ready_and_its_whole_group_is_stopped(tmp_path):
    with VLLMServer(fake_spec(tmp_path, FAKE_VLLM_CHILD="1", FAKE_VLLM_STARTUP_S="0.5")) as server:
        server.wait_until_ready(30)
        assert server.is_healthy()
        pgid = server.pgid
        assert len(group_members(pgid)) == 2  # the server and its "engine" child
    assert group_members(pgid) == []
    assert "fake vllm: ready" in (tmp_path / "vllm_0.log").read_text()


def test_crash_before_ready_fails_fast_with_the_log_tail(tmp_path):
    started = time.monotonic()
    with pytest.raises(ServerStartupError, match="exited with code 3") as error:
        with VLLMServer(fake_spec(tmp_path, FAKE_VLLM_MODE="crash")) as server:
            server.wait_until_ready(60)
    assert CRASH_MARKER in str(error.value) and str(tmp_path / "vllm_0.log") in str(error.value)
    assert time.monotonic() - started < 10


REFUSAL = "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`"


@pytest.mark.parametrize(
    ("flags", "env", "share"),
    [
        ((), {"VLLM_CPU_KVCACHE_SPACE": "2"}, "with VLLM_CPU_KVCACHE_SPACE=2 GiB"),
        (
            ("--gpu-memory-utilization", "0.4"),
            {"CUDA_VISIBLE_DEVICES": "3"},
            "with --gpu-memory-utilization 0.4 (GPUs 3)",
        ),
    ],
)
def test_a_refused_start_names_the_server_its_share_and_vllms_reason(tmp_path, flags, env, share):
    """vLLM checks the memory at start-up; the error says which server, with what share, and vLLM's own reason (the
    cause, not the wrapper line after it), from this start's part of the log only."""
    spec = fake_spec(tmp_path, FAKE_VLLM_MODE="crash", FAKE_VLLM_REASON=REFUSAL, **env)
    spec = dataclasses.replace(spec, argv=spec.argv + flags, name="loss server")
    messages = []
    for refusal in (REFUSAL, ""):  # the second start logs no reason: the first start's is not reported again
        spec.env["FAKE_VLLM_REASON"] = refusal
        with pytest.raises(ServerStartupError) as error, VLLMServer(spec) as server:
            server.wait_until_ready(60)
        messages.append(str(error.value).splitlines()[0])
    where = f"vLLM loss server ({spec.api_url}) exited with code 3 before it was ready, {share}"
    assert messages == [
        f"{where}: {REFUSAL}; log {spec.log_path}, last lines:",
        f"{where}; log {spec.log_path}, last lines:",
    ]


def test_startup_deadline(tmp_path):
    with pytest.raises(ServerStartupError, match="did not answer /health within 1 s"):
        with VLLMServer(fake_spec(tmp_path, FAKE_VLLM_MODE="hang")) as server:
            pgid = server.pgid
            server.wait_until_ready(1)
    assert group_members(pgid) == []


def test_sigterm_is_escalated_to_sigkill(tmp_path):
    server = VLLMServer(fake_spec(tmp_path, FAKE_VLLM_MODE="stubborn", FAKE_VLLM_CHILD="1"), stop_timeout_s=1)
    with server:
        server.wait_until_ready(30)
        pgid = server.pgid
    assert group_members(pgid) == []


def test_a_replica_crashing_while_another_loads_fails_at_once_and_stops_all(tmp_path):
    hanging = fake_spec(tmp_path, 0, FAKE_VLLM_MODE="hang")
    port = find_free_port("127.0.0.1", hanging.port + 1)
    crashing = ServerSpec(
        1,
        (*hanging.argv[:-1], str(port)),
        {**os.environ, "FAKE_VLLM_MODE": "crash"},
        "127.0.0.1",
        port,
        tmp_path / "vllm_1.log",
    )
    started = time.monotonic()
    with pytest.raises(ServerStartupError, match="replica 1 .* exited with code 3"):
        with start_replicas([hanging, crashing], 60) as servers:
            pytest.fail(f"should not be ready: {servers}")
    assert time.monotonic() - started < 15  # not after replica 0's deadline
    assert child_groups(os.getpid()) == []


def test_an_error_inside_serve_stops_the_servers(make_recipe):
    recipe = make_recipe(port=find_free_port("127.0.0.1", 21500))
    with pytest.raises(RuntimeError, match="boom"):
        with serve(recipe, "model", FAKE_ENV, RunPaths.from_recipe(recipe).stage(0)):
            groups = child_groups(os.getpid())
            raise RuntimeError("boom")
    assert len(groups) == 1 and group_members(groups[0]) == []


def test_serve_launches_replicas_and_yields_urls(make_recipe, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_CHILD", "1")
    recipe = make_recipe(port=find_free_port("127.0.0.1", 21000))
    stage = RunPaths.from_recipe(recipe).stage(0)
    with serve(recipe, "model", FAKE_ENV, stage, cpu_replicas=2) as urls:
        assert len(urls) == 2 and all(u.startswith("http://127.0.0.1:") and u.endswith("/v1") for u in urls)
        groups = child_groups(os.getpid())
        assert len(groups) == 2
        log = stage.server_log(1).read_text()
        assert "optima.serving.launcher serve model" in log and "--enable-prefix-caching" in log
    assert not any(group_members(g) for g in groups)


def test_external_endpoints_are_checked_not_launched(make_recipe, fake_servers, tmp_path):
    recipe = make_recipe(endpoints=[fake_servers[0].root_url, fake_servers[1].base_url + "/"])
    with serve(recipe, "unused", None, RunPaths(tmp_path).stage(0)) as urls:
        assert urls == [fake_servers[0].base_url, fake_servers[1].base_url]
    assert child_groups(os.getpid()) == []


def test_external_endpoint_serving_another_model_is_rejected(make_recipe, fake_server):
    with pytest.raises(ServerStartupError, match="not served_model_name='other'"):
        sync_endpoints([fake_server.base_url], make_recipe(served_model_name="other"), "model")


def test_unreachable_endpoints_are_dropped_and_none_left_fails(make_recipe, fake_server):
    dead = f"http://127.0.0.1:{find_free_port('127.0.0.1', 22000)}/v1"
    assert sync_endpoints([dead, fake_server.base_url], make_recipe(), "model") == [fake_server.base_url]
    with pytest.raises(ServerStartupError, match="none of the endpoints"):
        sync_endpoints([dead], make_recipe(), "model")


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://h:8000", "http://h:8000/v1"),
        ("http://h:8000/v1/", "http://h:8000/v1"),
        ("https://x/api", "https://x/api"),
    ],
)
def test_normalize_base_url(url, expected):
    assert normalize_base_url(url) == expected


def test_sigterm_handler_turns_into_system_exit():
    from optima.serving.processes import sigterm_as_exit

    with pytest.raises(SystemExit) as exit_info:
        with sigterm_as_exit():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this ends
    assert exit_info.value.code == 143
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_the_names_vllm_imports_by_name_exist():
    """The server's command line names the launcher module and the CPU worker extension; the reload calls the
    extension's method by name: all three must resolve (a rename would break only the real server)."""
    import importlib
    import importlib.util

    from optima.serving import reload, vllm_server

    module, _, name = vllm_server.CPU_RELOAD_EXTENSION.rpartition(".")
    assert callable(getattr(getattr(importlib.import_module(module), name), reload.REFRESH_METHOD))
    assert importlib.util.find_spec(vllm_server.LAUNCHER_MODULE) is not None
