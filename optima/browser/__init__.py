"""The conversation browser: `conversations.html` beside a run's `report.md` (or in an evaluation folder).

Per iteration and stage, each question with its conversations (turns, answers, score, tokens, LM loss, reward
parts, kept or dropped and by which rule) and its DPO pairs side by side, with filters and a search box; a static
page that opens from disk. `python -m optima show DIR` writes it; a loop rewrites it after every iteration.
"""

from __future__ import annotations

import dataclasses
import html
import logging
from pathlib import Path

from optima.browser.collect import ConversationView, QuestionView, Section, collect_sections
from optima.browser.render import render_page
from optima.paths import PAGE
from optima.store import atomic_write_text

logger = logging.getLogger(__name__)

LINKED_FILES = ("report.md", "report.png", "summary.csv", "comparison.md", "sc_analysis.md")
# Questions shown per stage output: a paper-scale iteration (2000 questions x 8 conversations) would make a page
# no browser opens comfortably; ``show --max-questions 0`` writes them all.
MAX_QUESTIONS = 300


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
