"""The repository documents itself: no citation of documents outside it, and every docs/ reference resolves.

Code, recipes, `--help` and the README explain themselves or point at `docs/method.md` / `docs/cpu.md`
(`docs/<file>.md#<section>`, or `docs/method.md, D<n>` for an entry of its list of differences). These tests
fail on a citation of the project's private planning files and on a reference to a section that does not exist.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = ("sft_script", "dpo_script", "sft_dpo_script", "inference_script", "multi_sc_data_generate_script")
# Spelled in pieces so that this file does not match itself.
_FILES = "|".join(name + r"\.md" for name in ("SPEC", "ENVIRONMENT", "STYLE"))
EXTERNAL = re.compile(rf"({_FILES}|\bSPEC(?: section)? \d|\bpitfall \d)")
# A folder beside the repository (spelled in pieces so that this file does not match itself).
OUTSIDE = re.compile(r"\.\./" + "shared|/work/" + "shared|" + '"shar' + 'ed" / "data"')
DOC_REF = re.compile(r"docs/([a-z_]+)\.md#([A-Za-z0-9_-]+)")
DIFF_REF = re.compile(r"docs/method\.md,?\s+((?:D\d+(?:,\s*|\s+and\s+)?)+)")
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".txt", ".toml", ".cfg", ".jinja", ".json", ".sh"}


def tracked_text_files() -> list[Path]:
    """The repository's text files: `git ls-files` in a checkout, else a walk that skips build outputs."""
    try:
        out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
        paths = [REPO / line for line in out.splitlines()]
    except (OSError, subprocess.CalledProcessError):
        skip = {".venvs", "models", "runs", ".git", "__pycache__"}
        paths = [p for p in REPO.rglob("*") if not skip & set(p.relative_to(REPO).parts)]
    return [p for p in paths if p.is_file() and (p.suffix in TEXT_SUFFIXES or p.name == "Makefile")]


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def outside_code(text: str) -> list[str]:
    """The lines of a Markdown text outside fenced code blocks (a ``# comment`` there is no heading)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(doc: str) -> set[str]:
    """Every heading anchor of docs/<doc>.md."""
    return markdown_anchors(REPO / "docs" / f"{doc}.md")


def markdown_anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file (GitHub numbers repeated headings -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for line in outside_code(path.read_text()):
        if match := re.match(r"#{1,6} (.+)", line):
            base = slug(match[1])
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def difference_ids() -> set[str]:
    return set(re.findall(r"^\* \*\*(D\d+)\.", (REPO / "docs/method.md").read_text(), flags=re.M))


def test_the_patterns_catch_what_they_must():
    cited = [
        "see " + "SPEC" + ".md",
        "(SPEC" + " 9.2 item 14)",
        "ENVIRONMENT" + ".md, pit" + "fall 3",
        "pit" + "fall 2",
    ]
    for text in cited:
        assert EXTERNAL.search(text), text
    for text in ("LLAMA3_SPECIAL_TOKENS", "SPECIAL_TOKENS = [", "docs/cpu.md#launcher"):
        assert not EXTERNAL.search(text), text
    assert slug("Readability") == "readability" and slug("### x") != ""
    assert slug("One process: MULTI_CPU does not run two") == "one-process-multi_cpu-does-not-run-two"


def test_no_file_cites_documents_outside_the_repository():
    hits = []
    for path in tracked_text_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if EXTERNAL.search(line):
                hits.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not hits, "cite docs/method.md or docs/cpu.md instead:\n" + "\n".join(hits)


def test_no_file_names_a_folder_beside_the_repository():
    assert OUTSIDE.search("data_dir: .." + "/shared/data") and OUTSIDE.search('REPO.parent / "sha' + 'red" / "data"')
    hits = []
    for path in tracked_text_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not hits, "read the repository's data/ (or $OPTIMA_DATA_DIR) instead:\n" + "\n".join(hits)


def test_every_dataset_sample_carries_its_licence_and_source():
    folders = sorted(p for p in (REPO / "data").iterdir() if p.is_dir())
    assert {p.name for p in folders} >= {"arc_challenge", "hotpotqa", "gsm8k", "math", "mmlu", "cbt"}
    for folder in folders:
        source = (folder / "SOURCE.md").read_text()
        assert "**In this repository:**" in source and re.search(r"licen[cs]e", source, re.I), folder.name
    assert all(f"`{p.name}/`" in (REPO / "data/README.md").read_text() for p in folders)


# Each make target that states a time, and the recipe that states it too.
TIMED_TARGETS = {"demo": "train/sft_recipes/demo_arc.yaml", "demo-hotpot": "train/sft_recipes/demo_hotpot_qa.yaml",
                 "test": None}  # fmt: skip


def stated_minutes(text: str, target: str) -> set[str]:
    """The "about N min" of every line naming `make <target>` (or of the line after it, for wrapped lines)."""
    lines = text.splitlines()
    found = set()
    for number, line in enumerate(lines):
        if re.search(rf"make {re.escape(target)}(?![\w-])", line):
            window = line + " " + (lines[number + 1] if number + 1 < len(lines) else "")
            found |= set(re.findall(r"make [\w-]+(?:(?!make ).)*?about (\d+) min", window)[:1])
    return found


def test_readme_makefile_and_recipes_state_one_time_per_target():
    makefile, readme = (REPO / "Makefile").read_text(), (REPO / "README.md").read_text()
    assert stated_minutes("x make demo: about 3 min\n", "demo") == {"3"} and not stated_minutes("make demo", "test")
    for target, recipe in TIMED_TARGETS.items():
        (minutes,) = stated_minutes(makefile, target)
        assert stated_minutes(readme, target) == {minutes}, target
        if recipe:
            assert f"about {minutes} min" in (REPO / recipe).read_text().split("\n", 3)[1], recipe


def test_every_docs_reference_resolves():
    known = {path.stem: anchors(path.stem) for path in (REPO / "docs").glob("*.md")}
    ids = difference_ids()
    assert {f"D{n}" for n in range(1, len(ids) + 1)} == ids, "differences are numbered D1..Dn without gaps"
    broken = []
    for path in tracked_text_files():
        text = path.read_text(errors="replace")
        for doc, anchor in DOC_REF.findall(text):
            if anchor not in known.get(doc, set()):
                broken.append(f"{path.relative_to(REPO)}: docs/{doc}.md#{anchor}")
        for group in DIFF_REF.findall(text):
            broken += [f"{path.relative_to(REPO)}: {d}" for d in re.findall(r"D\d+", group) if d not in ids]
    assert not broken, "references to missing sections:\n" + "\n".join(broken)


def test_files_the_docs_name_exist():
    for doc in sorted(path.stem for path in (REPO / "docs").glob("*.md")):
        text = (REPO / "docs" / f"{doc}.md").read_text()
        named = set(re.findall(r"\b((?:optima|alignment-handbook|tests|bench)/[\w/.-]*\w)", text))
        assert named, doc
        missing = [p for p in sorted(named) if "<" not in p and not (REPO / p).exists()]
        assert not missing, f"docs/{doc}.md names files that do not exist: {missing}"


def test_docs_are_linked_from_the_readme():
    readme = (REPO / "README.md").read_text()
    missing = [p.name for p in sorted((REPO / "docs").glob("*.md")) if f"](docs/{p.name})" not in readme]
    assert not missing, f"README.md's documentation index lacks {missing}"


README_LIMIT = 10 * 1024  # bytes: the README is a front door; everything else lives in docs/


def test_readme_is_a_front_door():
    readme = (REPO / "README.md").read_text()
    size = len(readme.encode())
    assert size <= README_LIMIT, f"README.md is {size} bytes (limit {README_LIMIT}): move detail into docs/"
    for needed in ("make demo", "make test", "Python >= 3.11", *(f"{name}.py" for name in SCRIPTS)):
        assert needed in readme, needed


LINK = re.compile(r"\]\(([^()\s]+)\)")


def broken_links(path: Path) -> list[str]:
    """Relative links of a Markdown file whose file or ``#anchor`` (a heading of the target) does not exist."""
    broken = []
    for line in outside_code(path.read_text()):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            file, _, anchor = target.partition("#")
            resolved = (path.parent / file).resolve() if file else path
            if not resolved.exists():
                broken.append(f"{path.relative_to(REPO)}: {target} (no file {file})")
            elif anchor and resolved.suffix == ".md" and anchor not in markdown_anchors(resolved):
                broken.append(f"{path.relative_to(REPO)}: {target} (no heading #{anchor} in {file or path.name})")
    return broken


