"""``ServerHolder``'s decisions: reuse, reload in place, a fresh start when a server died or a reload failed.

The policy replicas are scripted servers in this process (``serve`` replaced by one that records each start), so
that every request the holder sends can be read back; the killed-process cases run the fake ``vllm`` executable
(``tests/fake_vllm.py``) in its own process group. The real engine: ``tests/test_loss_server.py``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from optima.hardware.memory import GIB, available_memory_bytes
from optima.hardware.placement import Placement, ServerLayout, place_servers
from optima.identity import COMPLETE_MARKER, PROBE_KEY, Probe
from optima.paths import RunPaths
from optima.serving import holder as holder_module
from optima.serving import vllm_server
from optima.serving.holder import ServerHolder
from optima.serving.processes import group_members, wait_group_exit
from optima.serving.reload import WeightsMismatch
from optima.serving.vllm_server import ReplicaLayout
from tests.fake_openai import FakeOpenAIServer
from tests.helpers import child_groups
from tests.test_layout import FAKE_ENV, server_log_lines, sft_recipe

CPU_KEPT = ServerLayout((Placement(carry_over=True),), None)
CPU_FRESH = ServerLayout((Placement(),), None)
GPU_KEPT = ServerLayout((Placement(gpus=("0",), carry_over=True),), None)


class StuckCache(FakeOpenAIServer):
    """A server whose prefix cache cannot be emptied (vLLM answers 200 with ``success: false``)."""

    def dev_route(self, path: str, body: dict) -> tuple[int, dict]:
        if path == "/reset_prefix_cache":
            return 200, {"success": False}
        return super().dev_route(path, body)


@pytest.fixture
def scripted(monkeypatch):
    """Replaces ``serve``: each start is a new scripted server; ``starts`` lists (model, layout, server)."""
    starts: list[tuple[str, ReplicaLayout, FakeOpenAIServer]] = []
    factory = SimpleNamespace(server_class=FakeOpenAIServer, starts=starts)

    @contextlib.contextmanager
    def serve(recipe, model, vllm_env, stage_paths, layout=None):
        server = factory.server_class().start()
        starts.append((str(model), layout, server))
        try:
            yield [server.base_url]
        finally:
            server.stop()

    monkeypatch.setattr(holder_module, "serve", serve)
    return factory


def holder_for(
    tmp_path, layout: ServerLayout, *, demand=None, available_memory=available_memory_bytes, **overrides
) -> tuple[ServerHolder, object]:
    recipe = sft_recipe(tmp_path, cal_ppl=False, **overrides)  # no loss server: the policy alone
    holder = ServerHolder(recipe, FAKE_ENV, layout=layout, demand=demand, available_memory=available_memory)
    return holder, RunPaths.from_recipe(recipe).stage(0)


def test_the_same_model_is_reused_while_its_server_answers(tmp_path, scripted):
    holder, stage = holder_for(tmp_path, CPU_KEPT)
    with holder:
        first = holder.serve("/models/base", stage)
        assert holder.serve("/models/base", stage) == first
    assert [model for model, _, _ in scripted.starts] == ["/models/base"]
    assert scripted.starts[0][1] == ReplicaLayout(CPU_KEPT.policy, busy_ports=(), loss_starting=False)


def test_after_training_a_kept_cpu_policy_reloads_the_checkpoint_and_empties_its_prefix_cache(tmp_path, scripted):
    holder, stage = holder_for(tmp_path, CPU_KEPT)
    with holder:
        first = holder.serve("/models/base", stage)
        holder.release_for_training()
        holder.release_for_training()  # twice: still kept, nothing sent
        server = scripted.starts[0][2]
        assert holder.asleep and server.posts == []  # on CPU the server only idles
        assert holder.serve("/ckpt/iteration_0", stage) == first
        assert server.posts == ["/collective_rpc", "/collective_rpc", "/reset_prefix_cache"]
        assert server.reloads == ["/ckpt/iteration_0"]  # then the tied LM head packed again (cpu_reload)
        assert holder.model == "/ckpt/iteration_0" and not holder.asleep
    assert len(scripted.starts) == 1


def test_a_kept_gpu_policy_sleeps_then_wakes_with_the_checkpoint(tmp_path, scripted):
    holder, stage = holder_for(tmp_path, GPU_KEPT)
    with holder:
        holder.serve("/models/base", stage)
        holder.release_for_training()
        holder.load_in_place("/ckpt/iteration_0")
        server = scripted.starts[0][2]
        assert server.posts[0] == "/sleep?level=2" and server.reloads == ["/ckpt/iteration_0"]
        assert server.posts[-1] == "/reset_prefix_cache" and holder.model == "/ckpt/iteration_0"


def test_without_sleep_mode_training_stops_the_policy(tmp_path, scripted):
    holder, stage = holder_for(tmp_path, CPU_FRESH)
    with holder:
        holder.serve("/models/base", stage)
        holder.release_for_training()
        assert holder.model is None and not holder.asleep
        with pytest.raises(RuntimeError, match="no kept policy replicas"):
            holder.load_in_place("/ckpt/iteration_0")
        holder.serve("/ckpt/iteration_0", stage)
    assert [model for model, _, _ in scripted.starts] == ["/models/base", "/ckpt/iteration_0"]


@pytest.mark.parametrize(("layout", "starts"), [(CPU_KEPT, 1), (CPU_FRESH, 3)])
def test_models_served_in_turn_load_in_place_when_the_replicas_are_kept(tmp_path, scripted, layout, starts):
    holder, stage = holder_for(tmp_path, layout)
    with holder:
        for model in ("/models/base", "/ckpt/iteration_0", "/ckpt/iteration_0", "/ckpt/iteration_1"):
            holder.serve_in_turn(model, stage)
            assert holder.model == model and not holder.asleep
    assert len(scripted.starts) == starts  # kept: one start, then two in-place loads; else one start per model
    if starts == 1:
        assert scripted.starts[0][2].reloads == ["/ckpt/iteration_0", "/ckpt/iteration_1"]


@pytest.mark.parametrize("asleep", [True, False])
def test_a_policy_that_died_is_replaced_by_a_fresh_start(tmp_path, scripted, caplog, asleep):
    holder, stage = holder_for(tmp_path, CPU_KEPT)
    with holder, caplog.at_level(logging.WARNING, logger="optima.serving.holder"):
        holder.serve("/models/base", stage)
        if asleep:
            holder.release_for_training()
        scripted.starts[0][2].stop()  # killed, e.g. by the OOM killer while the trainer ran
        needed = "/ckpt/iteration_0" if asleep else "/models/base"
        urls = holder.serve(needed, stage)
        assert urls == [scripted.starts[1][2].base_url] and holder.model == needed and not holder.asleep
    assert [model for model, _, _ in scripted.starts] == ["/models/base", needed]
    assert "do not answer /health" in caplog.text and "starting fresh ones" in caplog.text


@pytest.mark.parametrize("failure", ["reload answers 500", "prefix cache not emptied"])
def test_a_failed_reload_is_replaced_by_a_fresh_start(tmp_path, scripted, caplog, failure):
    if failure == "prefix cache not emptied":
        scripted.server_class = StuckCache
    holder, stage = holder_for(tmp_path, CPU_KEPT)
    with holder, caplog.at_level(logging.WARNING, logger="optima.serving.holder"):
        holder.serve("/models/base", stage)
        scripted.starts[0][2].fail_reload = failure == "reload answers 500"
        holder.release_for_training()
        scripted.server_class = FakeOpenAIServer
        holder.serve("/ckpt/iteration_0", stage)
        assert holder.model == "/ckpt/iteration_0" and len(scripted.starts) == 2
    assert "loading /ckpt/iteration_0 in place failed" in caplog.text


def test_a_gpu_policy_that_cannot_sleep_is_stopped(tmp_path, scripted, caplog):
    holder, stage = holder_for(tmp_path, GPU_KEPT)
    with holder, caplog.at_level(logging.WARNING, logger="optima.serving.holder"):
        holder.serve("/models/base", stage)
        scripted.starts[0][2].stop()
        holder.release_for_training()  # the memory must be free for the trainer either way
        assert holder.model is None and not holder.asleep
    assert "could not be put to sleep" in caplog.text


def measured(recipe, peak_bytes: int) -> None:
    """The preflight's measurement of the run (``<output_dir>/preflight.json``)."""
    Path(recipe.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(recipe.output_dir) / "preflight.json").write_text(json.dumps({"peak_rss_bytes": peak_bytes}))


