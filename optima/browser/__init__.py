"""The conversation browser: `conversations.html` beside a run's `report.md` (or in an evaluation folder).

Per iteration and stage, each question with its conversations (turns, answers, score, tokens, LM loss, reward
parts, kept or dropped and by which rule) and its DPO pairs side by side, with filters and a search box: one static
page that opens from disk (the CSS and the filter script inline, in `page.html`; every text from a run escaped).
Each conversation and pair is an `.item` whose `data-kept`, `data-answered` and `data-cut` the filters read (also
from the address: `?kept=dropped&cut=yes&q=word`). `python -m optima show DIR` writes it; a loop rewrites it after
every iteration. What it shows is read by `collect`.
"""

from __future__ import annotations

import dataclasses
import html
import logging
from collections.abc import Iterable
from pathlib import Path

from optima.browser.collect import ConversationView, PairView, QuestionView, Section, Turn, collect_sections
from optima.paths import PAGE
from optima.store import atomic_write_text

logger = logging.getLogger(__name__)

LINKED_FILES = ("report.md", "report.png", "summary.csv", "comparison.md", "sc_analysis.md")
# Questions shown per stage output: a paper-scale iteration (2000 questions x 8 conversations) would make a page
# no browser opens comfortably; `show --max-questions 0` writes them all.
MAX_QUESTIONS = 300
TEMPLATE = Path(__file__).with_name("page.html")
PART_ORDER = ("task_score", "token_term", "loss_term", "penalty", "reward")


def esc(value) -> str:
    """Escaped text of any value (quotes too: safe in attributes)."""
    return html.escape(str(value), quote=True)


def number(value) -> str:
    """A short number: 4 significant digits for floats, `-` for none."""
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def chip(text: str, kind: str = "") -> str:
    return f'<span class="chip {kind}">{esc(text)}</span>'


def verdict_chip(kept: bool | None, rule: str) -> str:
    """Kept (green) or dropped (red) with the rule that decided; nothing when no decision applies."""
    if kept is None:
        return chip(rule) if rule else ""
    if kept:
        return chip("kept" if rule in ("", "kept") else f"kept: {rule}", "good")
    return chip(f"dropped: {rule}", "bad")


def kept_value(kept: bool | None) -> str:
    return "" if kept is None else "kept" if kept else "dropped"


def turn_html(turn: Turn) -> str:
    """One utterance bubble: Alice left, Bob right, anyone else (debate agents, CoT) neutral."""
    who = turn.speaker.lower() if turn.speaker in ("Alice", "Bob") else "other"
    extra = [f"{turn.tokens} tok"] if turn.tokens is not None else []
    extra += [f"loss {turn.loss:.3g}"] if turn.loss is not None else []
    note = f'<span class="tok">{esc(", ".join(extra))}</span>' if extra else ""
    return f'<div class="turn {who}"><span class="who">{esc(turn.speaker)}</span>{note}\n{esc(turn.text)}</div>'


def turns_html(turns: Iterable[Turn]) -> str:
    body = "".join(turn_html(t) for t in turns)
    return f'<div class="turns">{body or "<span class=empty>no utterance</span>"}</div>'


def conversation_meta(conv: ConversationView, gold: str) -> list[str]:
    """The chips of a conversation: answer, gold, score, tokens, loss, reward parts, status, verdict."""
    chips = [chip(conv.label, "label"), verdict_chip(conv.kept, conv.rule)]
    answer = conv.final_answer or "no answer"
    chips.append(chip(f"answer: {answer}", "" if conv.final_answer else "warn"))
    chips.append(chip(f"gold: {gold}"))
    if conv.task_score is not None:
        chips.append(chip(f"task score {number(conv.task_score)}", "good" if conv.task_score > 0 else ""))
    chips.append(chip(f"{conv.tokens} tokens"))
    if conv.lm_loss is not None:
        chips.append(chip(f"LM loss {conv.lm_loss:.3g}"))
    for name in PART_ORDER:
        if conv.parts and name in conv.parts and name != "task_score":
            chips.append(chip(f"{name.replace('_', ' ')} {number(conv.parts[name])}"))
    if conv.cut:
        chips.append(chip("cut for length", "warn"))
    status = conv.status + (f" ({conv.stop_reason})" if conv.stop_reason else "")
    chips.append(chip(f"status {status}", "" if conv.status == "ok" else "bad"))
    return [c for c in chips if c]


