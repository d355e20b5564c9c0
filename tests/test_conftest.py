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
