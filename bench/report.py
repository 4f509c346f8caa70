"""Render ``bench/RESULTS.md`` from the results ``python -m bench.run_all`` collected (pure: dicts in, Markdown out).

.venvs/train/bin/python -m bench.run_all        # calls render_results(); not run on its own

Everything rendered comes from the results: each section and each target line names the date its benchmark ran.
"""

from __future__ import annotations

TARGETS = {"scoring": 3.0, "sft": 0.95, "iteration": 0.10, "generation": 0.90, "prefix_hit_rate": 0.85}
GENERATION_TITLES = {
    "generation": "Generation (`bench/generation.py`)",
    "generation_ie": "Generation, information exchange (`bench/generation.py --task hotpot_qa`)",
}


def table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    return lines + [""]


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**MISSED**"


def failed(name: str, result: dict) -> list[str]:
    data = result["data"]
    return [f"**{name} failed** ({data['error']}); last lines:", "", "```", *data["tail"], "```", ""]


def ran(result: dict) -> str:
    """When a benchmark ran, and the load around it (results of older versions may lack them)."""
    text = f"run {result.get('date', '(date not recorded)')}"
    if "load_before" in result:
        text += f", load average before / after {result['load_before']} / {result['load_after']}"
    return text


def render_machine(meta: dict, results: dict, demo_wall: float | None) -> list[str]:
    lines = ["## Machine and conditions", ""]
    rows = [[k, v] for k, v in meta["machine"].items()]
    for name, result in results.items():
        where = f"; outputs in `{result['outputs']}`" if "outputs" in result else ""
        rows.append([f"`{name}`", f"{ran(result)} (1/5/15 min), {result['wall_s']:.0f} s{where}"])
    if demo_wall is not None:
        rows.append(
            ["demo run wall time (runs/demo_arc_sft, driver log)", f"{demo_wall:.0f} s ({demo_wall / 60:.1f} min)"]
        )
    lines += table(["", ""], rows)
    lines += [
        "The box is shared with other engineers' jobs (the load average above); every comparison is interleaved",
        "(A, B, A, B, ...) so that slow drifts in load hit both sides. Load here also comes in bursts shorter than",
        "a round, which hit one run of a pair and not its partner, and it only ever adds time: headline ratios",
        "compare each side's best run, with the per-round ratios, their geometric mean and the ratio of totals",
        "printed beside them.",
        "",
    ]
    return lines


def render_scoring(result: dict) -> list[str]:
    lines = ["## LM-loss scoring (`bench/scoring.py`)", "", f"`{result['command']}`", ""]
    if "error" in result["data"]:
        return lines + failed("scoring", result)
    d = result["data"]
    lines.append(
        f"{d['utterances']} utterances of {d['conversations']} conversations from the demo's generations.jsonl "
        f"({d['tokens']} tokens rendered, template included), {d['rounds']} interleaved rounds, "
        f"{d.get('torch_threads', '?')} torch thread(s) for the in-process HF methods (the vLLM CPU engine "
        "computes on one core)."
    )
    lines.append("")
    names = {
        "vllm": "ours, `vllm` backend (default)",
        "hf": "ours, `hf` backend",
        "original": "original: one HF forward per conversation",
        "vllm_prefill": "reference: vLLM forward alone (no log-probabilities)",
    }
    rows = [
        [
            names[m],
            r["best_utterances_per_s"],
            r["best_tokens_per_s"],
            r["utterances_per_s"],
            r["tokens_per_s"],
            r["seconds_per_round"],
        ]
        for m, r in d["methods"].items()
    ]
    header = ["method", "utterances/s (best round)", "tokens/s (best round)", "utterances/s (all)", "tokens/s (all)"]
    lines += table([*header, "seconds per round"], rows)
    speedup = d["speedup_vllm_vs_original"]
    lines += [
        f"- speedup vllm / original: **{speedup:.2f}x** (best rounds; per round "
        f"{d['speedup_vllm_vs_original_per_round']}, geometric mean {d['speedup_vllm_vs_original_geomean_rounds']}x, "
        f"ratio of totals {d['speedup_vllm_vs_original_of_totals']}x); "
        f"target >= {TARGETS['scoring']:.0f}x: {verdict(speedup >= TARGETS['scoring'])}",
        f"- speedup hf / original: {d['speedup_hf_vs_original']:.2f}x",
        f"- ceiling: the vLLM forward pass alone over the same tokens is "
        f"{d['speedup_prefill_ceiling_vs_original']:.2f}x the original",
        "- agreement, max |loss difference| (mean NLL, nats): "
        + "; ".join(f"{k} {v['max']:.2e}" for k, v in d["max_abs_diff"].items()),
        f"- vLLM server start-up (not in the rates above): {d['server_start_s']:.0f} s",
        "",
    ]
    return lines


