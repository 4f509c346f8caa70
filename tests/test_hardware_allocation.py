"""The hardware allocation: every shipped recipe on six machines, one test per GPU defect it fixes, the sizes.

Pure functions only (no process starts): the allocation reads the recipes, the trainer YAMLs and model folders.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from optima.config import DPORecipe, RecipeError, SFTDPORecipe, SFTRecipe, load_recipe
from optima.environments import PythonEnv, resolve_env
from optima.hardware import memory
from optima.hardware.allocation import allocate_hardware
from optima.hardware.machine import Hardware, detect_hardware, parse_hardware
from optima.hardware.placement import Placement
from optima.serving.vllm_server import build_serve_command
from optima.training.launch_config import launch_for
from tests.conftest import requires_smollm2

REPO = Path(__file__).resolve().parent.parent
RECIPES = sorted((REPO / "train").glob("**/*.yaml"))
CLASSES = {"sft_recipes": SFTRecipe, "dpo_recipes": DPORecipe, "sft_dpo_recipes": SFTDPORecipe}
MACHINES = ["1x24GB", "1x80GB", "4x80GB", "8x80GB", "8x141GB", "2x8x80GB"]
VENV = PythonEnv("venv", "venv", ("/venv/bin/python",))
GIB = 1024**3


def load(path: Path, **overrides):
    return load_recipe(CLASSES[path.parent.name], path, overrides, check_paths=False)


def recipe_at(relative: str, **overrides):
    return load(REPO / relative, **overrides)


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # the recipes' relative paths resolve against the repository


def tp_of(argv: list[str]) -> int:
    return int(argv[argv.index("--tensor-parallel-size") + 1])


def assert_feasible(allocation, recipe) -> None:
    """Shares of one GPU within 1, tp = GPUs of each server, no GPU in two replicas, training off the GPUs of a
    resident loss server."""
    layout = allocation.layout
    if layout is not None and allocation.hardware.has_gpu:
        shares = {}
        for p in [*layout.policy, *([layout.loss] if layout.loss else [])]:
            for gpu in p.gpus:
                shares[gpu] = shares.get(gpu, 0) + (p.gpu_memory_utilization or recipe.gpu_memory_utilization)
        assert max(shares.values()) <= 1, shares
    if allocation.layout is not None and allocation.hardware.has_gpu:
        servers = [*allocation.layout.policy, *([allocation.layout.loss] if allocation.layout.loss else [])]
        for placement in servers:
            assert tp_of(build_serve_command(recipe, "/m", 8000, VENV, placement)) == len(placement.gpus)
        policy_gpus = [g for p in allocation.layout.policy for g in p.gpus]
        assert len(policy_gpus) == len(set(policy_gpus))  # no GPU in two replicas
    resident = {(0, g) for g in layout.loss.gpus} if layout and layout.loss and layout.loss_resident else set()
    if allocation.training is not None:
        trained = {(n.machine_rank, g) for n in allocation.training.nodes for g in n.gpus}
        assert not trained & resident, (trained, resident)
        training = allocation.training
        assert training.num_processes == training.processes_per_node * len(training.nodes)


@pytest.mark.parametrize("variant", [{}, {"devices": None}], ids=["as shipped", "all GPUs"])
@pytest.mark.parametrize("machine", MACHINES)
@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(REPO / "train")))
def test_every_shipped_recipe_is_feasible_or_refused_before_start(path, machine, variant):
    """Each recipe as shipped (the Llama ones name GPUs 0-7) and with ``devices: null`` (every GPU there is)."""
    recipe = load(path, **variant)
    allocation = allocate_hardware(recipe, parse_hardware(machine), [0, 1])
    if allocation.problems:
        with pytest.raises(RecipeError, match="hardware allocation"):
            allocation.check()
        return
    allocation.check()
    assert_feasible(allocation, recipe)
    assert allocation.training is not None and allocation.training.num_processes >= 1
    llama = "demo" not in path.name
    if llama and machine == "8x80GB":  # the shipped Llama-3-8B recipes run on one 8x80 GB machine
        # 4 of the 7 GPUs beside the loss server: the released global batches (16, 64) are multiples of 4, not 7
        assert allocation.training.num_processes == 4 and allocation.layout.loss.gpus == ("0",)


@pytest.mark.parametrize("path", [p for p in RECIPES if "demo" not in p.name], ids=lambda p: p.stem)
def test_shipped_llama_recipes_are_feasible_on_8x80gb(path):
    allocation = allocate_hardware(load(path), parse_hardware("8x80GB"), [0, 1])
    assert not allocation.problems, allocation.problems
    assert "Meta-Llama-3-8B" in "\n".join(allocation.lines)


def test_defect2_loss_server_share_is_computed_from_the_weights():
    """Defect 2: the default ``loss_gpu_memory_utilization: 0.1`` gave the loss server 8 GiB of an 80 GiB GPU for
    ~15 GiB of Llama-3-8B weights. Now the default (null) is its weights (8.03e9 x 2 bytes) and one scoring batch of
    KV cache (8 x 2,000 tokens x 128 KiB) over the GPU's memory, taken from the policy's share; an explicit share is
    the recipe's, checked by vLLM at start-up."""
    recipe = recipe_at("train/sft_recipes/arc.yaml")
    assert recipe.loss_gpu_memory_utilization is None
    need = 8_030_261_248 * 2 + 8 * 2000 * 2 * 32 * 8 * 128 * 2
    for machine, gib, expected in (("8x80GB", 80, 0.22), ("8x141GB", 141, 0.12)):
        assert expected - 0.01 < need / (gib * GIB) <= expected  # rounded up to 2 decimals
        allocation = allocate_hardware(recipe, parse_hardware(machine), [0])
        assert allocation.layout.loss.gpu_memory_utilization == expected
        assert allocation.layout.policy[0].gpu_memory_utilization == round(0.9 - expected, 4)
        assert f"--gpu-memory-utilization {expected} = " in "\n".join(allocation.lines)
    named = allocate_hardware(recipe_at("train/sft_recipes/arc.yaml", loss_gpu_memory_utilization=0.1),
                              parse_hardware("8x80GB"))  # fmt: skip
    assert not named.problems and named.layout.loss.gpu_memory_utilization == 0.1
    small = allocate_hardware(recipe, parse_hardware("8x16GB"), [0])  # the share alone exceeds the policy's
    assert small.problems == [
        "loss server: its weights and one scoring batch of KV cache take a share of 1.06 of each 16 GiB GPU, which "
        "leaves nothing of gpu_memory_utilization=0.9 for the policy on the GPU they share: name loss_devices (GPUs "
        "outside devices), or use GPUs with more memory"
    ]


