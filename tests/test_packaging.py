"""pyproject.toml for real: the repository pip-installed (not editable, offline) into a
temporary folder, and its console scripts run from another directory, where neither the
checkout nor its configs/ can be found: run-trinity (alone, with the embedded default model,
and as every rank under mlx.launch and under trinity-launch), trinity-launch plan with the bundled presets and
example hostfiles, and the commands of README.md and docs/ that need no model download."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conftest import ROOT, free_port_range, kill_group, mlx_launch, run_json
from reference import PROMPT, mlx_lm_greedy
from stop_paths import TAG_ENV, describe, tagged

IDS = ",".join(map(str, PROMPT))


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(target folder, environment): the package installed as a user's `pip install .` would, from a
    copy of the checkout (pip builds in the source tree); --no-index: nothing is downloaded."""
    base = tmp_path_factory.mktemp("installed")
    source, target = base / "source", base / "target"
    shutil.copytree(ROOT, source, ignore=lambda folder, names: [
        n for n in names if n.startswith(".") or n in ("build", "__pycache__") or n.endswith(".egg-info")
        or (n == "results" and Path(folder).name == "bench")])  # what git ignores: not part of a checkout
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(target), str(source)], check=True, capture_output=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(target), PATH=f"{target / 'bin'}{os.pathsep}{Path(sys.executable).parent}"
               f"{os.pathsep}{env.get('PATH', '')}", **{TAG_ENV: uuid.uuid4().hex})
    yield target, env
    assert_all_gone(env[TAG_ENV])


def assert_all_gone(tag: str) -> None:
    assert not tagged(tag), describe(tagged(tag))


def run(installed, cmd, timeout=180, **kwargs) -> subprocess.CompletedProcess:
    """`cmd` in an empty folder of its own, with the installed package first on the path."""
    target, env = installed
    cwd = target.parent / f"elsewhere-{uuid.uuid4().hex[:8]}"
    cwd.mkdir()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_the_installed_copy_is_what_runs(installed):
    target, _ = installed
    proc = run(installed, [sys.executable, "-c", "import run_trinity, distributed, launch, launch.bundled as b; "
                           "print(run_trinity.__file__, distributed.__file__, launch.__file__, b.CONFIGS)"])
    assert proc.returncode == 0, proc.stderr
    assert all(Path(p).is_relative_to(target) for p in proc.stdout.split()), proc.stdout
    assert sorted(p.name for p in (target / "bin").iterdir()) == ["run-trinity", "trinity-launch"]


def test_the_pages_are_installed(installed):
    """The status and chat pages' files (package data) come with `pip install .`."""
    proc = run(installed, [sys.executable, "-c", "from distributed.serving import pages; print(pages.FOLDER, "
                           "*sorted(pages.FILES)); assert pages.find('/chat', auth=True, api=True)"])
    assert proc.returncode == 0, proc.stderr
    folder, *names = proc.stdout.split()
    assert Path(folder).is_relative_to(installed[0])
    assert names == sorted(p.name for p in (ROOT / "distributed/serving/pages").iterdir())


def test_console_scripts_from_another_directory(installed, hf_checkpoint):
    proc = run(installed, ["run-trinity", "--model", str(hf_checkpoint), "--prompt", "Hello", "--max-tokens", "4",
                           "--json"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(json.loads(proc.stdout)["token_ids"]) == 4
    proc = run(installed, ["trinity-launch", "plan", "--preset", "trinity-mini", "--hostfile", "thunderbolt-ring-2macs",
                           "--quantize", "4"])
    assert proc.returncode == 0 and "studio.local" in proc.stdout and "fits" in proc.stdout, proc.stderr
    help_text = " ".join(run(installed, ["run-trinity", "--help"]).stdout.split())
    assert help_text.startswith("usage: run-trinity ") and "(default: 100)" in help_text


def test_the_default_model_is_package_data(installed):
    """run-trinity without --model from another directory: the embedded model came with the
    install (pyproject's package data) and writes what the checkout's copy writes."""
    args = ["--prompt", "The", "--max-tokens", "8", "--json"]
    proc = run(installed, ["run-trinity", *args])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["token_ids"] == run_json(args[:-1])["token_ids"]
    assert (installed[0] / "distributed" / "shard" / "tiny_model" / "model.safetensors").exists()


def readme_commands(prefix: str):
    """The command lines of README.md and the docs (in ``` blocks) that start with `prefix`, comments dropped."""
    text = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    blocks = re.findall(r"```\n(.*?)```", text, re.S)
    return [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()
            if line.startswith(prefix)]


def test_readme_plan_commands_work_from_any_directory(installed):
    commands = [c for c in readme_commands("trinity-launch plan ") if "--preset" in c and "…" not in c]
    assert commands
    for command in commands:
        proc = run(installed, shlex.split(command))
        assert proc.returncode == 0 and "fits" in proc.stdout, (command, proc.stderr)


@pytest.mark.parametrize("launcher", ["mlx.launch", "trinity-launch"])
def test_run_trinity_as_every_rank(installed, hf_checkpoint, launcher):
    """The README's ways to start ranks with the installed script; greedy output as one-device mlx-lm's."""
    args = ["--model", str(hf_checkpoint), "--prompt-ids", IDS, "--max-tokens", "6", "--json"]
    port = str(free_port_range(3))  # the ring's two and, for mlx.launch, rank 0's control link
    if launcher == "mlx.launch":
        cmd = [mlx_launch(), "-n", "2", "--starting-port", port, "--", "run-trinity", *args]
    else:
        cmd = ["trinity-launch", "run", "--single-host", "2", "--starting-port", port, "--", "run-trinity", *args]
    proc = run(installed, cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert [r["layers"] for r in out["ranks"]] == [[0, 4], [4, 8]]
    assert out["token_ids"] == mlx_lm_greedy(hf_checkpoint, PROMPT, 6, 512)[0]
