"""`python -m bench`: its help and every subcommand's work, the docs name only commands its parser
takes, and its functions fit a screen as the product's do."""

import ast
import re
import shlex
import subprocess
import sys

import pytest

from bench.__main__ import build_parser
from conftest import ROOT

COMMAND = re.compile(r"python -m bench( [^`#\n]*)?")


def subcommands(parser, prefix=()):
    """Every (sub)command path of the parser: ("decode",), ("micro", "verify"), ..."""
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            for name, sub in action.choices.items():
                yield (*prefix, name)
                yield from subcommands(sub, (*prefix, name))


def test_the_top_level_help_runs():
    proc = subprocess.run([sys.executable, "-m", "bench", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in ("decode", "load", "speculation", "soak", "micro", "request-path"):
        assert name in proc.stdout


@pytest.mark.parametrize("path", list(subcommands(build_parser())), ids=" ".join)
def test_every_subcommand_has_help(path, capsys):
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args([*path, "--help"])
    assert stop.value.code == 0
    assert "usage: python -m bench " + " ".join(path) in capsys.readouterr().out


def documented_commands():
    """(file, argv) of every `python -m bench …` the docs and the README give."""
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for match in COMMAND.finditer(page.read_text()):
            yield page.name, shlex.split(match.group(1) or "")


def test_the_docs_name_only_commands_that_exist():
    commands = list(documented_commands())
    assert len(commands) >= 10 and any(page == "benchmarks.md" for page, _ in commands)
    parser = build_parser()
    for page, argv in commands:
        if not argv or "--help" in argv:
            continue  # the entry itself, named in prose; help (test_every_subcommand_has_help)
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{page}: `python -m bench {shlex.join(argv)}` is not a command python -m bench takes")


def test_bench_functions_fit_a_screen():
    long = []
    for path in (ROOT / "bench").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert long == []
