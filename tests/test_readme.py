"""README.md's set-up commands are the ones CI runs (.ci/run), so neither drifts."""

import re

from conftest import ROOT

INTRO = "these are exactly the commands CI runs (`.ci/run`):"


def readme_commands():
    text = (ROOT / "README.md").read_text()
    assert INTRO in text
    block = re.search(r"```\n(.*?)```", text[text.index(INTRO):], re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_ci_runs_exactly_the_readme_commands():
    ci = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    readme = readme_commands()
    # Every README command, in the README's order, and no other install or test command in CI.
    assert [line for line in ci if line in readme] == readme, (readme, ci)
    assert [line for line in ci if line.startswith(("apt-get ", "python", "pip", "npm ", "command "))] == readme, (readme, ci)


def test_the_readme_installs_what_the_mpi_tests_need():
    apt = next(line for line in readme_commands() if line.startswith("apt-get install"))
    assert {"openmpi-bin", "libopenmpi-dev"} <= set(apt.split())


def test_the_readme_installs_the_browser_the_pages_tests_drive():
    apt = next(line for line in readme_commands() if line.startswith("apt-get install"))
    assert {"chromium", "chromium-driver"} <= set(apt.split())  # tests/browser.py