@pytest.mark.parametrize(("available_gib", "kept"), [(20, True), (5, False)])
def test_a_trainer_that_does_not_fit_beside_the_idle_cpu_policy_stops_it(
    tmp_path, scripted, caplog, available_gib, kept
):
    holder, stage = holder_for(tmp_path, CPU_KEPT, available_memory=lambda: available_gib * GIB)  # at training time
    measured(holder.recipe, 6 * GIB)
    with holder, caplog.at_level(logging.INFO, logger="optima.serving.holder"):
        holder.serve("/models/base", stage)
        assert holder.idles_on_cpu
        holder.release_for_training(trainer=True)
        assert holder.asleep is kept and (holder.model == "/models/base") is kept and not holder.idles_on_cpu
        holder.serve("/ckpt/iteration_0", stage)  # reloaded in place, or a fresh start
    assert len(scripted.starts) == (1 if kept else 2)
    said = "the policy stays up through training" if kept else "does not fit"
    level = logging.INFO if kept else logging.WARNING
    holder_records = [r for r in caplog.records if r.name == "optima.serving.holder" and r.levelno == level]
    record = next(r for r in holder_records if said in r.getMessage())  # other loggers may write after it
    numbers = ("measured peak 6.0 GiB", "1.0 GiB margin", f"{available_gib:.1f} GiB available")
    assert all(number in record.getMessage() for number in numbers)
    assert ("stopping the policy for this training" in caplog.text) is not kept


