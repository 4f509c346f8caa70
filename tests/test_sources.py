"""The dataset loaders on the real `datasets` library, with local folders laid out like each hub repository.

A hub dataset repository (``openai/gsm8k``, ``allenai/ai2_arc``, ...) is a dataset card whose YAML header lists
the configs and their data files (``<config>/<split>-<shard>-of-<n>.parquet``), the layout that
``datasets.push_to_hub`` writes and that ``huggingface-cli download`` reproduces. Each test builds that layout in
a temporary folder from the local samples (rows converted to the hub's columns where the local copy keeps the
original release's schema), loads it through the task's own loader, which calls the real
``datasets.load_dataset``, and compares the examples with those loaded from the local JSON Lines files.
The original release layouts (2WikiMultiHopQA ``<split>.json`` arrays, the MATH folder of per-problem files)
are read too; other files fail with a message that says how to convert them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from optima.tasks import DataError, get_task
from tests._task_fixtures import resolve_test_data_dir

DATA = resolve_test_data_dir()
ROWS_PER_SPLIT = 24


@pytest.fixture(autouse=True)
def offline_datasets(tmp_path, monkeypatch):
    """The real `datasets`, offline, with its cache inside the test's folder."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.delenv("OPTIMA_DATA_DIR", raising=False)


def local_rows(folder: str, split_file: str, limit: int = ROWS_PER_SPLIT) -> list[dict]:
    with (DATA / folder / split_file).open(encoding="utf-8") as handle:
        return [json.loads(line) for _, line in zip(range(limit), handle, strict=False)]


def write_hub_copy(folder: Path, configs: dict[str, dict[str, list[dict]]], shards: int = 1) -> Path:
    """A dataset repository as on the hub: card with ``configs:`` + ``<config>/<split>-0000i-of-0000n.parquet``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    card = ["---", "configs:"]
    for config, splits in configs.items():
        card += [f"- config_name: {config}", "  data_files:"]
        for split, rows in splits.items():
            card += [f"  - split: {split}", f"    path: {config}/{split}-*"]
            (folder / config).mkdir(parents=True, exist_ok=True)
            size = -(-len(rows) // shards)
            for shard in range(shards):
                table = pa.Table.from_pylist(rows[shard * size : (shard + 1) * size])
                pq.write_table(table, folder / config / f"{split}-{shard:05d}-of-{shards:05d}.parquet")
    (folder / "README.md").write_text("\n".join([*card, "---", "", "# dataset card", ""]))
    return folder


def hotpot_hub_row(row: dict) -> dict:
    """An original HotpotQA record in the hub's columns (``id``, column-wise ``context`` and facts)."""
    return {
        "id": row["_id"],
        "question": row["question"],
        "answer": row["answer"],
        "type": row["type"],
        "level": row["level"],
        "supporting_facts": {"title": [t for t, _ in row["supporting_facts"]],
                             "sent_id": [i for _, i in row["supporting_facts"]]},
        "context": {"title": [t for t, _ in row["context"]], "sentences": [s for _, s in row["context"]]},
    }  # fmt: skip


def same_examples(name: str, hub_root: Path, split: str, local_root: Path = DATA) -> list:
    hub = get_task(name).load(split, data_dir=hub_root, seed=3)
    local = get_task(name).load(split, data_dir=local_root, seed=3)[: len(hub)]
    assert hub and hub == local
    return hub


def test_gsm8k_main_config(tmp_path):
    train, test = local_rows("gsm8k", "train.jsonl"), local_rows("gsm8k", "test.jsonl")
    other = [{"question": "not this config", "answer": "#### 0"}]
    write_hub_copy(tmp_path / "gsm8k", {"main": {"train": train, "test": test}, "socratic": {"train": other}})
    examples = same_examples("gsm8k", tmp_path, "test")
    assert len(examples) == ROWS_PER_SPLIT and re.fullmatch(r"-?[\d.,]+", examples[0].answer)
    assert len(get_task("gsm8k").load_train(data_dir=tmp_path)) == ROWS_PER_SPLIT


def test_arc_challenge_config(tmp_path):
    test = local_rows("arc_challenge", "test.jsonl")
    easy = [dict(test[0], id="easy-1", question="an easy one")]
    write_hub_copy(tmp_path / "arc_challenge", {"ARC-Challenge": {"test": test}, "ARC-Easy": {"test": easy}})
    examples = same_examples("arc", tmp_path, "test")
    assert examples[0].id == test[0]["id"] and examples[0].options


def test_mmlu_all_config_auxiliary_train_and_test(tmp_path):
    aux, test = local_rows("mmlu", "auxiliary_train.jsonl"), local_rows("mmlu", "test.jsonl")
    # cais/mmlu also has one folder per subject config, including one named like the train split
    write_hub_copy(
        tmp_path / "mmlu", {"all": {"auxiliary_train": aux, "test": test}, "auxiliary_train": {"train": aux}}
    )
    same_examples("mmlu", tmp_path, "test")
    assert len(get_task("mmlu").load("auxiliary_train", data_dir=tmp_path)) == len(aux)