def test_defect3_tensor_parallel_is_the_gpus_of_each_placement():
    """Defect 3: ``--tensor-parallel-size`` came from the recipe for every server, so with tensor_parallel_size 2 the
    loss server on one GPU was asked to split over two. Now each server's tp is the number of its own GPUs."""
    recipe = recipe_at("train/sft_recipes/arc.yaml", tensor_parallel_size=2)
    allocation = allocate_hardware(recipe, parse_hardware("8x80GB"), [0])
    assert [p.gpus for p in allocation.layout.policy] == [("0", "1"), ("2", "3"), ("4", "5"), ("6", "7")]
    assert tp_of(build_serve_command(recipe, "/m", 8000, VENV, allocation.layout.policy[0])) == 2
    assert allocation.layout.loss.gpus == ("0",)
    assert tp_of(build_serve_command(recipe, "/m", 8001, VENV, allocation.layout.loss)) == 1
    assert not allocation.problems


def test_defect4_every_node_is_started_by_a_launcher():
    """Defect 4: only this node started (the others waited for a human), with num_processes unset the configs' 8
    was split over the nodes. Now ``train_launcher: srun`` starts every node of the Slurm allocation in one srun step
    (one task per node, each the same accelerate command with its own --machine_rank) with the allocation's process
    count."""
    private = {"api_key": "k", "private_hosts": ["n2"]}  # the other nodes' servers bind to their names
    recipe = recipe_at("train/sft_recipes/arc.yaml", train_launcher="srun", **private)
    allocation = allocate_hardware(recipe, parse_hardware("2x8x80GB"), [0])
    assert not allocation.problems
    # 4 per node: the released global batch 16 is a multiple of 8 processes, not 14 (optima.hardware)
    assert [(n.host, n.machine_rank, len(n.gpus)) for n in allocation.training.nodes] == [("", 0, 4), ("", 1, 4)]
    train_env = resolve_env(sys.executable, "train")
    launch = launch_for(recipe, "sft", train_env, Path("/run/t.yaml"), True, allocation.training)
    argv = " ".join(launch.argv())
    assert argv.startswith("srun --nodes 2 --ntasks 2 --ntasks-per-node 1 --cpus-per-task ")
    assert " --gpus-per-node 8 --overlap --kill-on-bad-exit=1 env CUDA_VISIBLE_DEVICES=1,2,3,4 bash -c " in argv
    assert '--machine_rank "$SLURM_PROCID"' in argv  # each task, its own node's rank
    assert "-m accelerate.commands.launch --config_file" in argv
    assert "--num_processes 8 --num_machines 2 --main_process_ip " in argv


