"""Results know what produced them: a rerun with another producer recomputes its files, never mixes rows.

``python -m optima compare`` runs against the scripted server twice; each run's replies carry the run's number, so
a file that mixes rows of the two runs shows it. One case per setting of the fingerprint
(``optima.evaluation.runs``); each lists the files that must be redone, and every other file must be kept.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from optima.__main__ import main as optima_main
from optima.evaluation import baselines as cot
from optima.evaluation.runs import SUPERSEDED, differences, read_producer, tokenizer_identity
from optima.identity import COMPLETE_MARKER, new_weights_id
from optima.store import load_records
from tests.fake_openai import FakeOpenAIServer, FakeReply, speaker_of
from tests.test_eval_runs import detach_driver_logs, write_arc_data  # noqa: F401  (fixture)

FILES = ("base.cot", "base.cot_sc", "base.mad", "Opt.optima")
BASELINE_FILES = FILES[:3]


class TaggedReplies:
    """Answers every method like ``tests.test_baselines.method_reply``, each reply tagged with the run number."""

    def __init__(self):
        self.run = 1

    def __call__(self, body: dict) -> FakeReply:
        tag = f"run{self.run}"
        if body["messages"][0]["content"].startswith("You answer"):  # CoT and the debaters
            return FakeReply(f"{tag}: 2 + 2 = 4, option B. <A>B) 4</A>")
        if speaker_of(body) == "Alice":
            return FakeReply(f"Alice: {tag} 2 + 2 = 4 so <A>B</A>")
        return FakeReply(f"Bob: {tag} looks right")


def write_model(folder: Path, weights_id: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    if weights_id:
        (folder / COMPLETE_MARKER).write_text(json.dumps({"weights_id": weights_id}))
    return folder


def mark_weights(tmp_path: Path) -> None:
    write_model(tmp_path / "ckpt", new_weights_id())  # the checkpoint retrained in place


def add_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "base" / "tokenizer.json").write_text('{"model": "other"}')


def new_cot_reminder(monkeypatch) -> None:
    choice = cot.COT_PROMPTS["choice"]
    monkeypatch.setitem(cot.COT_PROMPTS, "choice", cot.CoTPrompt(choice.system, choice.reminder + " Be brief."))


def new_later_prompt(monkeypatch) -> None:
    """Optima's task turn changes for every question but the first of the set: only a hash of all of them sees it."""
    from optima.agents import prompts
    from optima.tasks.sampling import stratified_indices

    first = f"arc-{stratified_indices([''] * 4, 2, seed=42)[0]}"  # the --limit 2 sample of the four questions
    original = prompts.render_task_turn

    def render(example, *args, **kwargs):
        text = original(example, *args, **kwargs)
        return text if example.id in (first, "probe") else text + " Think twice."

    monkeypatch.setattr(prompts, "render_task_turn", render)


# (setting, extra flags of the second run, what else changes, the files that must be redone)
CASES = [
    ("questions", ["--limit", "3"], None, FILES),
    ("seed", ["--seed", "7"], None, FILES),
    ("temperature", ["--temperature", "0.9"], None, ("base.cot_sc", "base.mad")),  # CoT and Optima are greedy
    ("max_tokens", ["--set", "max_tokens=77"], None, FILES),
    ("max_turns", ["--set", "max_turns=5"], None, FILES),
    ("samples", ["--samples", "3"], None, ("base.cot_sc",)),
    ("mad_agents", ["--mad_agents", "3"], None, ("base.mad",)),
    ("mad_rounds", ["--mad_rounds", "2"], None, ("base.mad",)),
    ("weights", [], lambda tmp_path, mp: mark_weights(tmp_path), ("Opt.optima",)),
    ("tokenizer", [], lambda tmp_path, mp: add_tokenizer(tmp_path), BASELINE_FILES),
    ("prompts", [], lambda tmp_path, mp: new_cot_reminder(mp), BASELINE_FILES),
    ("later_prompts", [], lambda tmp_path, mp: new_later_prompt(mp), ("Opt.optima",)),
    ("max_model_len", ["--set", "max_model_len=512"], None, FILES),
    ("dtype", ["--set", "vllm_extra_args=[--dtype,float32]"], None, FILES),
    ("cluster_f1", ["--set", "cluster_f1=0.5"], None, ("base.mad",)),  # MAD's vote; the others are read with it
]


def tags(path: Path) -> set[str]:
    records, _ = load_records(path)
    return {word for r in records for u in r["utterances"] for word in u["text"].split() if word.startswith("run")}


@pytest.mark.parametrize(("setting", "flags", "change", "redone"), CASES, ids=[c[0] for c in CASES])
def test_another_producer_recomputes_its_files_and_keeps_the_others(
    tmp_path, monkeypatch, capsys, setting, flags, change, redone
):
    write_model(tmp_path / "base")
    write_model(tmp_path / "ckpt", new_weights_id())
    out = tmp_path / "cmp"
    replies = TaggedReplies()
    with FakeOpenAIServer(respond=replies) as server:
        argv = ["compare", "--model", str(tmp_path / "base"), "--dataset_type", "arc", "--limit", "2"]
        argv += ["--data_dir", str(write_arc_data(tmp_path / "data")), "--output_path", str(out), "--samples", "2"]
        argv += ["--methods", "cot", "cot_sc", "mad", "--mad_agents", "2", "--mad_rounds", "1"]
        argv += ["--optima", f"Opt={tmp_path / 'ckpt'}", "--set", f"endpoints=[{server.base_url}]"]
        assert optima_main(argv) == 0
        assert all(tags(out / f"{name}.jsonl") == {"run1:" if "cot" in name or "mad" in name else "run1"}
                   for name in FILES)  # fmt: skip
        replies.run = 2
        if change:
            change(tmp_path, monkeypatch)
        capsys.readouterr()
        assert optima_main(argv + flags) == 0
    for name in FILES:
        runs = {tag.rstrip(":") for tag in tags(out / f"{name}.jsonl")}
        assert runs == ({"run2"} if name in redone else {"run1"}), name
        assert (name in redone) == any((out / SUPERSEDED).glob(f"{name}.*.jsonl")), name
    assert capsys.readouterr().err.count("produced otherwise") == len(redone)  # one warning per file, naming why


