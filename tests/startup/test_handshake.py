"""The start-up handshake refuses, naming the rank, before any weights load."""

import subprocess
import sys

from conftest import ROOT, run_cli, trinity_launch
from distributed.shard.tiny_checkpoint import make_checkpoint

# mlx.launch gives every rank the same command; this picks --model by rank.
PER_RANK_MODEL = (
    "import os, sys; sys.path.insert(0, {root!r}); from distributed.cli import main; "
    "models = {models!r}; main(['--model', models[int(os.environ['MLX_RANK'])], *sys.argv[1:]])"
)


def test_a_rank_with_a_different_checkpoint_is_refused(hf_checkpoint, tmp_path):
    other = make_checkpoint(tmp_path / "other", seed=1, sliding_window=32)
    code = PER_RANK_MODEL.format(root=str(ROOT), models=[str(hf_checkpoint), str(other)])
    cmd = [*trinity_launch(2), sys.executable, "-c", code, "--prompt", "hi", "--max-tokens", "4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert "rank 1 (" in proc.stderr and "has a different checkpoint than rank 0" in proc.stderr
    assert proc.stdout == ""


def test_the_same_checkpoint_in_two_folders_is_accepted(hf_checkpoint, tmp_path):
    import shutil

    copy = shutil.copytree(hf_checkpoint, tmp_path / "copy")
    code = PER_RANK_MODEL.format(root=str(ROOT), models=[str(hf_checkpoint), str(copy)])
    cmd = [*trinity_launch(2), sys.executable, "-c", code, "--prompt", "hi", "--max-tokens", "4", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert '"finish_reason"' in proc.stdout, proc.stderr[-2000:]


def test_a_slice_that_cannot_fit_is_refused(hf_checkpoint):
    # A billion-token context: the full-attention layers' KV cache cannot fit anywhere.
    proc = run_cli(["--model", str(hf_checkpoint), "--prompt", "hi", "--max-context", "1000000000"], ranks=2)
    assert "rank 0 (" in proc.stderr and "cannot fit layers [0, 4)" in proc.stderr
    assert "rank 1 (" in proc.stderr and "cannot fit layers [4, 8)" in proc.stderr
    assert proc.stdout == ""