def render_sft(result: dict) -> list[str]:
    lines = ["## SFT (`bench/sft.py`)", "", f"`{result['command']}`", ""]
    if "error" in result["data"]:
        return lines + failed("sft", result)
    d = result["data"]
    lines.append(
        f"max_steps {d['max_steps']}, {d['rounds']} interleaved rounds, rows of `{d['dataset']}`; tokens = TRL's "
        "logged `num_tokens` (non-padding input tokens); training = `train_runtime`; wall = the whole "
        "`accelerate launch` (start-up, tokenising, saving)."
    )
    lines.append("")
    names = {"ours": "ours (`optima.training.sft_train`, masked)", "plain": "plain TRL `SFTTrainer` (`messages`)"}
    rows = [
        [
            names[s],
            r["num_tokens_per_run"],
            r["train_runtime_s"],
            r["wall_s"],
            r["best_tokens_per_s_train"],
            r["best_tokens_per_s_wall"],
            r["tokens_per_s_train"],
            r["tokens_per_s_wall"],
        ]
        for s, r in d["sides"].items()
    ]
    header = ["side", "tokens per run", "train_runtime s", "wall s", "tok/s training (best)", "tok/s wall (best)"]
    lines += table([*header, "tok/s training (all)", "tok/s wall (all)"], rows)
    ratio = d["ratio"]
    ok = min(ratio.values()) >= TARGETS["sft"]
    lines += [
        f"- ratio ours / plain, training only: **{ratio['train']:.3f}** (best runs; per round "
        f"{d['ratio_per_round']['train']}, geometric mean {d['ratio_geomean_rounds']['train']}, ratio of totals "
        f"{d['ratio_of_totals']['train']})",
        f"- ratio ours / plain, wall clock: **{ratio['wall']:.3f}** (best runs; per round "
        f"{d['ratio_per_round']['wall']}, geometric mean {d['ratio_geomean_rounds']['wall']}, ratio of totals "
        f"{d['ratio_of_totals']['wall']})",
        f"- target >= {TARGETS['sft']} (both): {verdict(ok)}",
        "",
    ]
    return lines


def render_iteration(result: dict) -> list[str]:
    lines = ["## Iteration overhead (`python -m dev.times`)", "", f"`{result['command']}`", ""]
    if "error" in result["data"]:
        return lines + failed("iteration", result)
    d = result["data"]
    header = ["iteration", "wall s", "generation s", "training s", "scoring not hidden s", "vLLM start-ups s"]
    header += ["wall / (generation + training)", "overhead s", "overhead share", "training launch s", "select s"]
    keys = ["iteration", "wall_s", "generation_s", "training_s", "scoring_s", "server_start_s", "ratio"]
    keys += ["overhead_s", "overhead_share", "train_launch_s", "select_s"]
    rows = [[f"{r[k]:.1%}" if k == "overhead_share" else r.get(k) for k in keys] for r in d["iterations"]]
    lines += table(header, rows)
    lines += [
        f"- overhead over the whole run: {d['overhead_share_total']:.1%}; target <= {TARGETS['iteration']:.0%} "
        f"of every iteration: {verdict(d['target_met'])}",
    ]
    if "ratio_target_met" in d:
        met = verdict(d["ratio_target_met"])
        lines.append(f"- wall / (generation + training) <= 1.15 first, <= 1.05 after: {met}")
    if d.get("busy") is not None:
        lines.append(f"- busy share of the cores over the run (/proc/stat): {d['busy']:.1%}; target >= 80%")
    return lines + [""]