def test_a_file_without_a_fingerprint_is_moved_aside(tmp_path):
    from optima.evaluation.runs import claim_result_file

    legacy = tmp_path / "model.cot.jsonl"
    legacy.write_text('{"task_id": "q0", "sample_index": 0}\n')
    assert claim_result_file(legacy, {"model": "w1"})
    assert not legacy.exists() and (tmp_path / SUPERSEDED / "model.cot.unknown.jsonl").is_file()
    assert read_producer(legacy) == {"model": "w1"}
    assert not claim_result_file(legacy, {"model": "w1"})  # same producer: kept


def test_fingerprint_differences_and_tokenizer_identity(tmp_path):
    old = {"model": "w1", "generation": {"temperature": 0.5, "seed": 1}}
    new = {"model": "w1", "generation": {"temperature": 0.9, "seed": 1}}
    assert differences(old, new) == ["generation.temperature: 0.5 -> 0.9"]
    assert differences(None, new) == ["no fingerprint recorded"]
    write_model(tmp_path / "a")
    before = tokenizer_identity(tmp_path / "a")
    (tmp_path / "a" / "tokenizer_config.json").write_text('{"chat_template": "x"}')
    assert tokenizer_identity(tmp_path / "a") != before
    assert tokenizer_identity("org/name") == "org/name"


def test_a_models_fingerprint_and_scorer_are_built_once_for_all_its_jobs(make_recipe, tmp_path):
    """The weights hash, the questions hash and the tokenizer are the model's: every job of it shares them."""
    from optima.agents.conversation import GenerationSettings
    from optima.evaluation.runs import GenerationJob, RecordScorers, model_fingerprint, producer_fingerprint
    from tests.helpers import arc_examples

    recipe, examples = make_recipe(), arc_examples(2)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    shared = model_fingerprint(recipe, model, examples)
    jobs = [
        GenerationJob(label, tmp_path / f"{label}.jsonl", GenerationSettings(0, t, 1))
        for label, t in (("a", 0.0), ("b", 0.7))
    ]
    prints = [producer_fingerprint(recipe, job, examples, shared) for job in jobs]
    assert {p["model"] for p in prints} == {shared["model"]} and prints[0]["questions"] == shared["questions"]
    assert prints[0]["generation"]["temperature"] != prints[1]["generation"]["temperature"]
    scorer_of = RecordScorers(recipe, verifier=None)
    assert scorer_of(model) is scorer_of(model) and scorer_of(model) is not scorer_of(tmp_path / "other")


def test_a_scoring_change_keeps_the_rows_and_updates_the_sidecar(tmp_path):
    """Parser and scorer versions and ``cluster_f1`` say how rows are read: rows stay, the sidecar names them."""
    from optima.evaluation.runs import claim_result_file

    path = tmp_path / "model.cot.jsonl"
    made = {"model": "w1", "scoring": {"parser": 1, "scorer": 1}}
    claim_result_file(path, made)
    path.write_text('{"task_id": "q0", "sample_index": 0}\n')
    read_otherwise = made | {"scoring": {"parser": 2, "scorer": 1}}
    assert not claim_result_file(path, read_otherwise) and path.read_text().startswith('{"task_id": "q0"')
    assert read_producer(path) == read_otherwise
    assert claim_result_file(path, read_otherwise | {"model": "w2"})  # another producer still moves it aside


def test_rows_of_an_older_parser_are_reparsed_from_their_text(tmp_path):
    from optima.evaluation.metrics import reparsed_debate
    from optima.evaluation.runs import load_results
    from optima.tasks.answers import PARSER_VERSION
    from tests.helpers import arc_examples

    example = arc_examples(1)[0].to_dict()
    utterances = [{"speaker": "Alice", "text": "so <A>B</A>"}, {"speaker": "Bob", "text": "ok"}]
    old = {"task_id": "q0", "sample_index": 0, "task": "arc", "example": example, "status": "ok"}
    old |= {"utterances": utterances, "final_answer": "stale"}  # parsed by a parser without a version
    current = old | {"task_id": "q1", "parser_version": PARSER_VERSION}
    debate = old | {"task_id": "q2", "debate": {"agents": 2, "rounds": 0, "final_cut": [False, True]}}
    debate["utterances"] = [{"speaker": "Agent 1", "text": "<A>A</A>"}, {"speaker": "Agent 2", "text": "<A>B</A>"}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (old, current, debate)))
    rows = load_results(path)
    assert [r["final_answer"] for r in rows] == ["B", "stale", "A"]  # the cut reply of the debate does not vote
    assert {r["parser_version"] for r in rows} == {PARSER_VERSION}
    assert reparsed_debate(rows[2], 0.9) is rows[2]  # current rows are kept as they are
