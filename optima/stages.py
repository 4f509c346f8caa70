"""The stage bodies of the loop (``optima.loop``): each takes its part and its settings (``optima.run``) and
returns the JSON-able result its manifest records; each resumes what a killed run left (JSONL keyed by question and
sample, a finished checkpoint reused). docs/method.md#isft, #idpo.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from optima.agents.conversation import TokenCounter
from optima.agents.generation import GenerationHooks, generate_conversations
from optima.agents.prompts import Utterance
from optima.config import LoopRecipe
from optima.config.rules import workers
from optima.evaluation.metrics import TIMEOUTS
from optima.lm_loss import StreamingLosses, conversation_texts, load_known_losses, needs_losses, to_json_losses
from optima.methods import DPO, SFT
from optima.reward import (
    Conversation,
    build_rollout_scorer,
    counted_tokens,
    flexible_answer,
    has_answer,
    is_cut,
    placeholder_copies,
    question_t_max,
    score_conversation,
    scored_answer,
    search_t_max,
)
from optima.run import CachedLoss, Part, Run, ScoreTexts, Settings, loss_scorer
from optima.selection.dpo import save_pairs
from optima.selection.mcts import reply_from_chat, search_question
from optima.selection.sft import KEPT, select_questions, split_rows
from optima.serving.client import ReplicaPool, RequestFailed, Sampling
from optima.store import JsonlWriter, group_by_question, load_records, prepare_resume, save_splits, write_jsonl
from optima.tasks import Example
from optima.tasks import select_questions as slice_questions
from optima.tasks.sampling import stable_rng
from optima.tasks.scoring import reparsed, score_example
from optima.tracking import trainer_env
from optima.training.checkpoint import clear_partial_output
from optima.training.common import is_complete, read_completion
from optima.training.launch import console_stream, run_training
from optima.training.launch_config import write_trainer_config

logger = logging.getLogger(__name__)

KnownLosses = Callable[[dict], list[float] | None]
QUESTIONS_PER_CHUNK = 32
# The name that seeds the search stage's sampling and tree walks. It is data, not a label: renaming it would draw
# other rollouts for every recipe, so it keeps the algorithm's name while the stage is called "search".
SEARCH_SEED_STREAM = "mcts"


def training_questions(run: Run, iteration: int, stage: str, count: int):
    """This iteration's slice of the training split, from (seed, iteration, stage): docs/method.md#question-slices."""
    recipe = run.recipe
    examples = run.task.load_train(data_dir=recipe.data_dir, seed=recipe.seed)
    return slice_questions(examples, count, recipe.seed, iteration, stage)


def generate(part: Part, s: Settings) -> dict:
    """Serve the part's model, sample ``explore_count`` conversations for each of ``sample_count`` questions, each
    one's LM loss scored as it is written on the loss server (when the route says so)."""
    run, sp = part.run, part.sp
    examples = training_questions(run, part.iteration, SFT, part.recipe.sample_count)
    endpoints = run.servers.serve(part.model, sp)
    with contextlib.ExitStack() as stack:
        scorer = stack.enter_context(loss_scorer(run, s.loss, sp))
        stream = stack.enter_context(StreamingLosses(scorer, sp.losses, s.loss.model)) if scorer else None
        hooks = GenerationHooks(on_record=stream.submit if stream else None)
        stats = generate_conversations(part.recipe, examples, endpoints, sp.generations, s.generation, hooks)
        streamed = {"loss_stream": stream.finish()} if stream else {}
    return {"questions": len(examples)} | stats.to_dict() | streamed


def score(part: Part, s: Settings) -> dict:
    """Task score, token term and LM-loss term of every conversation (docs/method.md#reward); LM losses scored
    while generating are used as they are, the rest are scored now."""
    run, sp = part.run, part.sp
    tokenize = run.tokenizer.tokenize if run.recipe.compat == "original" else None
    with loss_scorer(run, s.loss, sp) as scorer, run.math_verifier() as verifier:
        known = load_known_losses(sp.losses, s.loss.model)
        scorers = RewardScorers(score_texts=scorer, known=known, tokenize=tokenize, verifier=verifier)
        stats = reward_generations(run.recipe, sp.generations, sp.rewarded, scorers)
    return stats | verifier_stats(verifier)


