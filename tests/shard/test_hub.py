"""--model ORG/NAME for real (distributed/shard/hub.py, loader.fetch_stage_files):
real run_trinity.py processes download tiny checkpoints from a real hub on
localhost (olah, tests/local_hub.py) through HF_ENDPOINT, each rank into its own
Hugging Face cache as on separate machines; and every way it fails is one line."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from local_hub import LocalHub

from conftest import ROOT, free_port_range, one_error_line, run_json, run_trinity, trinity_launch
from distributed.shard.loader import INDEX_FILE, local_files, weight_map
from distributed.shard.tiny_checkpoint import make_checkpoint

pytestmark = pytest.mark.slow  # a real hub mirror serving every rank's downloads

ARGS = ["--prompt-ids", "1,2,3", "--max-tokens", "2"]
GEN = ["--prompt-ids", "1,2,3,4,5", "--max-tokens", "6", "--json"]
LAYOUTS = ("hf", "mlx")
GONE = "model-00003-of-00004.safetensors"  # layers 4 and 5: only rank 1 of 2 reads it

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
    assert line.startswith(NOT_DOWNLOADABLE + "cannot reach huggingface.co: ") or "no such repo on huggingface.co" in line, line


def test_offline_mode_and_not_cached(tmp_path):
    line = one_error_line(*run_trinity(["--model", "models/mine", *ARGS], env=hub_env(tmp_path, HF_HUB_OFFLINE="1")))
    assert line == NOT_DOWNLOADABLE + "HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache)"


# --- against a real hub on localhost ----------------------------------------------------------


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """repo id -> the checkpoint folder committed as it: both layouts in 4 weight files
    (2 layers each) with an index; one whose index names a file it lacks; one without config.json."""
    root = tmp_path_factory.mktemp("hub_sources")
    repos = {f"tiny/afmoe-{layout}": make_checkpoint(root / layout, layout=layout, layers_per_file=2)
             for layout in LAYOUTS}
    gone = make_checkpoint(root / "gone", layers_per_file=2)
    (gone / GONE).unlink()
    no_config = make_checkpoint(root / "no-config", layers_per_file=2)
    (no_config / "config.json").unlink()
    return dict(repos, **{"tiny/afmoe-gone": gone, "tiny/afmoe-no-config": no_config})


@pytest.fixture(scope="module")
def hub(sources, tmp_path_factory):
    """olah, started once for this module and stopped after it, pass or fail."""
    with LocalHub(tmp_path_factory.mktemp("hub"), sources) as hub:
        yield hub


def launch_2_ranks(tmp_path, args, endpoint):
    """Two local ranks (our launcher's ring; mlx.launch's loop would keep a core busy) with each
    rank's HF_HUB_CACHE its own: tmp_path/cache/rank0, tmp_path/cache/rank1."""
    wrapper = tmp_path / "own_cache.sh"
    wrapper.write_text('#!/bin/sh\nHF_HUB_CACHE="$CACHES/rank$MLX_RANK" exec "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    prefix = [*trinity_launch(2), str(wrapper)]
    env = hub_env(tmp_path, HF_ENDPOINT=endpoint, CACHES=str(tmp_path / "cache"))
    return run_trinity(args, env=env, prefix=prefix, timeout=240)


def cached(cache: Path, repo_id: str):
    """The files in the cache's snapshot of repo_id (exactly one commit), and the blobs' (name, mtime)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshots = list((repo / "snapshots").iterdir())
    assert len(snapshots) == 1, snapshots
    blobs = {(b.name, b.stat().st_mtime_ns) for b in (repo / "blobs").iterdir()}
    return {f.name for f in snapshots[0].iterdir()}, blobs


def parse(status, out, err) -> dict:
    assert status == 0 and "Traceback" not in err, (status, out, err[-3000:])
    return json.loads(out)


@pytest.mark.parametrize("layout, second_start", [("hf", "hub up"), ("mlx", "hub unreachable")])
def test_each_rank_downloads_only_its_files_then_uses_its_cache(layout, second_start, hub, sources, tmp_path):
    repo_id, source = f"tiny/afmoe-{layout}", sources[f"tiny/afmoe-{layout}"]
    metadata = {f.name for f in source.iterdir() if not f.name.endswith(".safetensors")}
    assert INDEX_FILE in metadata and "config.json" in metadata
    mark = hub.log_lines()

    status, out, err = launch_2_ranks(tmp_path, ["--model", repo_id, *GEN], hub.endpoint)
    first = parse(status, out, err)
    # What each rank holds decides what it fetched: the files holding its tensors, per the index.
    wmap = weight_map(source)
    expected = [local_files(wmap, *r["layers"], r["rank"] == 0) for r in first["ranks"]]
    assert [r["layers"] for r in first["ranks"]] == [[0, 4], [4, 8]]
    assert expected[0] != expected[1] and all(len(e) < len(set(wmap.values())) for e in expected), expected
    before = []
    for rank, files in enumerate(expected):
        names, blobs = cached(tmp_path / "cache" / f"rank{rank}", repo_id)
        assert names == metadata | files, (rank, names)
        before.append(blobs)
        assert f"Fetching {len(names)} files: 100%" in err, err[-3000:]  # each rank's progress bar, done
    served = hub.downloads(mark)
    assert sorted(f for r, f in served if f.endswith(".safetensors")) == sorted([*expected[0], *expected[1]])

    # The same greedy tokens as one process reading the checkpoint folder itself.
    local = run_json(["--model", str(source), *GEN[:-1]])
    assert first["token_ids"] == local["token_ids"]
    assert max(abs(a - b) for a, b in zip(first["logprobs"], local["logprobs"])) < 1e-4

    # A second start reads each rank's cache: the hub serves no file (or cannot be
    # reached at all), and the cache is untouched.
    mark = hub.log_lines()
    endpoint = hub.endpoint if second_start == "hub up" else f"http://127.0.0.1:{free_port_range(1)}"
    second = parse(*launch_2_ranks(tmp_path, ["--model", repo_id, *GEN], endpoint))
    assert second["token_ids"] == first["token_ids"]
    assert hub.downloads(mark) == []
    for rank in range(2):
        assert cached(tmp_path / "cache" / f"rank{rank}", repo_id)[1] == before[rank]


def test_launcher_plans_from_the_hubs_tensor_headers(hub, sources, tmp_path):
    """`python -m launch plan --model ORG/NAME` sizes every tensor from the hub's
    safetensors headers: the same plan as from the checkpoint folder itself."""
    env = hub_env(tmp_path, HF_ENDPOINT=hub.endpoint)
    plans = []
    for model in ("tiny/afmoe-mlx", str(sources["tiny/afmoe-mlx"])):
        proc = subprocess.run([sys.executable, "-m", "launch", "plan", "--model", model, "--memory-gb", "1,1", "--json"],
                              capture_output=True, text=True, timeout=120, cwd=ROOT,
                              env={k: v for k, v in dict(os.environ, PYTHONPATH=str(ROOT), **env).items() if v is not None})
        assert proc.returncode == 0, proc.stderr[-3000:]
        plans.append(json.loads(proc.stdout))
    assert plans[0]["source"] == "tensors" and plans[0] == plans[1], plans


def test_missing_repo(hub, tmp_path):
    env = hub_env(tmp_path, HF_ENDPOINT=hub.endpoint)
    line = one_error_line(*run_trinity(["--model", "tiny/nope", *ARGS], env=env))
    assert line == ("error: --model tiny/nope: no such folder, and not downloadable as a Hugging Face repo id "
                    f"(no such repo on {hub.endpoint} (HF_ENDPOINT) (or it is private: set HF_TOKEN))"), line


def test_missing_config(hub, tmp_path):
    env = hub_env(tmp_path, HF_ENDPOINT=hub.endpoint)
    line = one_error_line(*run_trinity(["--model", "tiny/afmoe-no-config", *ARGS], env=env))
    assert line == f"error: --model tiny/afmoe-no-config: the repo on {hub.endpoint} (HF_ENDPOINT) has no config.json"


def test_missing_weight_file_on_one_rank(hub, tmp_path):
    """Only rank 1 needs the file the repo lacks: it says so, and rank 0 shows its error."""
    status, out, err = launch_2_ranks(tmp_path, ["--model", "tiny/afmoe-gone", *ARGS], hub.endpoint)
    cause = (f"--model tiny/afmoe-gone: its {INDEX_FILE} names {GONE}, which layers [4, 8) need, "
             f"but the repo on {hub.endpoint} (HF_ENDPOINT) has no such file")
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2 and out == "" and "Traceback" not in err, (status, out, err)
    assert f"error: {cause}" in errors, errors  # rank 1's own line
    assert any(e.startswith("error: rank 1 failed to start on host ") and e.endswith(": " + cause) for e in errors), errors


def test_unreachable_hub(tmp_path):
    endpoint = f"http://127.0.0.1:{free_port_range(1)}"  # nothing listens there
    line = one_error_line(*run_trinity(["--model", "tiny/afmoe-hf", *ARGS], env=hub_env(tmp_path, HF_ENDPOINT=endpoint)))
    assert line.startswith("error: --model tiny/afmoe-hf: no such folder, and not downloadable as a Hugging Face "
                           f"repo id (cannot reach {endpoint} (HF_ENDPOINT): "), line
