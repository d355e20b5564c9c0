"""Small real filesystems for tests of what a full or read-only disk does (the prefix cache's
disk tier): a tmpfs mounted for the test, unmounted whatever happens. Root only; skipped where
this machine cannot mount one."""

import os
import subprocess
from contextlib import contextmanager
from pathlib import Path

from conftest import needs


@contextmanager
def tmpfs(path: Path, size: str):
    """A small tmpfs at `path`, unmounted on the way out whatever happens."""
    if os.geteuid() != 0:
        needs("root, to mount a tmpfs")
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode:
        needs(f"a tmpfs mount (mount: {done.stderr.strip()})")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)]).returncode:
            subprocess.run(["umount", "-l", str(path)])
        assert not os.path.ismount(path)


def remount(path: Path, mode: str):
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True)
