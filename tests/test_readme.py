"""README.md's set-up commands are the ones CI runs (.ci/run), so neither drifts; the set-up script
installs what the tests need."""

import re

from conftest import ROOT

INTRO = "these are exactly the commands CI runs (`.ci/run`):"
SETUP = ROOT / "scripts" / "setup-dev.sh"


def readme_commands():
    text = (ROOT / "README.md").read_text()
    assert INTRO in text
    block = re.search(r"```\n(.*?)```", text[text.index(INTRO):], re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_ci_runs_exactly_the_readme_commands():
    ci = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    readme = readme_commands()
    assert readme[0] == "scripts/setup-dev.sh", readme  # the set-up in one command
    # Every README command, in the README's order, and no other install or test command in CI.
    assert [line for line in ci if line in readme] == readme, (readme, ci)
    commands = ("apt-get ", "python", "pip", "npm ", "command ", "scripts/", ". .venv")
    assert [line for line in ci if line.startswith(commands)] == readme, (readme, ci)


def setup_apt_packages():
    """The packages the set-up script's apt-get install line names (its continuation lines too)."""
    text = SETUP.read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if "apt-get install -y openmpi-bin" in line)
    return set(line.split())


def test_the_setup_installs_what_the_mpi_tests_need():
    assert {"openmpi-bin", "libopenmpi-dev"} <= setup_apt_packages()


def test_the_setup_installs_the_browser_the_pages_tests_drive():
    assert {"chromium", "chromium-driver"} <= setup_apt_packages()  # tests/browser.py


def test_the_setup_makes_the_environments_the_tests_use():
    text = SETUP.read_text()
    assert ".venv/bin/python -m pip install '.[test]'" in text
    assert "-m venv .olah-venv" in text and "olah==" in text  # tests/local_hub.py
    assert "npm install --prefix .agents" in text  # tests/serving/test_agents.py
