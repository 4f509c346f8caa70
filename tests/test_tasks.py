"""Tests for the dataset loaders, examples, context splits and question slices (optima/tasks; docs/method.md#tasks)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import types
from dataclasses import replace

import pytest

from optima.tasks import QA_EVAL_LIMIT, TASK_ALIASES, TASKS, DataError, Example, MixTask, get_task, select_questions
from optima.tasks.choice import normalize_question, question_stem
from optima.tasks.multihop import iter_context
from optima.tasks.sampling import select_indices, stable_rng
from optima.tasks.trival_qa import TriviaQA
from tests._task_fixtures import REPO_ROOT, resolve_test_data_dir


@pytest.fixture(scope="module")
def data_dir():
    path = resolve_test_data_dir()
    if not path.is_dir():
        pytest.skip(f"dataset samples not found at {path} (the repository's data/, or OPTIMA_DATA_DIR)")
    return path


@pytest.fixture
def no_data_env(monkeypatch):
    monkeypatch.delenv("OPTIMA_DATA_DIR", raising=False)


# (task, split, rows in the repository's data/; see data/README.md and each SOURCE.md)
SPLIT_COUNTS = [
    ("hotpot_qa", "train", 300),
    ("hotpot_qa", "validation", 60),
    ("mwh_qa", "train", 6),
    ("mwh_qa", "dev", 60),
    ("trival_qa", "validation", 100),
    ("cbt", "train", 1),
    ("cbt", "test", 1),
    ("cbt_ne", "validation", 1),
    ("cbt_ne", "test", 1),
    ("gsm8k", "train", 200),
    ("gsm8k", "test", 100),
    ("math", "train", 200),
    ("math", "test", 100),
    ("arc", "train", 1056),
    ("arc", "test", 500),
    ("mmlu", "auxiliary_train", 257),  # 286 minus 29 questions that are also in ARC-Challenge train
    ("mmlu", "test", 100),
]


@pytest.mark.parametrize(("task_name", "split", "count"), SPLIT_COUNTS)
def test_loader_counts_and_fields(data_dir, task_name, split, count):
    task = get_task(task_name)
    examples = task.load(split, data_dir=data_dir)
    assert len(examples) == count
    assert len({example.id for example in examples}) == count
    for example in examples:
        assert example.id and example.question.strip() and example.task == task_name
        assert all(answer.strip() for answer in example.answers)
        assert example.score_type == task.score_type
        assert bool(example.options) == (task.score_type == "choice")
        if task.family == "debate":
            assert example.context_first == example.context_second == ()


@pytest.mark.parametrize(("task_name", "split"), [(t, s) for t, s, _ in SPLIT_COUNTS if get_task(t).family == "qa"])
def test_qa_contexts_are_whole_unique_and_deterministic(data_dir, task_name, split):
    task = get_task(task_name)
    first_load = task.load(split, data_dir=data_dir, seed=7)
    assert first_load == task.load(split, data_dir=data_dir, seed=7)
    for example in first_load:
        paragraphs = example.context_first + example.context_second
        assert len(set(paragraphs)) == len(paragraphs), example.id
        if task_name != "trival_qa":  # the TriviaQA sample has no evidence (closed-book)
            assert example.context_first and example.context_second, example.id


@pytest.mark.parametrize(
    ("task_name", "file_name"), [("hotpot_qa", "hotpotqa/validation.jsonl"), ("mwh_qa", "2wikimultihopqa/dev.jsonl")]
)
def test_multihop_split_keeps_every_paragraph_whole_and_deals_supporting_ones(data_dir, task_name, file_name):
    task = get_task(task_name)
    rows = [json.loads(line) for line in (data_dir / file_name).read_text(encoding="utf-8").splitlines()]
    examples = {example.id: example for example in task.load(task.eval_split, data_dir=data_dir)}
    for row in rows:
        example = examples[str(row["_id"])]
        given = example.context_first + example.context_second
        titles = {title for title, _ in iter_context(row["context"])}

        def title_of(text, titles=titles):
            return max((title for title in titles if text.startswith(f"{title}: ")), key=len)

        assert sorted(title_of(text) for text in given) == sorted(titles)
        for title, sentences in iter_context(row["context"]):
            rendered = next(text for text in given if title_of(text) == title)
            assert all(" ".join(sentence.split()) in rendered for sentence in sentences if sentence.strip())
        supporting = {fact[0] for fact in row["supporting_facts"]}
        if len(supporting) >= 2:
            assert any(title_of(text) in supporting for text in example.context_first), "Alice holds evidence"
            assert any(title_of(text) in supporting for text in example.context_second), "Bob holds evidence"


def test_context_split_depends_on_seed_not_on_process(data_dir):
    task = get_task("hotpot_qa")
    seed_0 = task.load("validation", data_dir=data_dir, seed=0)
    seed_1 = task.load("validation", data_dir=data_dir, seed=1)
    assert any(a.context_first != b.context_first for a, b in zip(seed_0, seed_1, strict=True))
    # SHA-256 seeding, not the per-process salted hash(): this value is the same in every process.
    assert stable_rng(0, "hotpot_qa", "x").randrange(10**6) == stable_rng(0, "hotpot_qa", "x").randrange(10**6)
    code = "from optima.tasks.sampling import stable_rng; print(stable_rng(3, 'a', 'b').random())"
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO_ROOT,
            env={"PYTHONHASHSEED": str(salt)},
            capture_output=True,
            text=True,
        ).stdout
        for salt in (1, 2)
    }
    assert outputs == {f"{stable_rng(3, 'a', 'b').random()}\n"}


def test_cbt_halves_and_candidates(data_dir):
    example = get_task("cbt").load("test", data_dir=data_dir)[0]
    row = json.loads((data_dir / "cbt/CN/test.jsonl").read_text(encoding="utf-8"))
    assert len(example.context_first) == len(example.context_second) == 10
    assert example.context_first[0] == " ".join(row["sentences"][0].split())
    assert all(option in example.question for option in row["options"]) and "XXXXX" in example.question
    assert example.answer == row["answer"]


def test_trivia_closed_book_is_logged_once_per_load(data_dir, caplog):
    with caplog.at_level(logging.INFO, logger="optima.tasks"):
        examples = get_task("trivia_qa").load("validation", data_dir=data_dir)
    lines = [record.getMessage() for record in caplog.records if "closed-book" in record.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("trival_qa split validation: 100 of 100 questions have no evidence")
    assert isinstance(examples[0].answer, tuple) and examples[0].answer[0] == "Lauren Bacall"


def test_trivia_original_schema_rows_use_search_snippets(data_dir):
    task = TriviaQA()
    path = data_dir / "triviaqa/fixture_rc_original_format/web-dev.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    example = task.build_example(rows[0], split="validation", index=0, seed=0)
    assert example.id == "tc_2" and example.answer == ("David Seville",)
    snippets = {" ".join(result["Description"].split()) for result in rows[0]["SearchResults"]}
    assert set(example.context_first + example.context_second) == snippets
    assert len(example.context_first) == len(example.context_second) == 1


def test_mmlu_train_drops_arc_overlap(data_dir):
    mmlu = get_task("mmlu").load("auxiliary_train", data_dir=data_dir)
    arc = {
        normalize_question(question_stem(example.question))
        for example in get_task("arc").load("train", data_dir=data_dir)
    }
    assert not any(normalize_question(question_stem(example.question)) in arc for example in mmlu)
    assert mmlu[0].id == "auxiliary_train-0" and mmlu[-1].id == "auxiliary_train-285"


def test_mmlu_without_arc_data_keeps_everything(tmp_path, data_dir, caplog):
    (tmp_path / "mmlu").mkdir()
    (tmp_path / "mmlu/auxiliary_train.jsonl").write_text(
        (data_dir / "mmlu/auxiliary_train.jsonl").read_text(encoding="utf-8")
    )
    with caplog.at_level(logging.WARNING):
        assert len(get_task("mmlu").load_train(data_dir=tmp_path)) == 286
    assert "ARC overlap not removed" in caplog.text


@pytest.mark.parametrize(
    ("task_name", "available", "expected"),
    [("hotpot_qa", 5000, QA_EVAL_LIMIT), ("hotpot_qa", 210, 210), ("gsm8k", 1319, 1319), ("math", 5000, 5000)],
)
def test_eval_size(task_name, available, expected):
    assert get_task(task_name).eval_size(available) == expected


def test_load_eval_uses_eval_split(data_dir):
    assert len(get_task("hotpot_qa").load_eval(data_dir=data_dir)) == 60
    assert len(get_task("arc").load_eval(data_dir=data_dir)) == 500


# ---------------------------------------------------------------- errors, sources, registry


def test_missing_split_names_path_and_expected_files(data_dir):
    with pytest.raises(DataError) as error:
        get_task("trival_qa").load_train(data_dir=data_dir)
    message = str(error.value)
    assert str(data_dir / "triviaqa") in message and "train.jsonl" in message and "validation.rc.wikipedia" in message


def test_missing_folder_and_bad_rows(tmp_path):
    with pytest.raises(DataError, match="gsm8k does not exist"):
        get_task("gsm8k").load("test", data_dir=tmp_path)
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k/test.jsonl").write_text('{"question": "q", "answer": "#### 1"}\nnot json\n')
    with pytest.raises(DataError, match="test.jsonl:2"):
        get_task("gsm8k").load("test", data_dir=tmp_path)
    (tmp_path / "gsm8k/test.jsonl").write_text('{"question": "q"}\n')
    with pytest.raises(DataError, match="row 0 of split 'test'"):
        get_task("gsm8k").load("test", data_dir=tmp_path)


def test_data_dir_comes_from_the_environment(data_dir, monkeypatch):
    monkeypatch.setenv("OPTIMA_DATA_DIR", str(data_dir))
    assert len(get_task("gsm8k").load("test")) == 100


def test_local_only_task_without_data_dir_says_so(no_data_env):
    with pytest.raises(DataError, match="no hub copy"):
        get_task("mwh_qa").load("dev")


def test_hub_path_imports_datasets_lazily(monkeypatch, no_data_env):
    calls = []

    def load_dataset(name, config, split):
        calls.append((name, config, split))
        context = {"title": ["T1", "T2"], "sentences": [["One.", " Two."], ["Three."]]}
        row = {"id": "h1", "question": "q?", "answer": "a", "context": context}
        return [dict(row, supporting_facts={"title": ["T1", "T2"], "sent_id": [0, 0]})]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    (example,) = get_task("hotpot_qa").load("validation")
    assert calls == [("hotpotqa/hotpot_qa", "distractor", "validation")]
    assert {example.context_first, example.context_second} == {("T1: One. Two.",), ("T2: Three.",)}
    calls.clear()
    with pytest.raises(DataError):  # math rows lack "solution" -> schema error, after one call per subject config
        get_task("math").load("test")
    assert calls and calls[0][:2] == ("EleutherAI/hendrycks_math", "algebra")


def test_hub_failure_is_a_data_error(monkeypatch, no_data_env):
    def load_dataset(name, config, split):
        raise FileNotFoundError("no network")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    with pytest.raises(DataError, match="OPTIMA_DATA_DIR"):
        get_task("gsm8k").load("test")


def test_get_task_aliases_and_unknown_names():
    assert get_task("trivia_qa") is TASKS["trival_qa"] and TASK_ALIASES == {"trivia_qa": "trival_qa"}
    with pytest.raises(KeyError) as error:
        get_task("hotpot")
    assert all(name in str(error.value) for name in [*TASKS, "trivia_qa"])


@pytest.mark.parametrize("name", sorted(TASKS))
def test_task_attributes_are_consistent(name):
    task = TASKS[name]
    assert task.name == name and task.family in ("qa", "debate")
    assert (task.answer_style == "boxed") == (name in ("gsm8k", "math"))
    assert task.train_split and task.eval_split and task.prompt_set in ("qa", "choice", "gsm8k", "math")
    assert (task.eval_limit == QA_EVAL_LIMIT) == (task.family == "qa" and name != "mix")


def test_import_needs_no_heavy_packages():
    code = (
        "import sys, optima.tasks, optima.tasks.scoring, optima.agents.prompts\n"
        "names = ('torch', 'vllm', 'transformers', 'requests', 'datasets', 'sympy', 'math_verify')\n"
        "heavy = [name for name in names if name in sys.modules]\n"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)


def test_example_round_trips_through_dict(data_dir):
    for name in ("arc", "trival_qa", "hotpot_qa"):
        example = get_task(name).load_eval(data_dir=data_dir)[0]
        assert Example.from_dict(json.loads(json.dumps(example.to_dict()))) == example
    with pytest.raises(ValueError):
        example.context_for(2)


# ---------------------------------------------------------------- question slices and mix


def test_select_questions_is_deterministic_and_fresh_per_iteration():
    examples = list(range(100))
    slices = [select_questions(examples, 30, seed=1, iteration=i, stage="sft") for i in range(3)]
    assert slices[0] == select_questions(examples, 30, seed=1, iteration=0, stage="sft")
    assert len(set(slices[0] + slices[1] + slices[2])) == 90
    assert select_questions(examples, 30, seed=1, iteration=0, stage="mcts") != slices[0]
    assert select_questions(examples, 30, seed=2, iteration=0, stage="sft") != slices[0]


@pytest.mark.parametrize(("size", "count", "iteration"), [(10, 25, 0), (10, 25, 3), (7, 7, 5), (1, 3, 2), (100, 0, 4)])
def test_select_indices_wraps_small_splits(size, count, iteration):
    indices = select_indices(size, count, seed=0, iteration=iteration, stage="sft")
    assert len(indices) == count and all(0 <= index < size for index in indices)
    stream = [
        i
        for epoch in range(size and (iteration + 1) * count // size + 1)
        for i in select_indices(size, size, 0, epoch, "sft")
    ]
    assert indices == stream[iteration * count : (iteration + 1) * count]


def test_select_indices_rejects_bad_arguments():
    with pytest.raises(ValueError, match="empty split"):
        select_indices(0, 5, seed=0, iteration=0, stage="sft")
    with pytest.raises(ValueError):
        select_indices(5, -1, seed=0, iteration=0, stage="sft")


def test_mix_interleaves_round_robin(data_dir):
    mix = MixTask([get_task("cbt"), get_task("hotpot_qa")], name="mix_test")
    examples = mix.load_eval(data_dir=data_dir)
    assert [example.task for example in examples[:3]] == ["cbt", "hotpot_qa", "hotpot_qa"]
    assert len(examples) == 1 + 60 and examples[0].id == "cbt:test-0"
    assert len(mix.load("train", data_dir=data_dir)) == 1 + 300
    with pytest.raises(ValueError, match="family"):
        MixTask([get_task("cbt"), get_task("gsm8k")])
    assert TASKS["mix"].family == "qa" and len(TASKS["mix"].tasks) == 4


def test_duplicate_ids_are_made_unique(tmp_path):
    (tmp_path / "arc_challenge").mkdir()
    row = {"id": "Q1", "question": "q", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "answerKey": "A"}
    (tmp_path / "arc_challenge/test.jsonl").write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
    ids = [example.id for example in get_task("arc").load("test", data_dir=tmp_path)]
    assert ids == ["Q1", "Q1#1"]
    assert replace(get_task("arc").load("test", data_dir=tmp_path)[0], id="x").id == "x"


def test_stratified_sample_covers_groups_in_proportion():
    from optima.tasks.sampling import allocate, stratified_indices

    assert allocate([2, 3, 95], 10) == [1, 1, 8] and sum(allocate([4] * 7 + [30], 20)) == 20
    groups = ["a"] * 10 + ["b"] * 90 + ["c"] * 2
    picked = stratified_indices(groups, 12, seed=1)
    counts = {g: sum(groups[i] == g for i in picked) for g in "abc"}
    assert picked == sorted(picked) and counts == {"a": 2, "b": 9, "c": 1}
    assert picked == stratified_indices(groups, 12, seed=1) != stratified_indices(groups, 12, seed=2)
    assert len({groups[i] for i in stratified_indices(groups, 2, seed=3)}) == 2  # fewer draws than groups
    assert stratified_indices(groups, 500, seed=1) == list(range(len(groups)))


def test_mmlu_and_math_examples_carry_their_group():
    from tests.test_eval_runs import REPO_DATA

    mmlu = get_task("mmlu").load_eval(data_dir=REPO_DATA)
    math = get_task("math").load_eval(data_dir=REPO_DATA)
    assert mmlu[0].group == "abstract_algebra" and math[0].group == "Algebra/Level 1"


def test_a_split_names_the_files_it_is_read_from(tmp_path, monkeypatch):
    """What training stage keys hash: the split's files (MMLU's train split also ARC's), or hub names."""
    from tests.test_eval_runs import REPO_DATA

    math = tmp_path / "math" / "train" / "algebra"
    math.mkdir(parents=True)
    (math / "1.json").write_text("{}")
    assert get_task("math").sources("train", tmp_path) == [math / "1.json"]
    mmlu = get_task("mmlu")
    assert [p.name for p in mmlu.sources(mmlu.train_split, REPO_DATA)] == ["auxiliary_train.jsonl", "train.jsonl"]
    monkeypatch.delenv("OPTIMA_DATA_DIR", raising=False)
    assert get_task("gsm8k").sources("train", None) == ["hub:openai/gsm8k/main"]
