"""One rank of a really sharded training on CPU processes (gloo), saved through Optima's own save path.

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
        python -m tests.sharded_save_driver --strategy fsdp2 --model M --out O
    ... DS_ACCELERATOR=cuda LOCAL_RANK=0 python -m tests.sharded_save_driver --strategy zero3 --device cuda ...

accelerate 1.15 builds FSDP and DeepSpeed only for accelerator devices, so on CPU ranks it would train the model
whole on every process. This driver shards for real, without accelerate's process count: ``fsdp2`` wraps every
decoder layer and then the model with ``torch.distributed.fsdp.fully_shard``; ``zero3`` sets the HF DeepSpeed
config first (as accelerate does, so transformers builds the model inside ``deepspeed.zero.Init``) and trains
through ``deepspeed.initialize`` with DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``). Both train
``STEPS`` steps, rank r on its own batches (``batches``, moved to ``--device``), once fully and once with LoRA,
each time calling ``optima.training.common.save_checkpoint`` with a trainer whose accelerator is accelerate's own
``Accelerator.get_state_dict`` on the sharded model: the save, the rank-0 check of the files and the LoRA merge
are the trainer scripts' code.

``--device cuda`` (``make gpu-check``'s ``zero3-2proc``): ZeRO-3 with DeepSpeed's CUDA accelerator, still over gloo,
so that two ranks may share one GPU (``LOCAL_RANK=0`` for both; NCCL refuses two ranks on one device: "Duplicate GPU
detected"); gloo runs its collectives on CUDA tensors through host copies.

``train_reference`` trains the same model unsharded in one process on both ranks' batches at once: equal token
counts per rank make the mean of the ranks' losses equal that batch's loss, so the weights must agree.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from types import SimpleNamespace

STEPS = 2
VARIANTS = ("full", "lora")  # full fine-tuning, then a LoRA adapter (gathered and merged on rank 0)
TIMEOUT_S = 60  # of every collective: a rank left alone in one fails the run instead of hanging it
ROWS, LENGTH = 2, 12
LEARNING_RATE = 1.0e-2
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}
ZERO3 = {
    "train_micro_batch_size_per_gpu": ROWS,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
    "bf16": {"enabled": False},
    "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 unless told; the reference does not clip
}


def batches(rank: int, vocab: int) -> list:
    """Rank ``rank``'s token ids for each step (fixed, distinct per rank, no padding)."""
    import torch

    generator = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(4, vocab, (ROWS, LENGTH), generator=generator) for _ in range(STEPS)]


def with_lora(model):
    """``model`` with a LoRA adapter, initialised the same way in every process and in the reference."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)  # test driver: the adapter's random init must not depend on what ran before
    return get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **LORA))


def train_reference(model_path: str, world_size: int, lora: bool):
    """The same training, unsharded, in this process; returns the model (LoRA merged)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = with_lora(model) if lora else model
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)
    steps = zip(*(batches(rank, model.config.vocab_size) for rank in range(world_size)), strict=True)
    for per_rank in steps:
        ids = torch.cat(per_rank)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.merge_and_unload() if lora else model


class DriverAccelerator:
    """The part of ``accelerate.Accelerator`` that ``save_checkpoint`` uses, with accelerate's own gather code."""

    def __init__(self, strategy: str):
        import torch.distributed as dist
        from accelerate.utils import DistributedType

        self.strategy, self.dist = strategy, dist
        self.is_main_process = dist.get_rank() == 0
        self.distributed_type = DistributedType.DEEPSPEED if strategy == "zero3" else DistributedType.FSDP
        self.is_fsdp2, self.deepspeed_config = strategy == "fsdp2", ZERO3

    def get_state_dict(self, model):
        from accelerate import Accelerator

        return Accelerator.get_state_dict(self, model)

    def unwrap_model(self, model):
        from accelerate.utils import extract_model_from_parallel

        return extract_model_from_parallel(model)

    def wait_for_everyone(self):
        self.dist.barrier()


def build_sharded(strategy: str, model_path: str, lora: bool):
    """(module, wrapped model, optimizer) sharded over the process group."""
    import torch
    from transformers import AutoModelForCausalLM

    if strategy == "zero3":
        import deepspeed
        from transformers.integrations import HfDeepSpeedConfig

        keep = HfDeepSpeedConfig(ZERO3)  # what accelerate sets: from here on transformers builds in zero.Init
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        model = with_lora(model) if lora else model
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ZERO3)
        engine.hf_config = keep  # transformers holds it by weak reference only: keep it alive with the engine
        return model, engine, None
    from torch.distributed.fsdp import fully_shard

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = with_lora(model) if lora else model
    for layer in model.get_decoder().layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)
    return model, model, optimizer


def train_and_save(strategy: str, model_path: str, out: str, lora: bool, device: str = "cpu") -> None:
    """Shard, train ``STEPS`` steps on this rank's batches, save through ``save_checkpoint`` (all ranks call it)."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from optima.training.common import save_checkpoint

    rank = dist.get_rank()
    module, wrapped, optimizer = build_sharded(strategy, model_path, lora)
    for ids in batches(rank, module.config.vocab_size):
        ids = ids.to(device)
        loss = wrapped(input_ids=ids, labels=ids).loss
        if strategy == "zero3":
            wrapped.backward(loss)
            wrapped.step()
        else:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    local = next(p for p in module.parameters() if p.dim() == 2)
    # ZeRO-3 keeps an empty placeholder in the module, FSDP2 a DTensor with the local shard: nothing here is whole.
    sharded = getattr(local, "ds_numel", None) is not None or type(local).__name__ == "DTensor"
    trainer = SimpleNamespace(model=module, model_wrapped=wrapped, accelerator=DriverAccelerator(strategy))
    save_checkpoint(trainer, AutoTokenizer.from_pretrained(model_path), out, {"sharded": sharded, "rank": rank})


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["fsdp2", "zero3"], required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True, help="checkpoints go to OUT/full and OUT/lora")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: ZeRO-3 on LOCAL_RANK's GPU")
    args = parser.parse_args()
    if args.device == "cuda" and args.strategy != "zero3":
        parser.error("--device cuda is for --strategy zero3 (FSDP2 here shards CPU tensors)")
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    import torch.distributed as dist

    if args.strategy == "zero3":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=TIMEOUT_S))
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    for variant in VARIANTS:  # one process group for both: the imports are most of the time
        out = os.path.join(args.out, variant)
        train_and_save(args.strategy, args.model, out, lora=variant == "lora", device=args.device)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Every collective is done and the files are written. DeepSpeed's CPU communication threads can then abort
    # the interpreter's teardown now and then (SIGABRT, "terminate called without an active exception": seen once
    # in about six runs), which would read as a failed rank; leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
