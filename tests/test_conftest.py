"""conftest.py itself: a pytest stopped by SIGTERM still ends what its fixtures started."""

import os
import signal
import subprocess
import sys
import time

from conftest import ROOT

MODULE = '''
import os, subprocess, time, pytest

@pytest.fixture(scope="module")
def child():
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)  # as ranks are started
    with open(os.environ["CHILD_PID"] + ".tmp", "w") as f:
        f.write(str(proc.pid))
    os.rename(os.environ["CHILD_PID"] + ".tmp", os.environ["CHILD_PID"])
    yield proc
    proc.kill()
    proc.wait()

def test_waits(child):
    time.sleep(300)
'''


def test_sigterm_to_pytest_runs_the_fixtures_teardown(tmp_path):
    (tmp_path / "test_child.py").write_text(MODULE)
    pid_file = tmp_path / "child.pid"
    env = dict(os.environ, CHILD_PID=str(pid_file), PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))
    pytest_proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                                    "test_child.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
    child = None
    try:
        end = time.monotonic() + 60
        while not pid_file.exists():
            assert time.monotonic() < end and pytest_proc.poll() is None, pytest_proc.communicate()[0]
            time.sleep(0.05)
        child = int(pid_file.read_text())
        pytest_proc.send_signal(signal.SIGTERM)
        out, _ = pytest_proc.communicate(timeout=60)
        assert "KeyboardInterrupt: pytest got SIGTERM" in out, out
        assert not os.path.exists(f"/proc/{child}"), f"the fixture's child {child} outlived pytest:\n{out}"
    finally:
        if pytest_proc.poll() is None:
            pytest_proc.kill()
            pytest_proc.wait()
        if child is not None and os.path.exists(f"/proc/{child}"):
            os.kill(child, signal.SIGKILL)


NEEDS_MODULE = '''
import pytest
from conftest import needs

def test_needs_a_tool():
    needs("a tool this machine lacks")

@pytest.mark.skipif(True, reason="needs another tool")
def test_marked():
    pass

def test_not_applicable():
    pytest.skip("this combination does not apply")
'''


def test_a_missing_tool_is_a_skip_with_its_reason_and_under_ci_a_failure(tmp_path):
    (tmp_path / "test_needs.py").write_text(NEEDS_MODULE)
    base = {k: v for k, v in os.environ.items() if k != "CI"}
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT)])
    runs = {}
    for ci in (None, "true"):
        env = dict(base, **({"CI": ci} if ci else {}))
        runs[ci] = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "conftest", "-p", "no:cacheprovider",
                                   "test_needs.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = runs[None].stdout
    assert runs[None].returncode == 0 and "3 skipped" in out, out
    assert "needs a tool this machine lacks" in out and "needs another tool" in out, out
    out = runs["true"].stdout
    # The marker's skip comes at set-up, so its failure is reported as an error.
    assert runs["true"].returncode == 1 and "1 failed, 1 skipped, 1 error" in out, out
    assert "CI=true, and this test needs a tool this machine lacks" in out and "needs another tool" in out, out