@pytest.mark.parametrize(
    ("gpus", "loss_placement", "visible"), [(4, "beside", "1,2"), (4, "after", "0,1,2,3"), (2, "after", "0,1")]
)
def test_defect5_num_processes_comes_from_the_training_gpus(gpus, loss_placement, visible):
    """Defect 5: on 1-7 GPUs the shipped accelerate configs (``num_processes: 8``) still asked for 8 processes:
    nothing passed ``--num_processes``. Now it is always the allocation's training GPUs (as many of the free ones as
    keep the released global batch 16: 2 of 3 beside the loss server)."""
    recipe = recipe_at("train/sft_recipes/arc.yaml", devices=None, loss_placement=loss_placement)
    allocation = allocate_hardware(recipe, parse_hardware(f"{gpus}x141GB"), [0])
    assert not allocation.problems, allocation.problems
    launch = launch_for(recipe, "sft", VENV, Path("/t.yaml"), True, allocation.training)
    argv = launch.argv()
    assert argv[argv.index("--num_processes") + 1] == str(len(visible.split(",")))
    assert launch.env_vars()["CUDA_VISIBLE_DEVICES"] == visible


def test_defect6_training_never_shares_a_gpu_with_the_resident_loss_server():
    """Defect 6: training inherited every GPU, the loss server's included (which keeps its memory through training:
    an OOM by design), and ``loss_devices`` overlapping the policy's GPUs were accepted. Now training runs on the
    other GPUs, an overlap is refused, and one GPU with a resident loss server is refused with the fix."""
    own_batch = {"trainer_overrides": {"gradient_accumulation_steps": 2}}  # every free GPU trains (batch 14)
    allocation = allocate_hardware(recipe_at("train/sft_recipes/arc.yaml", **own_batch), parse_hardware("8x80GB"), [0])
    assert allocation.training.nodes[0].gpus == tuple("1234567")
    overlap = allocate_hardware(recipe_at("train/sft_recipes/arc.yaml", loss_devices=[3]), parse_hardware("8x80GB"))
    assert any("loss_devices [3] overlap the policy's GPUs on GPU 3" in p for p in overlap.problems)
    separate = recipe_at("train/sft_recipes/arc.yaml", devices=[0, 1, 2, 3, 4, 5, 6], loss_devices=[7], **own_batch)
    allocation = allocate_hardware(separate, parse_hardware("8x80GB"), [0])
    assert not allocation.problems and allocation.training.nodes[0].gpus == tuple("0123456")
    one = allocate_hardware(
        recipe_at("train/sft_recipes/demo_arc.yaml", accelerate_config="multi_gpu"), parse_hardware("1x80GB")
    )
    assert any("no GPU of node 0 is free" in p and "loss_placement: after" in p for p in one.problems)