def select(part: Part, s: Settings) -> dict:
    """Keep the best conversations (docs/method.md#isft-selection) and save them as per-agent SFT rows."""
    recipe, sp = part.recipe, part.sp
    lines, _ = load_records(sp.rewarded)
    decisions = select_questions(lines, recipe)
    write_jsonl((d.to_record() for d in decisions), sp.selection_record)
    kept = [d.best for d in decisions if d.reason == KEPT]
    splits = split_rows(kept, recipe.sft_train_fraction, recipe.seed, part.iteration, recipe.compat) if kept else {}
    rows = save_splits(splits, sp.dataset) if kept else {}
    top = max((d.best for d in decisions if d.best is not None), key=lambda r: r["reward"], default=None)
    return {
        "questions": len(decisions),
        "conversations": sum(len(line["results"]) for line in lines),
        "kept_conversations": len(kept),
        "rows": rows,
        "reasons": dict(Counter(d.reason for d in decisions)),
        "epsilon": recipe.initial_epsilon,
        "best_reward": top["reward"] if top else None,
        "best_reward_parts": top["reward_parts"] if top else None,
    }


def nothing_selected(selected: dict) -> str:
    """Why selection left nothing to train on, in one sentence."""
    return (
        f"no conversation passed selection: {selected['questions']} questions, {selected['conversations']} "
        f"conversations, best reward {selected['best_reward']} (parts {selected['best_reward_parts']}) "
        f"vs epsilon {selected['epsilon']}; decisions {selected['reasons']}"
    )


def train(part: Part, s: Settings) -> dict:
    """Fine-tune into the part's checkpoint with TRL under accelerate (docs/method.md#training): a finished one is
    reused, a killed run's cleared but for its ``checkpoint-N`` states; the servers give their resources back first."""
    run, sp, job = part.run, part.sp, s.train
    if is_complete(part.out):
        return read_completion(part.out)
    clear_partial_output(part.out)
    config = job.config()
    if part.trainer == DPO:
        from optima.training.dpo_train import validate_lengths

        validate_lengths(config.get("max_length"), config.get("max_prompt_length"))
    run.servers.release_for_training(trainer=True)
    write_trainer_config(config, sp.trainer_yaml)
    label = f"train iteration {part.iteration + 1}" + (f" {part.name}" if part.name else "")
    env = trainer_env(run.report_to, run.paths.output_dir, sp.root)
    run_training(job.launch, sp.train_log, env, console_stream(run.progress), label)
    return read_completion(part.out) | {"model": job.start}


def probe(part: Part, s: Settings) -> dict:
    """Sample ``probe_count`` conversations and take the token quantile as ``T_max`` (docs/method.md#idpo)."""
    run, sp = part.run, part.sp
    quantile = part.recipe.token_quantile
    examples = training_questions(run, part.iteration, "probe", part.recipe.probe_count)
    endpoints = run.servers.serve(part.model, sp)
    stats = generate_conversations(part.recipe, examples, endpoints, sp.probe, s.generation)
    records = load_records(sp.probe)[0]
    counts = counted_tokens(records)
    if not counts:
        raise RuntimeError(f"the token probe produced no finished conversation ({sp.probe}); see the server logs")
    t_max = search_t_max(records, quantile)
    logger.info("probe | %d conversations | T_max = P%d = %d tokens", len(counts), round(100 * quantile), t_max)
    return {"conversations": len(counts), "t_max": t_max} | stats.to_dict()