def render_generation(result: dict, name: str = "generation") -> list[str]:
    lines = [f"## {GENERATION_TITLES[name]}", "", f"`{result['command']}`", ""]
    if "error" in result["data"]:
        return lines + failed(name, result)
    d = result["data"]
    lines += [d.get("setting", ""), ""]
    rows = [
        [side, d[side]["tokens"], d[side]["seconds"], d[side]["tokens_per_s"], (d.get("hit_rate") or {}).get(side, "")]
        for side in ("generator", "plain")
        if side in d
    ]
    lines += table(["side", "generated tokens", "seconds", "tok/s", "prefix-cache hit rate (/metrics)"], rows)
    ratio = d.get("ratio")
    if ratio is not None:
        lines += [
            f"- ratio generator / plain client: **{ratio:.3f}**; target >= {TARGETS['generation']}: "
            f"{verdict(ratio >= TARGETS['generation'])}",
        ]
    if d.get("hit_rate_turns_2_n") is not None:
        ok = d["hit_rate_turns_2_n"] >= TARGETS["prefix_hit_rate"]
        lines += [
            f"- generator's prefix-cache hit rate over turns 2..N (share of prompt tokens read from the cache, from"
            f" each reply's usage): **{d['hit_rate_turns_2_n']:.3f}**; target >= {TARGETS['prefix_hit_rate']}:"
            f" {verdict(ok)}; over turns 3..N (each agent's own later turns): {d.get('hit_rate_turns_3_n')}",
            f"- by turn: {d.get('hit_rate_by_turn', '')}",
        ]
    return lines + [""]


def render_memory(results: dict) -> list[str]:
    lines = ["## Peak memory", ""]
    rows = []
    for name, result in results.items():
        if name == "iteration":
            continue  # reads files only
        rows.append([name, "whole benchmark process tree, sampled sum of VmRSS", result["tree_peak_rss_mib"]])
        data = result["data"]
        for what, mib in data.get("memory", {}).items() if isinstance(data.get("memory"), dict) else []:
            rows.append([name, what, mib])
        for side, row in data.get("sides", {}).items():
            rows.append([name, f"{side}: accelerate launch tree, sampled sum of VmRSS", row["peak_rss_mib"]])
    lines += table(["benchmark", "what", "MiB"], rows)
    lines += [
        "Sampled sums (every 0.5 s, `/proc/<pid>/status` VmRSS of every descendant) count pages shared between",
        "processes once per process (vLLM's API server, engine core and worker each map torch), so they are upper",
        "bounds, and a spike shorter than 0.5 s can be missed. `ru_maxrss` is the kernel's exact peak of one",
        "process. `iteration` only reads files and is left out.",
        "",
    ]
    return lines


def scoring_finding(d: dict) -> str:
    ok = d["speedup_vllm_vs_original"] >= TARGETS["scoring"]
    speedup = d["speedup_vllm_vs_original"]
    text = f"- Scoring, vllm >= {TARGETS['scoring']:.0f}x the original: {verdict(ok)} ({speedup:.2f}x)."
    if not ok:
        seconds = {m: min(r["seconds_per_round"]) for m, r in d["methods"].items()}
        extra = seconds["vllm"] / seconds["vllm_prefill"] - 1
        ceiling = d["speedup_prefill_ceiling_vs_original"]
        text += (
            " On this CPU every method runs the same forward pass over the same tokens on one core, so scoring is"
            f" compute-bound: vLLM's forward pass alone is {ceiling:.2f}x the original (faster kernels, no"
            " padding), the most any vLLM-based scorer could reach here even with free log-probabilities;"
            f" returning the prompt log-probabilities costs {extra:.0%} on top of the forward pass."
            " Batching many conversations per request, where the gain over the original is meant to come from,"
            " pays on a GPU that the original's ~5-text batches leave idle; there is none here."
        )
    return text


def sft_finding(d: dict) -> str:
    ok = min(d["ratio"].values()) >= TARGETS["sft"]
    rounds = d["ratio_per_round"]["train"]
    tokens = {side: sorted(set(r["num_tokens_per_run"])) for side, r in d["sides"].items()}
    return (
        f"- SFT, ours >= {TARGETS['sft']} of plain TRL: {verdict(ok)} (best runs: training {d['ratio']['train']:.3f},"
        f" wall {d['ratio']['wall']:.3f}). Per-round training ratios {min(rounds):.3f}-{max(rounds):.3f}; tokens"
        f" per run ours {tokens['ours']}, plain {tokens['plain']} (same rows, same model, same SFTConfig)."
    )


