"""The conversation browser: conversations.html of a run directory and of an evaluation folder.

The run directory is written by the real writers (tests/browser_run.py); the checks read the page's HTML and the
JSONL files the page was built from, side by side: every conversation is there with its verdict and rule, text is
escaped, every pair shows its chosen and rejected continuation, the report links the page.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from optima.__main__ import main as optima_main
from optima.agents.conversation import GenerationSettings
from optima.agents.generation import generate_conversations
from optima.browser import sample_conversations, write_conversations_page
from optima.paths import PAGE, RunPaths
from optima.reporting import publish_iteration
from optima.store import load_records
from optima.tracking import write_tensorboard_scalars
from tests.browser_run import HOSTILE, build_browser_run, build_recipe, scripted_reply
from tests.fake_openai import FakeOpenAIServer
from tests.helpers import arc_examples


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return build_browser_run(tmp_path_factory.mktemp("browser") / "run")


@pytest.fixture(scope="module")
def page(run) -> str:
    return write_conversations_page(run).read_text()


def section(page: str, anchor: str) -> str:
    """The HTML of one section (by its id)."""
    start = page.index(f'<section class="stage" id="{anchor}">')
    return page[start : page.index("</section>", start)]


def chunks(text: str, marker: str) -> list[str]:
    """The pieces of ``text`` that start with ``marker`` (one per item), in order."""
    return [marker + piece for piece in text.split(marker)[1:]]


def test_every_conversation_is_on_the_page_with_its_verdict_and_rule(run, page):
    sp = RunPaths(run).stage(0, "sft")
    rewarded = load_records(sp.rewarded)[0]
    decisions = {d["task_id"]: d for d in load_records(sp.selection_record)[0]}
    items = chunks(section(page, "iteration-0-sft-sampled"), '<div class="conv item')
    results = [(line["task_id"], r) for line in rewarded for r in line["results"]]
    assert len(items) == len(results) == 8
    seen_rules = set()
    for item, (task_id, record) in zip(items, results, strict=True):
        decision = decisions[task_id]
        if record["sample_index"] == decision["sample_index"]:
            expected = "kept" if decision["kept"] else f"dropped: {decision['reason']}"
        else:
            expected = f"dropped: {decision['dropped'][str(record['sample_index'])]}"
        seen_rules.add(expected)
        assert f">{html.escape(expected, quote=True)}</span>" in item
        for utterance in record["utterances"]:
            assert html.escape(utterance["text"], quote=True) in item
        assert f"answer: {html.escape(record['final_answer'] or 'no answer')}" in item
        assert f"{record['token_count']} tokens" in item and "gold: B) 4" in item  # the option, label and text
        assert f"reward {record['reward']:.4g}" in item
        assert f"token term {record['reward_parts']['token_term']:.4g}" in item
        assert ('data-cut="yes"' in item) == (record["status"] == "too_long")
    # The fixture exercises every rule: kept, outside the slice, not the best, unfinished.
    assert {"kept", "dropped: outside rank slice", "dropped: not the question's best"} <= seen_rules
    assert "dropped: unfinished (status too_long)" in seen_rules


def test_probe_and_rollouts_are_there_too(run, page):
    sp = RunPaths(run).stage(0, "dpo")
    probes = load_records(sp.probe)[0]
    rollouts = [r for line in load_records(sp.rollouts)[0] for r in line["rollouts"]]
    assert len(chunks(section(page, "iteration-0-dpo-probe"), '<div class="conv item')) == len(probes) == 2
    search = section(page, "iteration-0-dpo-search")
    assert len(chunks(search, '<div class="conv item')) == len(rollouts)
    assert page.count('<div class="conv item') == 8 + len(probes) + len(rollouts)


def test_text_from_the_run_is_escaped(page):
    assert "<script>alert" not in page
    assert html.escape(HOSTILE, quote=True) in page
    assert "&lt;A&gt;B&lt;/A&gt;" in page and "<A>B</A>" not in page


def test_pairs_show_the_prefix_and_both_continuations(run, page):
    sp = RunPaths(run).stage(0, "dpo")
    trees = {line["task_id"]: line for line in load_records(sp.rollouts)[0]}
    records = load_records(sp.selection_record)[0]
    entries = [(r["task_id"], pair) for r in records for pair in r["pairs"]]
    items = chunks(section(page, "iteration-0-dpo-search"), '<div class="pair item')
    assert len(items) == len(entries) > 2 and {p["kept"] for _, p in entries} == {True, False}
    for item, (task_id, pair) in zip(items, entries, strict=True):
        chosen_side = item[item.index('class="side chosen"') : item.index('class="side rejected"')]
        rejected_side = item[item.index('class="side rejected"') :]
        children = [n for n in trees[task_id]["nodes"] if n["parent"] == pair["node_id"]]
        # The texts shown are those of the children whose values the pair recorded.
        assert any(n["value"] == pair["chosen_value"] and html.escape(n["text"]) in chosen_side for n in children)
        assert any(n["value"] == pair["rejected_value"] and html.escape(n["text"]) in rejected_side for n in children)
        prefix = f"shared prefix: {pair['depth']} utterances" if pair["depth"] else "no shared prefix"
        assert prefix in item
        verdict = "kept" if pair["kept"] else "dropped: outside dpo_keep_fraction"
        assert f'data-kept="{"kept" if pair["kept"] else "dropped"}"' in item and f">{verdict}</span>" in item


def test_page_is_self_contained_with_filters(page):
    for control in ('id="f-kept"', 'id="f-answered"', 'id="f-cut"', 'id="f-search"'):
        assert control in page
    assert "http://" not in page and "https://" not in page and "<link" not in page and "src=" not in page


def test_report_links_the_page_rewritten_after_each_iteration(run):
    page = run / PAGE
    page.unlink(missing_ok=True)
    publish_iteration(run, [])  # what the driver calls after every iteration
    assert page.is_file() and f"]({PAGE})" in (run / "report.md").read_text()
    assert '<a href="report.md">report.md</a>' in page.read_text()


def test_show_command_writes_the_page_and_names_it(run, capfd):
    (run / PAGE).unlink(missing_ok=True)
    assert optima_main(["show", str(run)]) == 0
    assert capfd.readouterr().out.strip() == str(run / PAGE) and (run / PAGE).is_file()
    assert optima_main(["show", str(run / "missing")]) == 2
    assert "is not a directory" in capfd.readouterr().err


def test_tensorboard_gets_a_few_conversations_per_stage_output(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    samples = sample_conversations(run, count=3)
    assert [(step, tag) for step, tag, _ in samples] == [
        (0, "conversations/sft/sampled"),
        (0, "conversations/dpo/probe"),
        (0, "conversations/dpo/search"),
    ]
    sampled = samples[0][2]
    assert sampled.count("\n---\n") == 2 and "kept (kept)" in sampled and "dropped (" in sampled
    assert "cut for length" in sampled and "&lt;A&gt;B&lt;/A&gt;" in sampled
    folder = write_tensorboard_scalars(run, [], samples)
    events = EventAccumulator(str(folder))
    events.Reload()
    # tensorboardX's add_text files each text under "<tag>/text_summary"
    assert sorted(events.Tags()["tensors"]) == sorted(f"{tag}/text_summary" for _, tag, _ in samples)
    (event,) = events.Tensors("conversations/sft/sampled/text_summary")
    assert event.step == 0 and event.tensor_proto.string_val[0].decode() == sampled


def test_an_evaluation_folder_gets_the_same_view(tmp_path):
    from optima.evaluation.baselines import generate_cot_answers

    out = tmp_path / "eval"
    examples = arc_examples(3)
    with FakeOpenAIServer(scripted_reply) as server:
        recipe = build_recipe(tmp_path / "unused", server.port)
        generation = GenerationSettings(0, 0.0, 1, stage="eval")
        generate_conversations(recipe, examples, [server.base_url], out / "iteration_1.jsonl", generation)
        generate_cot_answers(recipe, examples, [server.base_url], out / "base.cot.jsonl", generation)
    (out / "summary.json").write_text(json.dumps({"models": []}))
    page = write_conversations_page(out).read_text()
    titles = [piece.split("</h2>")[0] for piece in page.split("<h2>")[1:]]
    assert titles == ["CoT · base", "Optima · after iteration 2"]
    for name in ("iteration_1.jsonl", "base.cot.jsonl"):
        for record in load_records(out / name)[0]:
            for utterance in record["utterances"]:
                assert html.escape(utterance["text"], quote=True) in page
    assert page.count('<div class="conv item') == 6 and "task score 1" in page and "task score 0" in page


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
requires_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no chromium (Debian: apt-get install chromium)")


def chromium(profile: Path, *args: str) -> str:
    """Run headless Chromium once (no network, no GPU, its own profile); return its stdout."""
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}"]  # fmt: skip
    done = subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=180, check=True)
    return done.stdout


def shown_items(dom: str) -> list[str]:
    """The opening tags of the conversations and pairs the script left visible."""
    return [tag for tag in re.findall(r'<div class="(?:conv|pair) item[^>]*>', dom) if " hidden" not in tag]


@pytest.mark.slow  # ~20 s: three headless Chromium runs
@requires_chromium
def test_the_page_renders_and_filters_in_a_real_browser(run, page, tmp_path):
    url = (run / PAGE).as_uri()
    total = page.count('<div class="conv item') + page.count('<div class="pair item')
    dom = chromium(tmp_path / "p1", "--dump-dom", url)
    assert f'id="count">{total} of {total} conversations and pairs shown<' in dom  # the script ran
    assert len(shown_items(dom)) == total and "&lt;script&gt;alert" in dom
    dropped = chromium(tmp_path / "p2", "--dump-dom", url + "?kept=dropped&cut=yes")
    visible = shown_items(dropped)
    assert visible and all('data-kept="dropped"' in tag and 'data-cut="yes"' in tag for tag in visible)
    assert len(visible) == page.count('data-kept="dropped" data-answered="no" data-cut="yes"') + page.count(
        'data-kept="dropped" data-answered="yes" data-cut="yes"'
    )
    shot = tmp_path / "page.png"
    chromium(tmp_path / "p3", "--window-size=1280,1400", f"--screenshot={shot}", url)
    from matplotlib import image

    pixels = image.imread(shot)[..., :3]
    assert pixels.shape[:2] == (1400, 1280)
    colours = {tuple(p) for p in (pixels[::7, ::7].reshape(-1, 3) * 255).round().astype(int)}
    assert len(colours) > 50  # text, chips and bubbles: not a blank or single-colour page
    assert tuple((pixels[5, 5] * 255).round().astype(int)) == (0x1F, 0x3A, 0x5F)  # the header band was painted


def test_a_record_the_page_cannot_read_does_not_stop_the_run(tmp_path, caplog):
    run = tmp_path / "run"
    (run / "iteration_0").mkdir(parents=True)
    (run / "iteration_0" / "generations.jsonl").write_text(json.dumps({"task_id": "q0", "sample_index": 0}) + "\n")
    publish_iteration(run, ["tensorboard"])
    assert (run / "report.md").is_file() and not (run / PAGE).exists()
    assert "could not write the conversation browser" in caplog.text


def test_a_stage_still_scoring_shows_its_unscored_questions_too(run, tmp_path):
    copy = shutil.copytree(run, tmp_path / "run")
    sp = RunPaths(copy).stage(0, "sft")
    sp.rewarded.write_text("".join(sp.rewarded.read_text().splitlines(keepends=True)[:2]))  # killed while scoring
    sp.selection_record.unlink()
    sampled = section(write_conversations_page(copy).read_text(), "iteration-0-sft-sampled")
    assert sampled.count('<div class="conv item') == 8 and sampled.count('<details class="question"') == 4
    assert sampled.count("loss term") == 4 and "dropped" not in sampled  # two scored questions, none selected


def test_the_page_keeps_a_size_limit_that_the_command_lifts(run, capfd):
    sampled = section(write_conversations_page(run, max_questions=1).read_text(), "iteration-0-sft-sampled")
    assert sampled.count('<details class="question"') == 1 and "3 more questions not shown" in sampled
    assert optima_main(["show", str(run), "--max-questions", "0"]) == 0
    assert section((run / PAGE).read_text(), "iteration-0-sft-sampled").count('<details class="question"') == 4


def test_publish_iteration_reads_the_stage_outputs_once_for_the_page_and_the_samples(run, tmp_path, monkeypatch):
    """The page trims what it shows (``MAX_QUESTIONS``) without trimming what the trackers sample from."""
    import optima.reporting

    copy = shutil.copytree(run, tmp_path / "run")
    (copy / "iteration_0" / "sft" / "metrics.json").write_text('{"iteration": 0, "stages": {}}')  # a report row
    reads = []
    real = optima.reporting.collect_sections
    monkeypatch.setattr(optima.reporting, "collect_sections", lambda folder: reads.append(folder) or real(folder))
    sections = real(copy)
    write_conversations_page(copy, max_questions=1, sections=sections)
    assert all(s.left_out == 0 for s in sections)  # the caller's sections are left as they were
    publish_iteration(copy, ["tensorboard"])
    assert reads == [copy]
    assert (copy / PAGE).is_file() and any((copy / "tensorboard").rglob("events.out.tfevents.*"))