def test_without_a_preflight_measurement_the_idle_cpu_policy_stays(tmp_path, scripted, caplog):
    """The documented fallback: nothing measured (no preflight ran), nothing to weigh: it stays, as on a GPU."""
    holder, stage = holder_for(tmp_path, CPU_KEPT, available_memory=lambda: 0)
    with holder, caplog.at_level(logging.INFO, logger="optima.serving.holder"):
        holder.serve("/models/base", stage)
        holder.release_for_training(trainer=True)
        assert holder.asleep
    assert "no preflight measurement (preflight.json): the policy stays up through training" in caplog.text


@pytest.mark.parametrize(
    ("layout", "overrides", "sized_here"),
    [(CPU_KEPT, {}, True), (CPU_KEPT, {"cpu_kvcache_space_gb": 2}, False), (GPU_KEPT, {}, False)],
)
def test_what_the_conversations_ask_goes_to_an_automatic_cpu_cache_only(
    tmp_path, scripted, layout, overrides, sized_here
):
    holder, stage = holder_for(tmp_path, layout, demand=lambda model: 3 * GIB, **overrides)
    with holder:
        holder.serve("/models/base", stage)
    assert scripted.starts[0][1].demand == (3 * GIB if sized_here else None)


def test_a_policy_stopped_for_a_trainer_is_weighed_again_at_the_next_training(tmp_path, scripted):
    available = [5 * GIB]
    holder, stage = holder_for(tmp_path, CPU_KEPT, available_memory=lambda: available[0])
    measured(holder.recipe, 9 * GIB)
    with holder:
        holder.serve("/models/base", stage)
        holder.release_for_training(trainer=True)  # 9 + 1 GiB do not fit in 5: stopped
        holder.serve("/ckpt/iteration_0", stage)  # a fresh start
        available[0] = 12 * GIB
        holder.release_for_training(trainer=True)  # fits now: it stays
        assert holder.asleep
    assert len(scripted.starts) == 2