def conversation_html(conv: ConversationView, gold: str) -> str:
    data = (
        f'data-kept="{kept_value(conv.kept)}" data-answered="{"yes" if conv.answered else "no"}" '
        f'data-cut="{"yes" if conv.cut else "no"}"'
    )
    meta = "".join(conversation_meta(conv, gold))
    return f'<div class="conv item {kept_value(conv.kept)}" {data}><div class="meta">{meta}</div>' + (
        f"{turns_html(conv.turns)}</div>"
    )


def pair_html(pair: PairView) -> str:
    """A DPO pair: its verdict, the shared prefix (collapsed), chosen and rejected side by side."""
    meta = "".join(
        [
            chip(f"pair at node {pair.node_id}, depth {pair.depth}", "label"),
            verdict_chip(pair.kept, pair.rule),
            chip(f"chosen value {number(pair.chosen_value)}"),
            chip(f"rejected value {number(pair.rejected_value)}"),
        ]
    )
    if pair.prefix:
        prefix = f"<details class=prefix><summary>shared prefix: {len(pair.prefix)} utterances</summary>"
        prefix += turns_html(pair.prefix) + "</details>"
    else:
        prefix = "<div class=empty>no shared prefix: the pair is the first utterance</div>"
    sides = (
        f'<div class="sides"><div class="side chosen"><h4>chosen</h4>{turn_html(pair.chosen)}</div>'
        f'<div class="side rejected"><h4>rejected</h4>{turn_html(pair.rejected)}</div></div>'
    )
    kept = kept_value(pair.kept)
    return f'<div class="pair item {kept}" data-kept="{kept}"><div class="meta">{meta}</div>{prefix}{sides}</div>'


def question_html(question: QuestionView, is_open: bool, unit: str = "conversations") -> str:
    counts = [f"{len(question.conversations)} {unit}"] + ([f"{len(question.pairs)} pairs"] * bool(question.pairs))
    summary = (
        f'<span class="qhead"><span class="qid">{esc(question.task_id)}</span>{esc(_first_line(question.question))}'
        f"</span> {chip(', '.join(counts))}" + (f" {chip(question.verdict)}" if question.verdict else "")
    )
    # Pairs first: they are what a DPO stage trains on; the rollouts they were mined from follow.
    items = "".join(pair_html(p) for p in question.pairs)
    items += "".join(conversation_html(c, question.gold) for c in question.conversations)
    body = f'<div class="qtext">{esc(question.question)}</div><div class="items">{items}</div>'
    return f'<details class="question"{" open" if is_open else ""}><summary>{summary}</summary>{body}</details>'


def _first_line(text: str, width: int = 140) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= width else line[: width - 1] + "…"


def unit_of(section: Section) -> str:
    """What a section's conversations are called: the rollouts of a tree search, else conversations."""
    return "rollouts" if section.tag.endswith("search") else "conversations"


def section_stats(section: Section) -> str:
    """One line of counts: questions, conversations, kept, answered, cut, pairs."""
    convs = [c for q in section.questions for c in q.conversations]
    pairs = [p for q in section.questions for p in q.pairs]
    parts = [f"{len(section.questions)} questions", f"{len(convs)} {unit_of(section)}"]
    if any(c.kept is not None for c in convs):
        parts.append(f"{sum(c.kept is True for c in convs)} kept")
    parts += [f"{sum(c.answered for c in convs)} answered", f"{sum(c.cut for c in convs)} cut for length"]
    if pairs:
        parts.append(f"{len(pairs)} pairs ({sum(p.kept for p in pairs)} kept)")
    return " · ".join(parts)


def section_html(section: Section) -> str:
    questions = "".join(question_html(q, i == 0, unit_of(section)) for i, q in enumerate(section.questions))
    if section.left_out:
        note = f"{section.left_out} more questions not shown: python -m optima show DIR --max-questions 0 shows all"
        questions += f"<p class=empty>{esc(note)}</p>"
    return (
        f'<section class="stage" id="{esc(section.anchor)}"><h2>{esc(section.title)}</h2>'
        f'<div class="source">{esc(section.source)} · {esc(section_stats(section))}</div>'
        f"{questions or '<p class=empty>nothing written yet</p>'}</section>"
    )


def nav_html(sections: list[Section]) -> str:
    links = "".join(f'<li><a href="#{esc(s.anchor)}">{esc(s.title)}</a></li>' for s in sections)
    return f"<nav><ul>{links}</ul></nav>"