@pytest.mark.parametrize(
    ("host", "extra", "refused"),
    [
        ("0.0.0.0", {}, True),
        ("0.0.0.0", {"private_hosts": ["0.0.0.0"]}, True),  # a wildcard is never private
        ("10.0.0.5", {}, True),
        ("10.0.0.5", {"private_hosts": ["10.0.0.5"]}, False),
        ("0.0.0.0", {"sleep_mode": False}, False),
        ("127.0.0.1", {}, False),
    ],
)
def test_vllm_reload_routes_never_bind_to_a_public_address(host, extra, refused):
    recipe = recipe_at("train/sft_recipes/arc.yaml", host=host, api_key="k", **extra)
    allocation = allocate_hardware(recipe, parse_hardware("8x80GB"), [0])
    assert any("reload routes" in p for p in allocation.problems) is refused


@pytest.mark.parametrize(
    ("text", "nodes", "gpus", "gib"), [("8x80GB", 1, 8, 80), ("2x8x141GB", 2, 8, 141), ("1x24gb", 1, 1, 24)]
)
def test_parse_hardware(text, nodes, gpus, gib):
    hardware = parse_hardware(text)
    assert (hardware.nodes, hardware.gpus_per_node, hardware.gpu_gib) == (nodes, gpus, gib)
    assert hardware.gpu_ids == tuple(str(i) for i in range(gpus))


@pytest.mark.parametrize("text", ["8", "80GB", "0x80GB", "8x80TB", "axbxc"])
def test_parse_hardware_refuses_anything_else(text):
    with pytest.raises(RecipeError, match="--hardware"):
        parse_hardware(text)