def test_hotpot_qa_distractor_config_in_two_shards(tmp_path):
    rows = local_rows("hotpotqa", "validation.jsonl")
    write_hub_copy(tmp_path / "hotpotqa", {"distractor": {"validation": [hotpot_hub_row(r) for r in rows]}}, shards=2)
    examples = same_examples("hotpot_qa", tmp_path, "validation")
    assert len(examples) == len(rows) and examples[-1].id == rows[-1]["_id"]  # shards read in order
    assert examples[0].context_first and examples[0].context_second


def test_trivia_qa_rc_config(tmp_path):
    rows = local_rows("triviaqa", "validation.rc.wikipedia.nocontext.jsonl")
    write_hub_copy(tmp_path / "triviaqa", {"rc": {"validation": rows}}, shards=2)
    examples = same_examples("trival_qa", tmp_path, "validation")
    assert examples[0].answer[0] == rows[0]["answer"]["value"]


def test_cbt_configs_share_one_repository_folder(tmp_path):
    configs = {c: {s: local_rows(f"cbt/{c}", f"{s}.jsonl") for s in ("train", "test")} for c in ("CN", "NE")}
    write_hub_copy(tmp_path / "cbt", configs)  # the task folders cbt/CN and cbt/NE are configs of cbt/
    assert same_examples("cbt", tmp_path, "test")[0].context_first
    ne = get_task("cbt_ne").load("test", data_dir=tmp_path)
    assert ne == get_task("cbt_ne").load("test", data_dir=DATA)


SUBJECT_OF_TYPE = {
    "Counting & Probability": "counting_and_probability",
    "Intermediate Algebra": "intermediate_algebra",
    "Number Theory": "number_theory",
}


def subject(row: dict) -> str:
    return SUBJECT_OF_TYPE.get(row["type"], row["type"].lower())


def test_hendrycks_math_one_config_per_subject(tmp_path):
    rows = local_rows("math", "test.jsonl", limit=500)  # every subject occurs
    configs: dict[str, dict[str, list[dict]]] = {}
    for row in rows:
        configs.setdefault(subject(row), {"test": []})["test"].append(row)
    write_hub_copy(tmp_path / "math", configs)
    hub = get_task("math").load("test", data_dir=tmp_path)
    local = get_task("math").load("test", data_dir=DATA)[: len(rows)]
    # the hub path concatenates the subject configs, so the order differs; the problems are the same
    assert sorted((e.question, e.answer) for e in hub) == sorted((e.question, e.answer) for e in local)


def test_math_release_folder_of_per_problem_files(tmp_path):
    rows = local_rows("math", "test.jsonl", limit=30)
    for index, row in enumerate(rows):
        path = tmp_path / "math" / "test" / subject(row) / f"{index}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(row))
    examples = get_task("math").load("test", data_dir=tmp_path)
    assert len(examples) == len({e.id for e in examples}) and examples[0].id.startswith("test/algebra/")
    local = get_task("math").load("test", data_dir=DATA)[: len(rows)]
    assert sorted((e.question, e.answer) for e in examples) == sorted((e.question, e.answer) for e in local)


def test_2wiki_release_json_arrays(tmp_path):
    rows = local_rows("2wikimultihopqa", "dev.jsonl")
    (tmp_path / "2wikimultihopqa").mkdir()
    (tmp_path / "2wikimultihopqa" / "dev.json").write_text(json.dumps(rows))
    examples = same_examples("mwh_qa", tmp_path, "dev")
    assert examples[0].id == rows[0]["_id"]


def test_unreadable_layouts_say_how_to_convert(tmp_path):
    (tmp_path / "2wikimultihopqa").mkdir()
    (tmp_path / "2wikimultihopqa" / "dev.json").write_text('{"_id": "a"}\n{"_id": "b"}\n')  # JSON Lines named .json
    with pytest.raises(DataError, match="JSON Lines"):
        get_task("mwh_qa").load("dev", data_dir=tmp_path)
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "train.csv").write_text("question,answer\n")
    with pytest.raises(DataError, match=r"hub copy.*holds: train.csv.*JSON Lines"):
        get_task("gsm8k").load("train", data_dir=tmp_path)


def test_a_missing_config_of_a_hub_copy_is_a_data_error(tmp_path):
    write_hub_copy(tmp_path / "gsm8k", {"socratic": {"test": [{"question": "q", "answer": "#### 1"}]}})
    with pytest.raises(DataError, match="config main"):
        get_task("gsm8k").load("test", data_dir=tmp_path)