def render_page(title: str, subtitle: str, sections: list[Section], links: dict[str, str]) -> str:
    """The whole page (`links`: label -> relative address of files beside it, `report.md`...)."""
    link_html = " · ".join(f'<a href="{esc(href)}">{esc(label)}</a>' for label, href in links.items())
    head = esc(subtitle) + (f" · {link_html}" if link_html else "")
    body = nav_html(sections) + "".join(section_html(s) for s in sections)
    if not sections:
        body = "<p class=empty>No conversation has been written yet.</p>"
    page = TEMPLATE.read_text()
    # The body is last: a run's text can never be taken for a placeholder.
    return page.replace("{{title}}", esc(title)).replace("{{subtitle}}", head).replace("{{body}}", body)


def write_conversations_page(
    folder: Path, max_questions: int = MAX_QUESTIONS, sections: list[Section] | None = None
) -> Path:
    """Write (or rewrite) `<folder>/conversations.html` from a run or evaluation folder; return its path.

    Args:
        max_questions: Questions shown per stage output, the first in file order (0: all).
        sections: `collect_sections(folder)` when the caller has read them already (left unchanged).
    """
    folder = Path(folder)
    sections = [_shown(s, max_questions) for s in (collect_sections(folder) if sections is None else sections)]
    questions = sum(len(s.questions) for s in sections)
    conversations = sum(len(q.conversations) for s in sections for q in s.questions)
    subtitle = f"{len(sections)} stage outputs · {questions} questions · {conversations} conversations"
    # A loop's report is written right after this page (publish_iteration): link it even before it exists.
    is_run = any(s.iteration is not None for s in sections)
    links = {name: name for name in LINKED_FILES if (folder / name).is_file() or (is_run and name == "report.md")}
    page = folder / PAGE
    atomic_write_text(page, render_page(f"Optima conversations: {folder.name}", subtitle, sections, links))
    logger.info("conversations | %s (%d questions, %d conversations)", page, questions, conversations)
    return page


def _shown(section: Section, max_questions: int) -> Section:
    """The section as the page shows it: its first `max_questions` questions (0: all), the rest counted."""
    if not max_questions or len(section.questions) <= max_questions:
        return section
    left_out = len(section.questions) - max_questions
    return dataclasses.replace(section, questions=section.questions[:max_questions], left_out=left_out)


def pick_samples(section: Section, count: int) -> list[tuple[QuestionView, ConversationView]]:
    """Up to `count` conversations of a section: a kept one, a dropped one, a cut one, then the first others."""
    every = [(q, c) for q in section.questions for c in q.conversations]
    picks: list[tuple[QuestionView, ConversationView]] = []
    for want in (lambda c: c.kept is True, lambda c: c.kept is False, lambda c: c.cut):
        found = next(((q, c) for q, c in every if want(c) and all(c is not p for _, p in picks)), None)
        picks += [found] if found else []
    picks += [(q, c) for q, c in every if all(c is not p for _, p in picks)]  # then the first ones not taken
    return picks[:count]


def conversation_markdown(question: QuestionView, conv: ConversationView) -> str:
    """A conversation as Markdown for TensorBoard's text tab (escaped: `<A>` is no tag there)."""
    verdict = (
        "" if conv.kept is None else ("kept" if conv.kept else "dropped") + (f" ({conv.rule})" if conv.rule else "")
    )
    facts = [f"answer `{conv.final_answer or '-'}`", f"gold `{question.gold}`", f"{conv.tokens} tokens"]
    if conv.parts:
        facts += [f"{name} {value:.3g}" for name, value in conv.parts.items()]
    facts += [verdict] * bool(verdict) + ["cut for length"] * conv.cut
    turns = [f"**{t.speaker}:** {t.text}" for t in conv.turns]
    lines = [f"**{question.task_id} {conv.label}**: {question.question}", " · ".join(facts), *turns]
    return "\n\n".join(html.escape(line, quote=False) for line in lines)


def sample_conversations(
    run_dir: Path, count: int = 3, sections: list[Section] | None = None
) -> list[tuple[int, str, str]]:
    """`(iteration, tag, markdown)` per stage output of a run folder: up to `count` of its conversations."""
    samples = []
    for section in collect_sections(run_dir) if sections is None else sections:
        picked = pick_samples(section, count)
        if section.iteration is not None and picked:
            text = "\n\n---\n\n".join(conversation_markdown(q, c) for q, c in picked)
            samples.append((section.iteration, f"conversations/{section.tag}", text))
    return samples