def search(part: Part, s: Settings, t_max: int) -> dict:
    """One tree per question (docs/method.md#tree-search), ``thread_count`` at a time, each finished tree one line of
    ``rollouts.jsonl`` (a killed search resumes at the next question); ``t_max``: the probe's."""
    run, recipe, sp, iteration = part.run, part.recipe, part.sp, part.iteration
    examples = training_questions(run, iteration, "search", recipe.monte_sample_count)
    urls = run.servers.serve(part.model, sp)
    done = {task_id for task_id, _ in prepare_resume(sp.rollouts)}
    todo = [(q, ex) for q, ex in enumerate(examples) if (ex.id, 0) not in done]
    logger.info("search | %d questions (%d done) | T_max %d | %d endpoints", len(examples), len(done), t_max,
                len(urls))  # fmt: skip
    pool = ReplicaPool(urls, recipe)
    tokenize = run.tokenizer.tokenize if recipe.compat == "original" else None
    count_tokens = TokenCounter(recipe)  # generation's fallback when a server sends no usage
    with contextlib.ExitStack() as stack:
        verifier = stack.enter_context(run.math_verifier())
        stack.callback(pool.close)
        writer = stack.enter_context(JsonlWriter(sp.rollouts))
        # Last in, first out: a loss server started for the search stops as soon as the trees are done.
        scorer = stack.enter_context(loss_scorer(run, s.loss, sp)) if todo else None
        score_texts = CachedLoss(scorer) if scorer is not None else None

        def tree(position: int, example) -> dict:
            replica, calls = pool.route(position), 0

            def chat(messages, speaker):
                # Each request of a tree gets its own seed (its n-th call): rollouts differ, reruns repeat.
                nonlocal replica, calls
                calls += 1
                seed = stable_rng(recipe.seed, SEARCH_SEED_STREAM, iteration, example.id, calls).randrange(2**31)
                reply = pool.chat(replica, messages, Sampling(recipe.temperature, recipe.max_tokens, seed))
                replica = reply.replica
                return reply

            generate_reply = reply_from_chat(chat, recipe.max_tokens, (RequestFailed,), count_tokens)
            rollout_score = build_rollout_scorer(example, recipe, t_max, score_texts, tokenize, verifier)
            rng = random.Random(f"{recipe.seed}:{SEARCH_SEED_STREAM}:{iteration}:{example.id}")
            # Keyed like generation records so the JSONL store resumes it (one line per question).
            return search_question(example, generate_reply, rollout_score, recipe, rng).to_dict() | {"sample_index": 0}

        with ThreadPoolExecutor(max_workers=workers(recipe, len(todo))) as executor:
            futures = [executor.submit(tree, position, example) for position, example in todo]
            for future in tqdm(as_completed(futures), total=len(futures), unit="question", desc="search"):
                writer.write(future.result())
    return search_stats(load_records(sp.rollouts)[0], t_max) | verifier_stats(verifier)


def search_stats(lines: list[dict], t_max: int) -> dict:
    """Sizes, and the rates and reward parts of the scored rollouts (a failed one counts in ``failed_rollouts``)."""
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


def pairs(part: Part, s: Settings) -> dict:
    """Mine preference pairs from the trees and save them (docs/method.md#mining-pairs)."""
    lines, _ = load_records(part.sp.rollouts)
    return save_pairs(lines, part.recipe, part.sp.dataset, part.sp.selection_record, part.iteration)


def verifier_stats(verifier) -> dict:
    """The count of symbolic MATH checks that timed out on every try (scored 0); {} without a verifier."""
    return {} if verifier is None else {TIMEOUTS: verifier.timeouts}


@dataclass(frozen=True)
class RewardScorers:
    """What scores a conversation beside the reward fields: LM losses (``score_texts``; ``known``: those scored while
    generating), the tokenizer of subword F1 (``compat: original``), the stage's ``MathVerifier``."""

    score_texts: ScoreTexts | None = None
    known: KnownLosses | None = None
    tokenize: Callable[[str], list[str]] | None = None
    verifier: object | None = None


