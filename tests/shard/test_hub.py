"""--model that is neither a local folder nor downloadable: one line saying both
(distributed/shard/hub.py), from the real run_trinity.py."""

import os

from conftest import one_error_line, run_trinity

ARGS = ["--prompt-ids", "1,2,3", "--max-tokens", "2"]

NOT_DOWNLOADABLE = "error: --model models/mine: no such folder, and not downloadable as a Hugging Face repo id ("


def hub_env(tmp_path, **extra):
    """An empty Hugging Face cache; short timeouts, should the network drop packets rather than refuse."""
    unset = {k: None for k in os.environ if k.startswith("HF_")}
    return dict(unset, HF_HOME=str(tmp_path / "hf"), HF_HUB_ETAG_TIMEOUT="5", HF_HUB_DOWNLOAD_TIMEOUT="5", **extra)


def test_missing_relative_folder_without_network(tmp_path):
    """`models/mine` is no folder here, so it reads as a repo id; this machine cannot
    reach huggingface.co (where it can, the Hub says there is no such repo)."""
    status, out, err = run_trinity(["--model", "models/mine", *ARGS], env=hub_env(tmp_path))
    line = one_error_line(status, out, err)
    assert line.startswith(NOT_DOWNLOADABLE), line
    assert line.startswith(NOT_DOWNLOADABLE + "no network: ") or "no such repo on huggingface.co" in line, line


def test_offline_mode_and_not_cached(tmp_path):
    line = one_error_line(*run_trinity(["--model", "models/mine", *ARGS], env=hub_env(tmp_path, HF_HUB_OFFLINE="1")))
    assert line == NOT_DOWNLOADABLE + "HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache)"
