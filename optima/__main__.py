"""``python -m optima``: set-up, a run's report and conversation browser, the comparison, the recipe keys.

python3 -m optima setup                 # both virtualenvs + the SmolLM2 folder (idempotent)
python3 -m optima setup --only train    # one environment
python -m optima prepare-model smollm2  # convert the embedded model (run inside the training env)
python -m optima report runs/demo_arc_sft  # redraw report.md and report.png of a loop's run directory
python -m optima show runs/demo_arc_sft    # write conversations.html: every conversation, kept or dropped and why
python -m optima compare --model M --dataset_type arc --limit 40 [--methods ...] [--optima NAME=CHECKPOINT]
                                        # baselines and Optima checkpoints on the same questions: one table + plot
python -m optima recipe-keys all [--write docs/recipes.md]  # every recipe key (--write: docs/recipes.md's table)

``setup`` runs with the system's python3 before any environment exists: this module imports only the standard
library and optima's stdlib-only modules at the top.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

from optima.logging_utils import setup_logging
from optima.methods import METHODS

REPO_ROOT = Path(__file__).resolve().parent.parent
logger = logging.getLogger("optima")
# Each recipe's class in optima.config: the training methods' (optima.methods), then the two evaluations'.
RECIPE_CLASSES = {name: method.recipe for name, method in METHODS.items()} | {
    "inference": "InferenceRecipe",
    "multi_sc": "MultiSCRecipe",
}
COMPARE_HELP = "CoT, CoT-SC, MAD, AutoForm and Optima checkpoints on the same questions: table and plot"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m optima", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text)

    setup = command("setup", "create .venvs/train and .venvs/vllm and convert the default model")
    setup.add_argument("--venvs-dir", type=Path, default=REPO_ROOT / ".venvs", help="where the virtualenvs go")
    setup.add_argument("--models-dir", type=Path, default=REPO_ROOT / "models", help="where converted models go")
    setup.add_argument("--only", action="append", choices=["train", "vllm"], help="build only this env")
    setup.add_argument("--no-model", action="store_true", help="skip the model conversion")
    setup.add_argument(
        "--torch-index",
        default=None,
        metavar="URL",
        help="extra package index for torch's CPU build on a machine without an NVIDIA GPU (default: "
        "$OPTIMA_TORCH_INDEX, else https://download.pytorch.org/whl/cpu; '' = none, pip's own configuration only)",
    )
    prep = command("prepare-model", "convert an embedded GGUF model into a Hugging Face folder")
    prep.add_argument("model", choices=["smollm2"])
    prep.add_argument("--models-dir", type=Path, default=REPO_ROOT / "models", help="where converted models go")
    sub.add_parser("compare", add_help=False, help=COMPARE_HELP)  # its own parser reads the rest, --help included
    keys = command("recipe-keys", "list the recipe keys of a method (default and meaning)")
    keys.add_argument("method", choices=[*sorted(RECIPE_CLASSES), "all"])
    keys.add_argument(
        "--write", type=Path, default=None, metavar="DOC", help="replace the table between the markers of DOC instead"
    )
    report = command("report", "redraw report.md and report.png of a loop's run directory (and print it)")
    report.add_argument("run_dir", type=Path, help="the run directory (output_dir of an iSFT/iDPO/iSFT-DPO recipe)")
    show = command("show", "write conversations.html of a run directory or an evaluation folder (opens from disk)")
    show.add_argument("run_dir", type=Path, help="a loop's run directory, or a sweep/compare output folder")
    show.add_argument(
        "--max-questions", type=int, default=None, help="questions shown per stage output (default 300; 0: all)"
    )
    return parser


def render_recipe_keys(method: str) -> str:
    """A Markdown table of the recipe keys of ``method`` (``all``: every method, with a column naming them)."""
    from optima import config

    methods = sorted(RECIPE_CLASSES) if method == "all" else [method]
    rows: dict[str, list] = {}
    for name in methods:
        for f in dataclasses.fields(getattr(config, RECIPE_CLASSES[name])):
            if f.name not in rows:
                rows[f.name] = [_default_text(f), f.metadata.get("help", ""), []]
            rows[f.name][2].append(name)
    head = "| key | default | meaning |" + (" methods |" if method == "all" else "")
    lines = [head, "|---|---|---|" + ("---|" if method == "all" else "")]
    for key, (default, meaning, used) in rows.items():
        extra = f" {', '.join(used)} |" if method == "all" else ""
        lines.append(f"| `{key}` | {default} | {meaning} |{extra}")
    return "\n".join(lines)


def recipe_keys_markers(method: str) -> tuple[str, str]:
    """The comments around the generated key table in a Markdown file (docs/recipes.md)."""
    return f"<!-- recipe-keys {method}: start -->", f"<!-- recipe-keys {method}: end -->"


def write_recipe_keys(doc: Path, method: str) -> None:
    """Replace the key table between ``doc``'s markers with ``render_recipe_keys(method)``."""
    start, end = recipe_keys_markers(method)
    text = doc.read_text()
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise ValueError(f"{doc}: needs one line {start!r} and, after it, one line {end!r}")
    head, rest = text.split(start)
    doc.write_text(f"{head}{start}\n{render_recipe_keys(method)}\n{end}{rest.split(end)[1]}")


def _default_text(f) -> str:
    if f.default is not dataclasses.MISSING:
        return f"`{f.default!r}`"
    if f.default_factory is not dataclasses.MISSING:
        return f"`{f.default_factory()!r}`"
    return "required"


def run_folder_command(args: argparse.Namespace) -> int:
    """``report`` (redraw and print the run's report) or ``show`` (write the folder's conversation page)."""
    try:
        if args.command == "report":
            from optima.reporting import write_run_report

            markdown, _ = write_run_report(args.run_dir)
            text = markdown.read_text()
        else:
            from optima.browser import MAX_QUESTIONS, write_conversations_page

            shown = MAX_QUESTIONS if args.max_questions is None else args.max_questions
            text = str(write_conversations_page(args.run_dir, shown))
    except (FileNotFoundError, ValueError) as exc:
        logger.error("run_dir: %s", exc)
        return 2
    sys.stdout.write(text + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["compare"]:
        from optima.cli.evaluate import run_compare_script

        return run_compare_script(argv[1:])
    args = build_parser().parse_args(argv)
    setup_logging()
    if args.command == "setup":
        from optima.install import SetupError, setup

        model = "" if args.no_model else "smollm2"
        try:
            setup(args.venvs_dir, args.models_dir, only=args.only, model=model, index=args.torch_index)
        except SetupError as error:
            logging.getLogger("optima.install").error("setup stopped: %s", error)
            return 2
    elif args.command == "recipe-keys":
        if args.write is None:
            sys.stdout.write(render_recipe_keys(args.method) + "\n")
            return 0
        try:
            write_recipe_keys(args.write, args.method)
        except ValueError as error:
            logger.error("%s", error)
            return 2
    elif args.command in ("report", "show"):
        return run_folder_command(args)
    else:
        from optima.models import prepare_model

        prepare_model(args.model, args.models_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
