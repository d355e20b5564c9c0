"""The documentation: README.md stays short (the rest is the mkdocs site in docs/), the site builds
with no broken link or page, every command-line option is on docs/command-line.md, and the module
map in docs/architecture.md is the tree's."""

import argparse
import re
import subprocess
import sys

import pytest

from conftest import ROOT

DOCS = ROOT / "docs"
README_LIMIT = 12 * 1024  # bytes


def test_the_readme_stays_short():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes (at most {README_LIMIT}): move sections to docs/"


def test_the_site_builds_strictly(tmp_path):
    """`mkdocs build --strict`: a broken link, a missing page or image, a page left out of the build
    is an error, not a warning."""
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site"),
                           "--config-file", str(ROOT / "mkdocs.yml")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "command-line" / "index.html").exists()


def test_every_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(p.name for p in DOCS.glob("*.md"))
    assert pages and [p for p in pages if f" {p}" not in nav] == []


def option_strings(parser: argparse.ArgumentParser):
    """Every option string of `parser` and of its subcommands' parsers."""
    for action in parser._actions:
        yield from action.option_strings
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from option_strings(sub)


def first_cells(markdown: str) -> str:
    """The first column of every table row (escaped pipes kept inside the cell)."""
    return "\n".join(re.findall(r"^\| ((?:[^|\\]|\\.)*) \|", markdown, re.M))


def flag_section(heading: str) -> str:
    page = (DOCS / "command-line.md").read_text()
    sections = re.split(r"^## ", page, flags=re.M)
    return next(s for s in sections if s.startswith(heading + "\n"))


@pytest.mark.parametrize("heading", ["run-trinity", "trinity-launch"])
def test_every_option_is_documented(heading):
    """Each parser's options are in its section's tables on docs/command-line.md, so no flag goes
    undocumented (and the page names no flag the parser lacks)."""
    if heading == "run-trinity":
        from distributed.command_line import build_parser
    else:
        from launch.cli import build_parser
    options = set(option_strings(build_parser()))
    cells = first_cells(flag_section(heading))
    missing = sorted(o for o in options if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", cells))
    assert missing == [], f"options not on docs/command-line.md, section {heading}: {missing}"
    documented = {m for code in re.findall(r"`([^`]*)`", cells) for m in re.findall(r"(?<![\w-])--?[a-z][\w-]*", code)}
    assert documented - options == set(), f"flags on the page that {heading} does not have"


def module_map():
    page = (DOCS / "architecture.md").read_text()
    section = page[page.index("## Module map"):]
    return re.findall(r"^- `((?:distributed|launch)/[\w/]+\.py)`: \S", section, re.M)


def test_the_module_map_is_the_tree():
    listed = module_map()
    tree = sorted(str(p.relative_to(ROOT)) for folder in ("distributed", "launch") for p in (ROOT / folder).rglob("*.py")
                  if "__pycache__" not in p.parts)
    assert len(listed) == len(set(listed)), "a module listed twice"
    assert sorted(set(tree) - set(listed)) == [], "modules missing from docs/architecture.md's module map"
    assert sorted(set(listed) - set(tree)) == [], "listed in docs/architecture.md but not in the tree"


def slug(heading: str) -> str:
    """A heading's anchor, as mkdocs' toc and GitHub make it (for the headings these pages use)."""
    return re.sub(r"\s+", "-", re.sub(r"[^\w\s-]", "", heading.strip().lower()))


def test_the_readme_links_to_pages_and_headings_that_exist():
    links = re.findall(r"\]\(([^)\s]+)\)", (ROOT / "README.md").read_text())
    local = [link for link in links if not re.match(r"\w+://", link)]
    assert any(link.startswith("docs/") for link in local)
    for link in local:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.exists(), link
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), re.M)
            assert anchor in {slug(h) for h in headings}, link


def test_the_module_map_names_each_folder_once():
    page = (DOCS / "architecture.md").read_text()
    folders = re.findall(r"^\*\*`([\w/]+)`\*\*$", page[page.index("## Module map"):], re.M)
    assert folders and len(folders) == len(set(folders)), f"a folder's heading repeated: {folders}"


def test_a_requests_life_names_modules_that_exist_once_each():
    """docs/request-life.md's picture: every module it names is in distributed/, and named once."""
    page = (DOCS / "request-life.md").read_text()
    picture = re.search(r"^```\n(.*?)^```", page, re.S | re.M).group(1)
    named = re.findall(r"\b((?:serving|runtime|shard|transport|startup)/\w+\.py)\b", picture)
    assert len(named) >= 10
    assert [m for m in named if not (ROOT / "distributed" / m).exists()] == [], "the picture names a module not in the tree"
    assert len(named) == len(set(named)), f"a module named twice: {named}"
