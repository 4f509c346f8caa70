"""LM-loss scoring throughput: our scorer (vLLM and HF backends) vs the original's per-conversation HF forward.

    .venvs/train/bin/python -m bench.scoring                          # demo utterances, 2 interleaved rounds
    .venvs/train/bin/python -m bench.scoring --rounds 1 --conversations 48

The texts are every utterance of the demo run's ``generations.jsonl`` (rendered ``Name: text``, as the score stage
renders them). Each method scores all of them, interleaved round by round (vllm, vllm_prefill, hf, original,
vllm, ...) so that load from other jobs on the box hits each alike:

* ``vllm``: ``optima.lm_loss.VLLMLossScorer`` (the pipeline default) against a server of the model that this
  script starts with ``optima.serving.serve``, with the pipeline's settings (32 texts per request, 16 requests
  in flight);
* ``hf``: ``optima.lm_loss.HFLossScorer`` (batches of 8, length-sorted);
* ``original``: the original's computation: one conversation at a time, all its utterances as one right-padded batch,
  each rendered as a lone assistant chat message, fp32 logits, mean NLL over the content tokens and the end-of-turn
  token (a fixed header length is skipped, as the original skipped Llama-3's 5 header tokens);
* ``vllm_prefill`` (a reference, not a scorer): the ``vllm`` requests with ``max_tokens: 1`` and no
  log-probabilities, i.e. the server's forward pass alone: how fast any vLLM-based scorer could be here.

``hf`` and ``original`` run in this process with ``--torch-threads`` (default 1: the vLLM CPU engine computes on
one core and keeps the other for its scheduler, so each side gets one core's compute).

Prints utterances/s and tokens/s (tokens of the rendered texts, template included) of each, over all rounds and in
its best round, the speedup of ``vllm`` over ``original`` (target >= 3x; best round of each, with the per-round
ratios beside it: load on a shared box comes in bursts shorter than a round and only ever adds time), and the
largest difference between the losses of any two scorers.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

from bench.benchlib import REPO, TreeMemorySampler, add_model_args, load_average, self_maxrss_mib
from optima.agents.prompts import Utterance, render_utterance
from optima.lm_loss import build_loss_input
from optima.training import SENTINEL

METHODS = ("vllm", "vllm_prefill", "hf", "original")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser, data_dir=False)
    parser.add_argument(
        "--generations", default=str(REPO / "runs" / "demo_arc_sft" / "iteration_1" / "generations.jsonl")
    )
    parser.add_argument("--conversations", type=int, default=None, help="first N conversations (default: all)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--vllm-batch-size", type=int, default=32, help="texts per request (pipeline: 4 x 8)")
    parser.add_argument("--threads", type=int, default=32, help="recipe thread_count (requests in flight: <= 16)")
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument(
        "--torch-threads", type=int, default=1, help="for hf and original (the vLLM CPU engine computes on 1 core)"
    )
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--json", default=None, help="also write the results here (used by bench/run_all.py)")
    return parser.parse_args(argv)


def load_conversations(path: Path, limit: int | None) -> list[list[str]]:
    """The rendered utterances (``Name: text``) of each conversation, as the score stage renders them."""
    conversations = []
    for line in path.read_text().splitlines()[:limit]:
        record = json.loads(line)
        texts = [render_utterance(Utterance(u["speaker"], u["text"])) for u in record["utterances"]]
        if texts:
            conversations.append(texts)
    return conversations


class OriginalScorer:
    """The original's computation: one padded batch per conversation, fixed header skipped, mean NLL to end of turn.

    Args:
        model: A causal LM in eval mode (fp32).
        tokenizer: Its tokenizer (pad = eos, right padding).
    """

    def __init__(self, model, tokenizer):
        import torch

        self.torch, self.model, self.tokenizer = torch, model, tokenizer
        rendered = tokenizer.apply_chat_template([{"role": "assistant", "content": SENTINEL}], tokenize=False)
        header = rendered[: rendered.find(SENTINEL)]
        # The original skipped Llama-3's 5 header tokens; here the template's header (default system turn too).
        self.head = len(tokenizer(header, add_special_tokens=False)["input_ids"])
        self.eos_id = tokenizer.eos_token_id

    def score_conversation(self, texts: list[str]) -> list[float]:
        torch = self.torch
        rendered = [
            self.tokenizer.apply_chat_template([{"role": "assistant", "content": t}], tokenize=False) for t in texts
        ]
        batch = self.tokenizer(rendered, add_special_tokens=False, padding=True, return_tensors="pt")
        ids, mask = batch["input_ids"], batch["attention_mask"]
        with torch.no_grad():
            logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
        shifted = logits[:, self.head - 1 : -1]
        nll = torch.nn.functional.cross_entropy(
            shifted.reshape(-1, shifted.shape[-1]), ids[:, self.head :].reshape(-1), reduction="none"
        ).view(ids.shape[0], -1)
        # Score up to and including the first end-of-turn token after the header (not the template's newline).
        positions = torch.arange(self.head, ids.shape[1])
        is_eot = (ids[:, self.head :] == self.eos_id) & (mask[:, self.head :] == 1)
        first_eot = torch.where(is_eot.any(1), is_eot.float().argmax(1) + self.head, ids.shape[1] - 1)
        keep = (positions[None, :] <= first_eot[:, None]) & (mask[:, self.head :] == 1)
        return ((nll * keep).sum(1) / keep.sum(1).clamp(min=1)).tolist()

    def score(self, conversations: list[list[str]]) -> list[float]:
        return [loss for texts in conversations for loss in self.score_conversation(texts)]


class PrefillCeiling:
    """Not a scorer: the vLLM scorer's requests with ``max_tokens: 1`` and no log-probabilities.

    Its time is vLLM's forward pass over the same token ids alone, the floor under any scorer on this server.

    Args:
        scorer: The ``VLLMLossScorer`` whose clients, batch size and workers are reused.
    """

    def __init__(self, scorer):
        self.scorer = scorer

    def _send(self, batch: list) -> None:
        scorer = self.scorer
        scorer.clients[0].completions.create(
            model=scorer.model, prompt=[x.input_ids for x in batch], max_tokens=1, temperature=0.0
        )

    def score(self, texts: list[str]) -> list[float]:
        from concurrent.futures import ThreadPoolExecutor

        inputs = [build_loss_input(self.scorer.tokenizer, t) for t in texts]
        size = self.scorer.batch_size
        with ThreadPoolExecutor(self.scorer.workers) as pool:
            list(pool.map(self._send, [inputs[i : i + size] for i in range(0, len(inputs), size)]))
        return [math.nan] * len(texts)


def time_call(fn, *args) -> tuple[float, list[float]]:
    started = time.monotonic()
    result = fn(*args)
    return time.monotonic() - started, result


def max_abs_diff(a: list[float], b: list[float]) -> tuple[float, int]:
    """Largest |a - b| over pairs where both are finite, and how many pairs were skipped."""
    pairs = [(x, y) for x, y in zip(a, b, strict=True) if math.isfinite(x) and math.isfinite(y)]
    return max((abs(x - y) for x, y in pairs), default=math.nan), len(a) - len(pairs)


def run_rounds(scorers: dict, conversations: list[list[str]], rounds: int) -> tuple[dict, dict]:
    """Interleave the methods ``rounds`` times; return seconds per method per round and the last losses."""
    texts = [t for c in conversations for t in c]
    seconds = {m: [] for m in METHODS}
    losses = {}
    for round_index in range(rounds):
        for method in METHODS:
            arg = conversations if method == "original" else texts
            elapsed, losses[method] = time_call(scorers[method], arg)
            seconds[method].append(elapsed)
            print(f"round {round_index + 1} | {method:12s} | {elapsed:6.1f} s | load {load_average()}", flush=True)
    return seconds, losses


def build_scorers(args, recipe, urls: list[str], tokenizer) -> dict:
    import torch

    from optima.lm_loss import HFLossScorer, VLLMLossScorer

    # Same compute for all: vLLM's CPU engine binds one OpenMP thread (the other core runs its scheduler), and
    # on a shared box extra torch threads mostly wait on each other (docs/cpu.md#threads-under-load).
    torch.set_num_threads(args.torch_threads)

    hf = HFLossScorer(args.model, tokenizer, args.hf_batch_size)
    vllm = VLLMLossScorer(urls, recipe.served_model_name, tokenizer, recipe, args.vllm_batch_size)
    original = OriginalScorer(hf.model, tokenizer)
    return {"vllm": vllm.score, "vllm_prefill": PrefillCeiling(vllm).score, "hf": hf.score, "original": original.score}


def speedups(seconds: dict, method: str) -> list[float]:
    """Per round: seconds of ``original`` over seconds of ``method``."""
    return [o / m for m, o in zip(seconds[method], seconds["original"], strict=True)]


def best_speedup(seconds: dict, method: str) -> float:
    """Best round of ``original`` over best round of ``method``."""
    return min(seconds["original"]) / min(seconds[method])


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def summarize(args, conversations, tokens: int, seconds: dict, losses: dict, extra: dict) -> dict:
    n = sum(len(c) for c in conversations)
    rows = {}
    for method in METHODS:
        total = sum(seconds[method])
        rows[method] = {
            "seconds_per_round": [round(s, 2) for s in seconds[method]],
            "utterances_per_s": round(n * args.rounds / total, 2),
            "tokens_per_s": round(tokens * args.rounds / total, 1),
            "best_utterances_per_s": round(n / min(seconds[method]), 2),
            "best_tokens_per_s": round(tokens / min(seconds[method]), 1),
        }
    diffs = {
        f"{a} vs {b}": max_abs_diff(losses[a], losses[b])
        for a, b in [("vllm", "hf"), ("vllm", "original"), ("hf", "original")]
    }
    per_round = speedups(seconds, "vllm")
    return {
        "conversations": len(conversations),
        "utterances": n,
        "tokens": tokens,
        "rounds": args.rounds,
        "methods": rows,
        # Headline: best round of each method (load from other jobs only adds time; it comes in bursts shorter
        # than a round), with the per-round ratios, their geometric mean and the ratio of totals beside it.
        "speedup_vllm_vs_original": round(best_speedup(seconds, "vllm"), 3),
        "speedup_vllm_vs_original_per_round": [round(r, 3) for r in per_round],
        "speedup_vllm_vs_original_geomean_rounds": round(geometric_mean(per_round), 3),
        "speedup_vllm_vs_original_of_totals": round(sum(seconds["original"]) / sum(seconds["vllm"]), 3),
        "speedup_hf_vs_original": round(best_speedup(seconds, "hf"), 3),
        "speedup_prefill_ceiling_vs_original": round(best_speedup(seconds, "vllm_prefill"), 3),
        "max_abs_diff": {k: {"max": round(v[0], 6), "skipped": v[1]} for k, v in diffs.items()},
    } | extra


def print_summary(result: dict) -> None:
    print(f"{result['utterances']} utterances of {result['conversations']} conversations, {result['tokens']} tokens")
    for method, row in result["methods"].items():
        print(
            f"{method:12s} {row['utterances_per_s']:8.1f} utterances/s {row['tokens_per_s']:9.1f} tokens/s "
            f"(best round {row['best_utterances_per_s']:.1f} utterances/s, {row['best_tokens_per_s']:.1f} tokens/s)"
        )
    print(
        f"speedup vllm / original: {result['speedup_vllm_vs_original']:.2f}x (best rounds; rounds "
        f"{result['speedup_vllm_vs_original_per_round']}, geometric mean "
        f"{result['speedup_vllm_vs_original_geomean_rounds']:.2f}x, of totals "
        f"{result['speedup_vllm_vs_original_of_totals']:.2f}x; target >= 3x)"
    )
    print(f"speedup hf / original: {result['speedup_hf_vs_original']:.2f}x")
    print(
        f"ceiling, vLLM prefill alone (no log-probabilities) / original: "
        f"{result['speedup_prefill_ceiling_vs_original']:.2f}x"
    )
    for pair, diff in result["max_abs_diff"].items():
        print(f"max |loss difference| {pair}: {diff['max']:.2e} ({diff['skipped']} non-finite skipped)")
    print(f"server start {result['server_start_s']:.1f} s | peak memory: {result['memory']}")


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from optima.config import InferenceRecipe, load_recipe
    from optima.environments import resolve_env
    from optima.logging_utils import setup_logging
    from optima.paths import RunPaths
    from optima.serving.vllm_server import serve

    setup_logging()
    conversations = load_conversations(Path(args.generations), args.conversations)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokens = sum(len(build_loss_input(tokenizer, t).input_ids) for c in conversations for t in c)
    overrides = {"dataset_type": "arc", "initial_model_path": args.model, "model_root_path": args.model}
    overrides |= {"port": args.port, "thread_count": args.threads, "request_timeout_s": 600.0}
    recipe = load_recipe(InferenceRecipe, None, overrides | {"output_dir": tempfile.mkdtemp(prefix="optima_bench_")})
    stage = RunPaths(Path(recipe.output_dir)).stage(0)  # an evaluation recipe has no checkpoint root
    started = time.monotonic()
    with TreeMemorySampler() as server_memory, serve(recipe, args.model, resolve_env(None, "vllm"), stage) as urls:
        server_start_s = time.monotonic() - started
        scorers = build_scorers(args, recipe, urls, tokenizer)
        for method in METHODS:  # warm-up: first requests and first forward passes are slower
            scorers[method](conversations[:1] if method == "original" else conversations[0])
        seconds, losses = run_rounds(scorers, conversations, args.rounds)
    memory = {
        "vLLM server tree, sampled sum of VmRSS": round(server_memory.peak_mib),
        "benchmark process (HF model, both HF methods), ru_maxrss": round(self_maxrss_mib()),
    }
    extra = {"server_start_s": server_start_s, "memory": memory, "torch_threads": args.torch_threads}
    result = summarize(args, conversations, tokens, seconds, losses, extra)
    print_summary(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