def test_the_link_check_sees_a_missing_file_and_a_missing_heading(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (tmp_path / "a.md").write_text("# Top\n## Two words\n```\n# not a heading\n[x](nowhere.md)\n```\n")
    (tmp_path / "b.md").write_text(
        "[ok](a.md#two-words) [ok](#b) [ok](https://x.org/y) ![ok](a.md)\n# B\n"
        "[bad](a.md#not-a-heading) [bad](c.md) [bad](#top)\n"
    )
    assert broken_links(tmp_path / "a.md") == []
    assert broken_links(tmp_path / "b.md") == [
        "b.md: a.md#not-a-heading (no heading #not-a-heading in a.md)",
        "b.md: c.md (no file c.md)",
        "b.md: #top (no heading #top in b.md)",
    ]


def test_every_relative_link_of_the_readme_and_docs_resolves():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    broken = [entry for page in pages for entry in broken_links(page)]
    assert not broken, "links to missing files or headings:\n" + "\n".join(broken)


def test_the_recipe_key_table_of_docs_recipes_is_current():
    """docs/recipes.md holds, between its markers, what `python -m optima recipe-keys all` prints."""
    from optima.__main__ import recipe_keys_markers, render_recipe_keys

    start, end = recipe_keys_markers("all")
    text = (REPO / "docs/recipes.md").read_text()
    assert text.count(start) == 1 and text.count(end) == 1, f"docs/recipes.md lacks the lines {start} / {end}"
    table = text.split(start)[1].split(end)[0].strip()
    assert table == render_recipe_keys("all"), (
        "docs/recipes.md's key table is out of date: rewrite it with "
        "`python -m optima recipe-keys all --write docs/recipes.md`"
    )


def test_recipe_keys_write_replaces_only_the_table(tmp_path):
    from optima.__main__ import main, render_recipe_keys

    doc = tmp_path / "keys.md"
    doc.write_text("# Keys\nbefore\n<!-- recipe-keys sft: start -->\n| old |\n<!-- recipe-keys sft: end -->\nafter\n")
    assert main(["recipe-keys", "sft", "--write", str(doc)]) == 0
    assert doc.read_text() == (
        "# Keys\nbefore\n<!-- recipe-keys sft: start -->\n"
        + render_recipe_keys("sft")
        + "\n<!-- recipe-keys sft: end -->\nafter\n"
    )
    doc.write_text("no markers\n")
    assert main(["recipe-keys", "sft", "--write", str(doc)]) == 2 and doc.read_text() == "no markers\n"


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_texts_cite_nothing_outside(name, capsys):
    with pytest.raises(SystemExit):
        importlib.import_module(name).main(["--help"])
    out = capsys.readouterr().out
    assert out and not EXTERNAL.search(out)


def test_recipe_key_help_cites_nothing_outside():
    from optima.__main__ import render_recipe_keys

    text = render_recipe_keys("all")
    assert "compat" in text and not EXTERNAL.search(text)