def test_on_a_gpu_the_trainer_peak_does_not_decide_the_sleep(tmp_path, scripted):
    # The host's memory is not the trainer's: the GPU's is the preflight's to check.
    holder, stage = holder_for(tmp_path, GPU_KEPT, available_memory=lambda: 0)
    measured(holder.recipe, 60 * GIB)
    with holder:
        holder.serve("/models/base", stage)
        assert not holder.idles_on_cpu
        holder.release_for_training(trainer=True)
        assert holder.asleep and scripted.starts[0][2].posts == ["/sleep?level=2"]


def test_a_reload_that_serves_other_weights_stops_the_run(tmp_path, scripted):
    """The probe recorded with the checkpoint disagrees with what the server answers: no silent fresh start."""
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    probe = Probe((1, 2), (3,), (None, -1.0, -1.0), "float32")
    (checkpoint / COMPLETE_MARKER).write_text(json.dumps({PROBE_KEY: probe.to_json()}))

    class OtherWeights(FakeOpenAIServer):
        def __init__(self):
            super().__init__(scorer=lambda ids: ([None] + [-4.0] * (len(ids) - 1), [None] + [-0.5] * (len(ids) - 1)))

    scripted.server_class = OtherWeights
    holder, stage = holder_for(tmp_path, CPU_KEPT)
    with holder:
        holder.serve("/models/base", stage)
        holder.release_for_training()
        with pytest.raises(WeightsMismatch, match=f"does not serve the weights of {checkpoint}"):
            holder.serve(str(checkpoint), stage)
    assert len(scripted.starts) == 1


def test_external_endpoints_are_never_put_to_sleep(tmp_path, monkeypatch):
    with FakeOpenAIServer(root="/models/base") as server:
        recipe = sft_recipe(tmp_path, cal_ppl=False, endpoints=[server.base_url], endpoint_sync="off")
        with ServerHolder(recipe, None, layout=place_servers(recipe, [], [0, 1])) as holder:
            assert not holder.kept
            holder.serve("/models/base", RunPaths.from_recipe(recipe).stage(0))
            holder.release_for_training()
            assert holder.model is None
        assert server.posts == []


def kill_group(pgid: int) -> None:
    """SIGKILL a server's whole process group, as the kernel's OOM killer leaves it (no clean shutdown)."""
    os.killpg(pgid, signal.SIGKILL)
    assert wait_group_exit(pgid, 30)


def test_killed_processes_are_replaced_and_nothing_outlives_the_run(tmp_path, caplog):
    """The fake ``vllm`` as real processes: the kept policy and the loss server both killed during training."""
    recipe = sft_recipe(tmp_path)  # sleep_mode: the default (kept); the loss server beside it
    holder = ServerHolder(
        recipe, FAKE_ENV, "/models/base", tmp_path / "logs", layout=place_servers(recipe, [], [0, 1])
    )
    stage = RunPaths.from_recipe(recipe).stage(0)
    with holder, caplog.at_level(logging.WARNING, logger="optima.serving.holder"):
        holder.serve("/models/base", stage)
        holder.loss_urls()
        loss_group = holder.loss.server.pgid
        (policy_group,) = [group for group in child_groups(os.getpid()) if group != loss_group]
        holder.release_for_training()
        kill_group(policy_group)
        kill_group(loss_group)
        holder.serve("/ckpt/iteration_0", stage)
        holder.loss_urls()
        groups = child_groups(os.getpid())
        assert len(groups) == 2 and policy_group not in groups and loss_group not in groups
        assert holder.model == "/ckpt/iteration_0"
    assert all(group_members(group) == [] for group in groups)
    assert len(server_log_lines(stage.server_log(0))) == 2  # the policy: started again
    assert len(server_log_lines(tmp_path / "logs" / "loss_server.log")) == 2
    assert "loss server" in caplog.text and "starting a fresh one" in caplog.text