def test_detect_hardware_reads_nvidia_smi(tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\nif [ \"$1\" = -L ]; then printf 'GPU 0: H100 (UUID: a)\\nGPU 1: H100 (UUID: b)\\n'; "
        "else printf '81559\\n81559\\n'; fi\n"
    )
    smi.chmod(0o755)
    hardware = detect_hardware({"PATH": str(tmp_path)})
    assert (hardware.nodes, hardware.gpus_per_node, hardware.gpu_gib, hardware.source) == (1, 2, 79.6, "nvidia-smi")
    visible = detect_hardware({"PATH": str(tmp_path), "CUDA_VISIBLE_DEVICES": "1"})
    assert visible.gpu_ids == ("1",) and visible.gpu_gib == 79.6
    assert not detect_hardware({"PATH": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}).has_gpu
    slurm = detect_hardware({"PATH": str(tmp_path), "SLURM_JOB_NUM_NODES": "4"})
    assert (slurm.nodes, slurm.gpus_per_node) == (4, 2) and slurm.source == "nvidia-smi, 4 Slurm nodes"


@requires_smollm2
def test_a_local_models_size_is_read_from_its_weights_and_equals_the_table(tmp_path):
    local = memory.model_size(REPO / "models/SmolLM2-135M-Instruct")
    table = memory.model_size("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert (local.params, local.largest) == (table.params, table.largest) == (134_515_008, 49152 * 576)
    assert local.source.startswith("safetensors of") and table.source == "built-in table (SmolLM2-135M-Instruct)"
    assert memory.model_size("org/unknown-model", "./missing/folder") is None
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_text("not weights")  # a placeholder: no size, no crash
    assert memory.model_size(tmp_path) is None
    # a checkpoint not written yet stands in by its base model (the trainer YAML's)
    assert memory.model_size("./runs/x/checkpoints/iteration_0", "meta-llama/Meta-Llama-3-8B-Instruct").params > 8e9


def test_the_dry_run_estimates_model_states_with_the_libraries_estimators():
    """ZeRO-3: DeepSpeed's estimator (18 bytes per parameter over the GPUs plus 4 per parameter of the largest
    layer, no offload); DDP and FSDP: accelerate's ``estimate-memory`` (FSDP split over the processes)."""
    size = memory.model_size("meta-llama/Meta-Llama-3-8B-Instruct")
    zero3 = memory.states_estimate(size, "zero3", 4, 1, "bf16")
    per_gpu = (4 * size.largest + 18 * size.params / 4) / GIB
    assert zero3 == f"model states ~{per_gpu:.1f} GiB per GPU (DeepSpeed's ZeRO-3 estimator)"
    ddp, fsdp = memory.states_estimate(size, "ddp", 4, 1, "bf16"), memory.states_estimate(size, "fsdp", 4, 1, "bf16")
    assert ddp == f"model states ~{8 * size.params / GIB:.1f} GiB per process (accelerate estimate-memory, bfloat16)"
    assert fsdp.startswith(f"model states ~{2 * size.params / GIB:.1f} GiB per process") and "/ 4 processes" in fsdp


def test_a_loss_model_of_unknown_size_needs_its_share_named():
    recipe = recipe_at("train/sft_recipes/arc.yaml", loss_model_path="org/unknown-model")
    allocation = allocate_hardware(recipe, parse_hardware("8x80GB"), [0])
    assert allocation.problems == [
        "loss server: the size of org/unknown-model is unknown (no local weights, not a known hub name): set "
        "loss_gpu_memory_utilization, or loss_devices"
    ]
    named = recipe_at(
        "train/sft_recipes/arc.yaml", loss_model_path="org/unknown-model", loss_gpu_memory_utilization=0.3
    )
    assert not allocate_hardware(named, parse_hardware("8x80GB"), [0]).problems


def test_cpu_allocation_trains_on_the_cpu_and_checks_no_gpu():
    allocation = allocate_hardware(recipe_at("train/sft_recipes/demo_arc.yaml"), Hardware(1, 0, 0.0), [0, 1])
    assert not allocation.problems
    assert allocation.training.num_processes == 1 and allocation.training.nodes[0].gpus == ()
    assert allocation.layout.policy == (Placement(cpu_bind="0", carry_over=True),)  # kept through training


def test_dry_run_prints_the_plan_and_a_refused_run_stops_before_start(tmp_path, capsys):
    from optima.cli import run_loop_script

    argv = ["--train_config_path", "train/sft_recipes/arc.yaml", "--vllm_env", sys.executable]
    argv += ["--alignment_env", sys.executable, "--set", f"output_dir={tmp_path / 'run'}"]
    assert run_loop_script(SFTRecipe, "", [*argv, "--dry-run", "--hardware", "8x80GB"]) == 0
    out = capsys.readouterr().out
    assert "hardware: 1 node(s) x 8 GPU(s) x 80 GiB (--hardware 8x80GB)" in out and "plan: feasible" in out
    assert "--num_processes 4" in out
    assert "left to the engines: vLLM checks each server's memory at start-up" in out
    assert run_loop_script(SFTRecipe, "", [*argv, "--hardware", "8x16GB"]) == 2
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


def test_this_machine_is_planned_by_one_helper(monkeypatch):
    """``allocate_this_machine``: the given machine (``--hardware``), else the detected one, with this process's
    cores."""
    import optima.hardware.allocation as allocation_module
    from optima.hardware.allocation import allocate_this_machine

    recipe = recipe_at("train/sft_recipes/arc.yaml")
    seen = []
    monkeypatch.setattr(
        allocation_module, "allocate_hardware", lambda recipe, hardware, cpus, training: seen.append((hardware, cpus))
    )
    monkeypatch.setattr(allocation_module, "detect_hardware", lambda: "detected")
    given = parse_hardware("1x80")
    allocate_this_machine(recipe, given)
    allocate_this_machine(recipe)
    cores = sorted(os.sched_getaffinity(0))
    assert seen == [(given, cores), ("detected", cores)]
