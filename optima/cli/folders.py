"""``python -m optima report`` and ``show``: redraw a run's report, write a folder's conversation browser."""

from __future__ import annotations

from optima.cli.common import emit, guarded
from optima.config import RecipeError


def run_report_command(run_dir) -> int:
    """``python -m optima report RUN_DIR``: redraw the run's ``report.md``/``report.png`` and print the Markdown."""
    from optima.reporting import write_run_report

    def body() -> int:
        try:
            markdown, _ = write_run_report(run_dir)
        except (FileNotFoundError, ValueError) as exc:
            raise RecipeError("run_dir", str(exc)) from exc
        emit(markdown.read_text())
        return 0

    return guarded(body)


def run_show_command(folder, max_questions: int | None = None) -> int:
    """``python -m optima show DIR``: write ``DIR/conversations.html`` and print its path."""
    from optima.browser import MAX_QUESTIONS, write_conversations_page

    def body() -> int:
        try:
            page = write_conversations_page(folder, MAX_QUESTIONS if max_questions is None else max_questions)
        except (FileNotFoundError, ValueError) as exc:
            raise RecipeError("run_dir", str(exc)) from exc
        emit(str(page))
        return 0

    return guarded(body)