def test_health_is_polled_at_least_every_half_second():
    """Work starts as soon as a server answers: the backoff never waits longer than ``HEALTH_POLL_MAX_S``."""
    waits: list[float] = []

    class Starting:
        def __init__(self, polls: int):
            self.polls = polls

        def poll_ready(self) -> bool:
            self.polls -= 1
            return self.polls < 0

        def wait(self, timeout_s: float) -> int:
            waits.append(timeout_s)
            raise vllm_server.subprocess.TimeoutExpired("vllm", timeout_s)

    vllm_server.wait_until_all_ready([Starting(12)], timeout_s=600)
    assert len(waits) == 12 and max(waits) == vllm_server.HEALTH_POLL_MAX_S == 0.5 and waits[0] <= 0.1


def test_generation_starts_before_the_loss_server_answers(tmp_path, monkeypatch):
    """The SFT generation stage asks for the policy only; the loss server is waited for by the first score."""
    from optima import run as run_module
    from optima import stages
    from optima.run import LossRoute, Settings

    events: list[str] = []
    record = {"task_id": "q1", "sample_index": 0, "status": "ok", "utterances": [{"speaker": "Alice", "text": "hi"}]}

    class Servers:
        loss = "a loss server beside the policy"

        def serve(self, model, stage_paths):
            events.append("policy ready")
            return ["http://127.0.0.1:1/v1"]

        def loss_urls(self):
            events.append("loss server ready")
            return ["http://127.0.0.1:2/v1"]

    def generate(recipe, examples, endpoints, path, generation, hooks=None):
        events.append("generation starts")
        hooks.on_record(record)
        return SimpleNamespace(to_dict=dict)

    recipe = sft_recipe(tmp_path)
    monkeypatch.setattr(stages, "training_questions", lambda run, iteration, kind, count: [])
    monkeypatch.setattr(run_module, "served_loss_scorer", lambda run, urls: lambda texts: [2.0] * len(texts))
    monkeypatch.setattr(stages, "generate_conversations", generate)
    run = SimpleNamespace(recipe=recipe, servers=Servers())
    part = SimpleNamespace(run=run, sp=RunPaths.from_recipe(recipe).stage(0), recipe=recipe, iteration=0, model="/m")
    result = stages.generate(part, Settings({}, loss=LossRoute("loss server", "/m")))
    assert events == ["policy ready", "generation starts", "loss server ready"]
    assert result["loss_stream"]["scored"] == 1


def test_a_scorer_that_cannot_be_built_is_not_built_again_by_every_conversation():
    from optima.run import built_on_first_use

    builds = []

    def build():
        builds.append(1)
        raise vllm_server.ServerStartupError("loss server died during start-up")

    score = built_on_first_use(build)
    assert builds == []  # nothing waits before the first text
    with pytest.raises(vllm_server.ServerStartupError):
        score(["a"])
    with pytest.raises(RuntimeError, match="could not be built: loss server died"):
        score(["b"])
    assert builds == [1]


def test_a_holder_takes_the_plans_layout_and_never_plans_itself(tmp_path, monkeypatch):
    """The hardware allocation is made once, before anything starts, and handed in: no layout is a type error, None
    only stands for external endpoints, and reading the layout allocates nothing; constructing the holder starts
    nothing."""
    recipe = sft_recipe(tmp_path)
    with pytest.raises(TypeError, match="layout"):
        ServerHolder(recipe, FAKE_ENV)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="hardware allocation's layout"):
        ServerHolder(recipe, FAKE_ENV, layout=None)
    import optima.hardware.allocation as allocation_module

    monkeypatch.setattr(
        allocation_module, "allocate_hardware", lambda *a, **k: pytest.fail("the holder planned hardware")
    )
    layout = place_servers(recipe, [], [0, 1])
    holder = ServerHolder(recipe, FAKE_ENV, "/models/base", tmp_path / "logs", layout=layout)
    assert holder.layout is layout and holder.kept
    # The loss server is made with the holder (reading ``loss`` makes nothing), and nothing starts before ``serve``.
    assert holder.loss is not None and holder.loss.server is None and not holder.loss.running
    outside = ServerHolder(sft_recipe(tmp_path, endpoints=["http://127.0.0.1:1/v1"]), None, layout=None)
    assert not outside.kept  # external endpoints: nothing placed, nothing kept
