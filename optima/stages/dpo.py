"""The four stages of a DPO iteration (docs/method.md#idpo, #isft-dpo): probe, search, pairs, train.

* probe: ``probe_count`` training questions, one conversation each at the current temperature, no pool; their
  token counts give ``T_max`` = the ``token_quantile`` (P85 in iDPO, P80 in iSFT-DPO) used by every rollout reward.
* search: one tree per question (``optima.selection.mcts``), many questions at once, each question's turns on one
  replica; each finished tree is one line of ``rollouts.jsonl``, so a killed search resumes at the next question.
* pairs: preference pairs mined from the trees (``optima.selection.dpo``), saved as a ``datasets`` folder.
* train: TRL DPO (+ NLL on chosen when ``rpo_alpha`` is set) under accelerate.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import TYPE_CHECKING

from optima.agents.conversation import GenerationSettings, TokenCounter
from optima.agents.generation import generate_conversations
from optima.config.rules import train_start, workers
from optima.methods import DPO
from optima.paths import StagePaths
from optima.reward import build_rollout_scorer, counted_tokens, has_answer, is_cut, search_t_max
from optima.run_context import RunContext
from optima.selection.dpo import save_pairs
from optima.selection.mcts import reply_from_chat, search_question
from optima.serving import ReplicaPool, RequestFailed, Sampling
from optima.stages import common
from optima.stages.common import StageCall
from optima.stages.reward_stage import mean_parts
from optima.store import JsonlWriter, load_records, prepare_resume
from optima.tasks.sampling import stable_rng

if TYPE_CHECKING:
    from optima.config import DPOLoopRecipe, Recipe

logger = logging.getLogger(__name__)

# The name that seeds the search stage's sampling and tree walks. It is data, not a label: renaming it would draw
# other rollouts for every recipe, so it keeps the algorithm's name while the stage is called "search".
SEARCH_SEED_STREAM = "mcts"


def probe(call: StageCall) -> dict:
    """Sample ``probe_count`` conversations and take the token quantile as ``T_max`` (docs/method.md#idpo)."""
    ctx, recipe, sp = call.ctx, call.ctx.recipe, call.sp
    examples = common.training_questions(ctx, call.iteration, "probe", recipe.probe_count)
    endpoints = ctx.servers.serve(call.model, sp)
    generation = GenerationSettings(call.iteration, recipe.temperature, 1, use_prompt_pool=False, stage="probe")
    stats = generate_conversations(recipe, examples, endpoints, sp.probe, generation)
    records = load_records(sp.probe)[0]
    counts = counted_tokens(records)
    if not counts:
        raise RuntimeError(f"the token probe produced no finished conversation ({sp.probe}); see the server logs")
    t_max = search_t_max(records, recipe.token_quantile)
    logger.info(
        "probe | %d conversations | T_max = P%d = %d tokens", len(counts), round(100 * recipe.token_quantile), t_max
    )
    return {"conversations": len(counts), "t_max": t_max} | stats.to_dict()


class CachedLoss:
    """Per-utterance LM losses, each text scored once (rollouts share most of their utterances)."""

    def __init__(self, score_texts: Callable[[Sequence[str]], list[float]]):
        self.score_texts, self.cache, self.lock = score_texts, {}, threading.Lock()

    def __call__(self, texts: Sequence[str]) -> list[float]:
        with self.lock:
            missing = [t for t in dict.fromkeys(texts) if t not in self.cache]
        if missing:
            # Outside the lock: the trees score their rollouts concurrently (a text scored twice gets one value).
            scored = dict(zip(missing, self.score_texts(missing), strict=True))
            with self.lock:
                self.cache.update(scored)
        with self.lock:
            return [self.cache[t] for t in texts]


@contextlib.contextmanager
def search_loss(ctx: RunContext, sp: StagePaths) -> Iterator[CachedLoss | None]:
    """LM loss during the search (the policy stays served), each utterance scored once.

    With the vLLM backend on a served loss model (``ServerHolder.serve_loss_for_search``: the run's loss server, the
    policy when it serves the loss model, or with ``loss_placement: after`` on a GPU a loss server that runs for the
    block only); else as ``loss_scorer`` says (transformers in the driver: ``loss_backend: hf``, or on a CPU).
    """
    recipe = ctx.recipe
    if recipe.cal_ppl and recipe.loss_backend == "vllm":
        with ctx.servers.serve_loss_for_search() as urls:
            if urls is not None:
                yield CachedLoss(common.built_on_first_use(lambda: common.served_loss_scorer(ctx, urls())))
                return
    scorer = common.loss_scorer(ctx, sp, keep_served=True)
    yield CachedLoss(scorer) if scorer is not None else None


def search(call: StageCall) -> dict:
    """Tree search over ``monte_sample_count`` questions, ``thread_count`` trees at a time.

    See docs/method.md#tree-search. ``T_max`` is the probe's (``call.results["probe"]["t_max"]``): the one every
    rollout reward uses.
    """
    ctx, recipe, sp, iteration = call.ctx, call.ctx.recipe, call.sp, call.iteration
    t_max = call.results["probe"]["t_max"]
    examples = common.training_questions(ctx, iteration, "search", recipe.monte_sample_count)
    urls = ctx.servers.serve(call.model, sp)
    done = {task_id for task_id, _ in prepare_resume(sp.rollouts)}
    todo = [(q, ex) for q, ex in enumerate(examples) if (ex.id, 0) not in done]
    logger.info(
        "search | %d questions (%d done) | T_max %d | %d endpoints", len(examples), len(done), t_max, len(urls)
    )
    pool = ReplicaPool(urls, recipe)
    tokenize = ctx.tokenizer().tokenize if recipe.compat == "original" else None
    count_tokens = TokenCounter(recipe)  # generation's fallback when a server sends no usage
    with contextlib.ExitStack() as stack:
        verifier = stack.enter_context(common.math_verifier(ctx))
        stack.callback(pool.close)
        writer = stack.enter_context(JsonlWriter(sp.rollouts))
        # Last in, first out: a loss server started for the search stops as soon as the trees are done.
        score_texts = stack.enter_context(search_loss(ctx, sp)) if todo else None

        def run(position: int, example) -> dict:
            replica, calls = pool.route(position), 0

            def chat(messages, speaker):
                # Each request of a tree gets its own seed (its n-th call): rollouts differ, reruns repeat.
                nonlocal replica, calls
                calls += 1
                seed = stable_rng(recipe.seed, SEARCH_SEED_STREAM, iteration, example.id, calls).randrange(2**31)
                reply = pool.chat(replica, messages, Sampling(recipe.temperature, recipe.max_tokens, seed))
                replica = reply.replica
                return reply

            generate = reply_from_chat(chat, recipe.max_tokens, (RequestFailed,), count_tokens)
            score = build_rollout_scorer(example, recipe, t_max, score_texts, tokenize, verifier)
            rng = random.Random(f"{recipe.seed}:{SEARCH_SEED_STREAM}:{iteration}:{example.id}")
            # Keyed like generation records so the JSONL store resumes it (one line per question).
            return search_question(example, generate, score, recipe, rng).to_dict() | {"sample_index": 0}

        _run_trees(recipe, todo, run, writer)
    return search_stats(load_records(sp.rollouts)[0], t_max) | common.verifier_stats(verifier)


def search_stats(lines: list[dict], t_max: int) -> dict:
    """The search stage's result: sizes, and the rates and reward parts of the rollouts that were scored.

    A rollout whose request failed for good (``status: error``, left out of its tree's values) counts in
    ``failed_rollouts``, not in the rates; ``failed_requests`` counts every failed request, retried ones included.
    """
    rollouts = [r for line in lines for r in line["rollouts"]]
    scored_rollouts = [r for r in rollouts if r["status"] != "error"]
    scored = [r["reward_parts"] for r in scored_rollouts if r.get("reward_parts")]
    parts_sum = Counter()
    for parts in scored:
        parts_sum.update(parts)  # update keeps negative terms (Counter addition would drop them)
    n = max(len(scored_rollouts), 1)
    return {
        "questions": len(lines),
        "rollouts": len(rollouts),
        "failed_rollouts": len(rollouts) - len(scored_rollouts),
        "failed_requests": sum(r.get("failed_requests", 0) for r in rollouts),
        "t_max": t_max,
        "answer_rate": round(sum(has_answer(r) for r in scored_rollouts) / n, 4),
        "mean_tokens": round(sum(r["token_count"] for r in scored_rollouts) / n, 2),
        "cut_rate": round(sum(is_cut(r) for r in scored_rollouts) / n, 4),
        "accuracy": round(sum(p["task_score"] for p in scored) / max(len(scored), 1), 4),
        "mean_reward_parts": mean_parts(parts_sum, len(scored)),
    }


def _run_trees(recipe: Recipe, todo, run, writer) -> None:
    from tqdm.auto import tqdm

    with ThreadPoolExecutor(max_workers=workers(recipe, len(todo))) as executor:
        futures = [executor.submit(run, position, example) for position, example in todo]
        with tqdm(total=len(futures), unit="question", desc="search") as bar:
            for future in as_completed(futures):
                writer.write(future.result())
                bar.update()


def pairs(call: StageCall) -> dict:
    """Mine preference pairs from the trees and save them (docs/method.md#mining-pairs)."""
    lines, _ = load_records(call.sp.rollouts)
    return save_pairs(lines, call.ctx.recipe, call.sp.dataset, call.sp.selection_record, call.iteration)


def nothing_kept(recipe: DPOLoopRecipe, mined: dict) -> str | None:
    """Why no pair is left to train on, or None when some are."""
    return None if mined["pairs_kept"] else f"no preference pair passed the thresholds ({mined})"


def train(call: StageCall) -> dict:
    """DPO (+ NLL on chosen when ``rpo_alpha`` is set); the reference model is the start model too."""
    from optima.training.dpo_train import validate_lengths

    def check(config: dict) -> None:
        validate_lengths(config.get("max_length"), config.get("max_prompt_length"))

    start = train_start(call.ctx.recipe, call.model, call.part)
    return common.train_checkpoint(call, DPO, start, {"rpo_alpha": call.ctx.recipe.rpo_alpha}, check)