def reward_stats(lines: Sequence[dict], verifier=None) -> dict:
    """What the score stage saw (metrics.json), over every rewarded line; ``verifier`` checks flexible MATH answers.

    The flexible answer is the one named in words when not in the format (``optima.tasks.scoring``): reported, never
    rewarded; a strict answer is its own flexible one, scored as the reward scored it.
    """
    results = [r for line in lines for r in line["results"]]
    parts, task_sum, flexible, flexible_sum = Counter(), 0.0, 0, 0.0
    for line in lines:
        task_sum += sum(r["reward_parts"]["task_score"] for r in line["results"])  # per question, as before
    for r in results:
        parts.update(r["reward_parts"])
        if scored_answer(r.get("final_answer"), r.get("status", "ok")) is not None:
            flexible, flexible_sum = flexible + 1, flexible_sum + r["reward_parts"]["task_score"]
        elif (answer := flexible_answer(r)) is not None:
            example = Example.from_dict(r["example"])
            flexible, flexible_sum = flexible + 1, flexible_sum + score_example(example, answer, verifier=verifier)
    n, best = max(len(results), 1), sorted(max(r["reward"] for r in line["results"]) for line in lines)
    answered = sum(scored_answer(r.get("final_answer"), r.get("status", "ok")) is not None for r in results)
    return {
        "questions": len(lines),
        "conversations": len(results),
        "answer_rate": round(answered / n, 4),
        "accuracy": round(task_sum / n, 4),
        "flexible_answer_rate": round(flexible / n, 4),
        "flexible_accuracy": round(flexible_sum / n, 4),
        "mean_tokens": round(sum(r["token_count"] for r in results) / n, 2),
        "cut_rate": round(sum(is_cut(r) for r in results) / n, 4),
        "placeholder_copies": sum(placeholder_copies(r) > 0 for r in results),
        "best_reward_max": round(best[-1], 4) if best else None,
        "best_reward_median": round(best[len(best) // 2], 4) if best else None,
        "mean_reward_parts": mean_parts(parts, len(results)),
    }


def mean_parts(parts_sum: Counter, count: int) -> dict[str, float] | None:
    """Per-conversation means of summed reward parts (None when nothing was scored)."""
    return {name: round(total / count, 4) for name, total in parts_sum.items()} if count else None


def reward_question(
    records: Sequence[dict], losses: Sequence[Sequence[float] | None], recipe: LoopRecipe, tokenize=None, verifier=None
) -> dict:
    """The rewarded line of one question: ``{"task_id", "t_max", "results": [record + losses + reward parts]}``."""
    conversations = []
    records = [reparsed(record) for record in records]  # rows parsed by an older parser: their stored text again
    for record, record_losses in zip(records, losses, strict=True):
        example = Example.from_dict(record["example"])
        answer = scored_answer(record.get("final_answer"), record["status"], recipe.compat)
        task_score = score_example(example, answer, recipe.compat, tokenize, verifier=verifier)
        utterances = [Utterance(u["speaker"], u["text"]) for u in record["utterances"]]
        tokens, status = record["token_count"], record["status"]
        conversations.append(Conversation(utterances, tokens, task_score, status, record_losses))
    t_max = question_t_max(conversations)
    results = []
    for record, loss, conversation in zip(records, losses, conversations, strict=True):
        parts = score_conversation(conversation, t_max, recipe)
        json_losses = to_json_losses(loss) if loss is not None else None
        results.append(record | {"losses": json_losses, "reward_parts": parts.to_dict(), "reward": parts.reward})
    return {"task_id": records[0]["task_id"], "t_max": t_max, "results": results}


def _losses_for(chunk: Sequence[Sequence[dict]], score_texts: ScoreTexts | None, known: KnownLosses | None) -> list:
    """LM losses of every utterance of every conversation in ``chunk``: stored ones, the rest in one batched call."""
    if score_texts is None:
        return [[None] * len(group) for group in chunk]
    records = [record for group in chunk for record in group]
    losses = [known(record) if known else None for record in records]
    # Only finished conversations' losses are read by the reward (a cut or failed one gets the loss penalty).
    missing = [i for i, record in enumerate(records) if losses[i] is None and needs_losses(record)]
    texts = [text for i in missing for text in conversation_texts(records[i])]
    flat = iter(score_texts(texts) if texts else [])
    for i in missing:
        losses[i] = [next(flat) for _ in records[i]["utterances"]]
    ordered = iter(losses)
    return [[next(ordered) for _ in group] for group in chunk]


def reward_generations(
    recipe: LoopRecipe, generations: Path, out_path: Path, scorers: RewardScorers = RewardScorers()
) -> dict:
    """Reward every question of ``generations`` into ``out_path`` (``rewarded.jsonl``), resuming what is there: one
    line per question, written in chunks, so a killed stage resumes at the first question not yet written. Returns
    ``reward_stats`` of every line."""
    records, _ = load_records(generations)
    groups = group_by_question(records)
    # One line per question (no sample_index): the question's id is the resume key.
    done = prepare_resume(out_path, retry_errors=False, key=lambda line: str(line["task_id"]))
    todo = [g for g in groups if str(g[0]["task_id"]) not in done]
    on = "on" if scorers.score_texts else "off"
    logger.info("score | %d questions (%d already rewarded) | LM loss %s", len(groups), len(done), on)
    with JsonlWriter(out_path) as writer, tqdm(total=len(todo), unit="question", desc="score") as bar:
        for start in range(0, len(todo), QUESTIONS_PER_CHUNK):
            chunk = todo[start : start + QUESTIONS_PER_CHUNK]
            for group, losses in zip(chunk, _losses_for(chunk, scorers.score_texts, scorers.known), strict=True):
                writer.write(reward_question(group, losses, recipe, scorers.tokenize, scorers.verifier))
                bar.update()
    return reward_stats(load_records(out_path)[0], scorers.verifier)