def iteration_finding(d: dict) -> str:
    rows = d["iterations"]
    text = f"- Iteration overhead <= {TARGETS['iteration']:.0%}: {verdict(d['target_met'])} (" + ", ".join(
        f"iteration {r['iteration']}: {r['overhead_share']:.1%}" for r in rows
    )
    text += ")."
    if not d["target_met"]:
        starts = sum(r["server_start_s"] or 0 for r in rows)
        launches = sum(r["train_launch_s"] for r in rows)
        total = sum(r["overhead_s"] for r in rows)
        text += (
            f" Of {total:.0f} s overhead, {starts:.0f} s are vLLM start-ups (servers loading in parallel each"
            f" count) and {launches:.0f} s training launches outside the loop (imports, loading, tokenising,"
            " saving). These are fixed per iteration and the demo's iterations are tiny (24 questions x 4 samples,"
            " a few training steps)."
        )
    if "ratio_target_met" in d:
        met = verdict(d["ratio_target_met"])
        text += f" Wall / (generation + training) <= 1.15 first, <= 1.05 after: {met} (" + ", ".join(
            f"iteration {r['iteration']}: {r['ratio']}" for r in rows
        )
        text += ")."
    return text


def generation_finding(d: dict) -> str | None:
    if d.get("ratio") is None:
        return None
    ok = d["ratio"] >= TARGETS["generation"]
    return (
        f"- Generation, generator >= {TARGETS['generation']} of a plain client: {verdict(ok)} "
        f"({d['ratio']:.3f}; one pass each side, seconds-long, so noisy on a shared box)."
    )


def render_findings(results: dict) -> list[str]:
    """One line per benchmark that ran without error: its target, met or missed, and the date it ran."""
    lines = ["## Targets", ""]
    findings = {
        "scoring": scoring_finding,
        "sft": sft_finding,
        "iteration": iteration_finding,
        "generation": generation_finding,
        "generation_ie": generation_ie_finding,
    }
    for name, finding in findings.items():
        if name in results and "error" not in results[name]["data"]:
            line = finding(results[name]["data"])
            if line:
                lines.append(f"{line.removesuffix('.')} ({ran(results[name])}).")
    return lines + [""]


def generation_ie_finding(d: dict) -> str | None:
    if d.get("ratio") is None:
        return None
    hit = d.get("hit_rate_turns_2_n")
    ok = d["ratio"] >= TARGETS["generation"] and hit is not None and hit >= TARGETS["prefix_hit_rate"]
    return (
        f"- Generation, information exchange (HotpotQA, 6 turns), generator >= {TARGETS['generation']} of a plain"
        f" client and prefix-cache hit rate >= {TARGETS['prefix_hit_rate']} over turns 2..N: {verdict(ok)}"
        f" (ratio {d['ratio']:.3f}, hit rate {hit})."
    )


def render_results(results: dict, meta: dict) -> str:
    """The whole generated part of RESULTS.md."""
    demo = results.get("iteration", {}).get("data", {}).get("run_wall_s")
    lines = [
        "# Benchmarks",
        "",
        "Written by `python -m bench.run_all` from `bench/results.json` (do not edit by hand; rerun it). Small",
        "settings, chosen to keep the whole run under 20 minutes on a 2-core box; each script's docstring gives",
        "its full-size command. Each benchmark's section and target line name the date it ran.",
        "",
    ]
    lines += render_machine(meta, results, demo)
    lines += render_findings(results)
    renderers = {
        "scoring": render_scoring,
        "sft": render_sft,
        "iteration": render_iteration,
        "generation": render_generation,
        "generation_ie": lambda result: render_generation(result, "generation_ie"),
    }
    for name, render in renderers.items():
        if name in results:
            section = render(results[name])
            lines += [*section[:-1], f"- {ran(results[name])}", ""]
    lines += render_memory(results)
    return "\n".join(lines)
