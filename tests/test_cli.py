"""run_trinity.py as real processes: 1 rank, --stages N, rings of the ring backend (started by
our launcher and by mlx.launch), OpenMPI."""

import json
import os
import re
import shutil

import pytest

from conftest import ROOT, run_cli, run_json
from draft_checkpoint import truncated_draft
from distributed.command_line import parse_settings
from reference import PROMPT, mlx_lm_greedy
from shard.test_loader import checkpoint_bytes

pytestmark = pytest.mark.slow  # the command line across 1-4 ranks and three backends

IDS = ",".join(map(str, PROMPT))
COMMON = ["--prompt-ids", IDS, "--prefill-step-size", "8"]

# (ranks, backend, extra args, expected layer ranges). 8 layers: S S S F S S S F.
LAUNCHES = [
    (1, None, [], [[0, 8]]),
    (1, None, ["--stages", "3", "--split", "3,1,4"], [[0, 3], [3, 4], [4, 8]]),
    (2, "ring", [], [[0, 4], [4, 8]]),
    (3, "mlx.launch", ["--split", "3,1,4"], [[0, 3], [3, 4], [4, 8]]),
    (4, "ring", ["--split", "3,1,3,1"], [[0, 3], [3, 4], [4, 7], [7, 8]]),
    (2, "mpirun", ["--split", "1,7"], [[0, 1], [1, 8]]),
    (3, "mlx-mpi", ["--split", "2,5,1"], [[0, 2], [2, 7], [7, 8]]),
    # Collectives-only transport (what NCCL needs), forced over the ring backend: 16 tokens, as every
    # rank takes part in every hop (64 cost 1.8x the CPU of 16 here; point-to-point, about the same).
    (2, "ring", ["--transport", "collective"], [[0, 4], [4, 8]]),
    (3, "ring", ["--transport", "collective", "--split", "3,1,4"], [[0, 3], [3, 4], [4, 8]]),
]


@pytest.mark.parametrize("ranks, backend, extra, layers", LAUNCHES)
def test_greedy_output_is_independent_of_ranks_and_split(hf_checkpoint, ranks, backend, extra, layers):
    tokens = 16 if "collective" in extra else 64  # either way far past the window (16) from a 40-token prompt
    ref_tokens, ref_logprobs = mlx_lm_greedy(hf_checkpoint, PROMPT, tokens, 8)
    out = run_json(["--model", str(hf_checkpoint), *COMMON, "--max-tokens", str(tokens), *extra], ranks, backend)
    assert out["token_ids"] == ref_tokens
    assert max(abs(a - b) for a, b in zip(out["logprobs"], ref_logprobs)) < 1e-5
    assert out["prompt_token_ids"] == PROMPT
    assert out["finish_reason"] == "length"
    assert [r["layers"] for r in out["ranks"]] == layers
    assert [r["rank"] for r in out["ranks"]] == list(range(len(layers)))
    assert [r["embed"] for r in out["ranks"]] == [True] + [False] * (len(layers) - 1)
    for r in out["ranks"]:
        assert r["parameter_bytes"] == checkpoint_bytes(hf_checkpoint, *r["layers"], r["rank"] == 0)
        assert r["peak_memory_bytes"] > 0 and r["host"]


def test_quantized_checkpoint_across_two_processes(mlx_checkpoint):
    ref_tokens, _ = mlx_lm_greedy(mlx_checkpoint, PROMPT, 32, 8)
    out = run_json(["--model", str(mlx_checkpoint), "--prompt-ids", IDS, "--max-tokens", "32",
                    "--prefill-step-size", "8", "--split", "3,5"], ranks=2)
    assert out["token_ids"] == ref_tokens


def test_text_prompt_uses_the_chat_template(hf_checkpoint):
    chat = run_json(["--model", str(hf_checkpoint), "--prompt", "hi", "--max-tokens", "4"])
    raw = run_json(["--model", str(hf_checkpoint), "--prompt", "hi", "--max-tokens", "4", "--no-chat-template"])
    assert raw["prompt_token_ids"] == [ord("h"), ord("i")]
    assert chat["prompt_token_ids"][0] == 257  # <|im_start|>
    assert chat["prompt_token_ids"][-10:] == list(b"assistant\n") and 258 in chat["prompt_token_ids"]
    assert set(chat) >= {"text", "token_ids", "logprobs", "prompt_token_ids", "finish_reason",
                         "prefill_tokens_per_sec", "generation_tokens_per_sec", "ranks"}


def test_plain_output_prints_text_and_rank_map(hf_checkpoint):
    proc = run_cli(["--model", str(hf_checkpoint), "--prompt-ids", IDS, "--max-tokens", "8"], ranks=2)
    assert proc.returncode == 0, proc.stderr
    assert "rank 0 (" in proc.stdout and "layers [0, 4) + embedding and head" in proc.stdout
    assert "rank 1 (" in proc.stdout and "layers [4, 8)," in proc.stdout


def _broken_copy(src, dst, remove_file=None, config_update=None):
    shutil.copytree(src, dst)
    if remove_file:
        (dst / remove_file).unlink()
    if config_update:
        config = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**config, **config_update}))
    return dst


@pytest.mark.parametrize(
    "args, message",
    [
        (["--split", "4,x"], "--split '4,x' is malformed"),
        (["--split", "4,4"], "2 entries but there are 1 ranks"),
        (["--stages", "2", "--split", "4,5"], "sums to 9 but the model has 8 layers"),
        (["--stages", "2", "--split", "8,0"], "must be positive"),
        (["--prompt-ids", "1,2,999"], "--prompt-ids: token id 999 is outside the vocabulary"),
        (["--prompt-ids", "1,a"], "not a comma-separated list of integers"),
        (["--temp", "-1"], "--temp: must be >= 0"),
        (["--top-p", "0"], "--top-p: must be in (0, 1]"),
        (["--min-p", "1.5"], "--min-p: must be in [0, 1]"),
        (["--top-k", "-2"], "--top-k: must be >= 0"),
        (["--max-tokens", "0"], "--max-tokens: must be at least 1"),
        (["--max-tokens", "4090"], "exceeds the context of 4096 tokens"),
        (["--serve", "127.0.0.1:99999"], "--serve 127.0.0.1:99999: port 99999 is out of range (0-65535)"),
        (["--prefix-cache-bytes", "-1"], "--prefix-cache-bytes must be >= 0, got -1"),
    ],
)
def test_bad_arguments_exit_nonzero_naming_the_cause(hf_checkpoint, args, message):
    proc = run_cli(["--model", str(hf_checkpoint), "--prompt-ids", "1,2,3,4,5,6,7", *args])
    assert proc.returncode != 0
    assert message in proc.stderr
    assert proc.stdout == ""


def test_missing_model_and_unknown_model_type(hf_checkpoint, tmp_path):
    proc = run_cli(["--model", str(tmp_path / "nope"), "--prompt", "hi"])
    assert proc.returncode != 0 and f"error: --model {tmp_path / 'nope'}: no such folder" in proc.stderr
    bad = _broken_copy(hf_checkpoint, tmp_path / "llama", config_update={"model_type": "llama"})
    proc = run_cli(["--model", str(bad), "--prompt", "hi"])
    assert proc.returncode != 0 and "unsupported model_type 'llama'" in proc.stderr


def test_model_that_is_not_a_checkpoint_folder(hf_checkpoint, tmp_path):
    """A newcomer's first tries: the config file itself, a folder without config.json,
    a config.json without the model's sizes (mlx-lm would take Trinity-Mini's)."""
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "config.json").write_text(json.dumps({"model_type": "afmoe", "hidden_size": 64}))
    (tmp_path / "empty").mkdir()
    cases = [
        (hf_checkpoint / "config.json",
         f"error: --model {hf_checkpoint / 'config.json'} is a file: give the checkpoint's folder (the one with config.json)"),
        (tmp_path / "empty", f"error: config.json not found in {tmp_path / 'empty'}"),
        (tmp_path / "partial", "error: config.json lacks vocab_size, num_hidden_layers, num_attention_heads "
                               "(every afmoe config.json has them)"),
    ]
    for model, line in cases:
        proc = run_cli(["--model", str(model), "--prompt", "hi"])
        assert proc.returncode == 2 and proc.stderr.strip() == line and proc.stdout == "", (proc.stderr, line)


def test_missing_shard_file_single_process(hf_checkpoint, tmp_path):
    bad = _broken_copy(hf_checkpoint, tmp_path / "ckpt", remove_file="model-00002-of-00003.safetensors")
    proc = run_cli(["--model", str(bad), "--prompt", "hi", "--stages", "2"])
    assert proc.returncode != 0
    assert "weight file model-00002-of-00003.safetensors is missing" in proc.stderr


def test_missing_shard_on_one_rank_stops_every_rank(hf_checkpoint, tmp_path):
    # With --split 3,5, only rank 1 needs model-00002 (layers 3-5).
    bad = _broken_copy(hf_checkpoint, tmp_path / "ckpt", remove_file="model-00002-of-00003.safetensors")
    proc = run_cli(["--model", str(bad), "--prompt", "hi", "--split", "3,5"], ranks=2, backend="mlx.launch", timeout=60)
    assert "weight file model-00002-of-00003.safetensors is missing" in proc.stderr
    assert "rank 1 failed to start" in proc.stderr  # rank 0's view
    assert proc.stdout == ""
    # mlx.launch itself exits 0 whatever its ranks return; it reports their codes (and
    # may stop the second rank with SIGTERM once the first has exited).
    assert "Node with rank 0 exited with code 2" in proc.stderr or "Node with rank 1 exited with code 2" in proc.stderr


def test_empty_text_prompt(hf_checkpoint):
    proc = run_cli(["--model", str(hf_checkpoint), "--prompt", ""])
    assert proc.returncode != 0 and "--prompt: the prompt is empty" in proc.stderr


def test_split_auto_plans_from_exchanged_memory(hf_checkpoint):
    ref_tokens, _ = mlx_lm_greedy(hf_checkpoint, PROMPT, 16, 8)
    out = run_json(["--model", str(hf_checkpoint), "--prompt-ids", IDS, "--max-tokens", "16",
                    "--prefill-step-size", "8", "--split", "auto"], ranks=2)
    assert out["token_ids"] == ref_tokens
    layers = [r["layers"] for r in out["ranks"]]
    assert layers[0][0] == 0 and layers[0][1] == layers[1][0] and layers[1][1] == 8


def test_chat_refuses_what_it_cannot_do(hf_checkpoint):
    for extra, message in ((["--serve", "127.0.0.1:0"], "error: --chat cannot be combined with --serve"),
                           (["--json"], "error: --chat cannot be combined with --json"),
                           (["--prompt", "hi"], "argument --prompt: not allowed with argument --chat")):
        proc = run_cli(["--model", str(hf_checkpoint), "--chat", *extra])
        assert proc.returncode == 2 and message in proc.stderr and proc.stdout == "", proc.stderr


def test_help_shows_defaults_and_names_docs_pages_that_exist(capsys):
    with pytest.raises(SystemExit) as e:
        parse_settings(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "DESIGN.md" not in out
    flat = " ".join(out.split())
    for default in ("--max-tokens MAX_TOKENS tokens to generate (per turn with --chat) (default: 100)",
                    "--prefill-step-size PREFILL_STEP_SIZE prompt tokens per prefill frame",
                    "(default: 2048)", "(default: 5.0)", "(default: 64)", "(default: auto)",
                    "--seed SEED sampling seed (default: random)"):
        assert default in flat, default
    assert "(default: None)" not in flat and "(default: False)" not in flat
    pages = re.findall(r'"([^"]+)"', flat[flat.index("more in the docs"):])
    assert len(pages) >= 4 and all((ROOT / "docs" / page).is_file() for page in pages), pages


def test_frames_drafted_ahead_through_a_real_ring_give_the_same_tokens(hf_checkpoint, tmp_path, miss=16):
    """Drafting ahead through a real 3-rank ring: rank 0 drafts the reference continuation
    (bench/replay_drafter), one position in `miss` wrong, so frames go ahead and some are
    cancelled on every rank, far past the window: tokens and logprobs as mlx-lm's."""
    ref_tokens, ref_logprobs = mlx_lm_greedy(hf_checkpoint, PROMPT, 200, 8)
    replay = tmp_path / "replay.json"
    replay.write_text(json.dumps({"tokens": ref_tokens, "miss": miss}))
    env = {"TRINITY_REPLAY": str(replay), "PYTHONPATH": os.pathsep.join([str(ROOT / "bench" / "replay_drafter"), str(ROOT)])}
    out = run_json(["--model", str(hf_checkpoint), "--prompt-ids", IDS, "--max-tokens", "200", "--prompt-lookup",
                    "--speculate", "always", "--num-draft-tokens", "4", "--split", "3,1,4"], 3, env=env)
    assert out["token_ids"] == ref_tokens
    assert max(abs(a - b) for a, b in zip(out["logprobs"], ref_logprobs)) < 1e-4
    spec = out["speculative"]
    assert spec["cancelled"] > 0 and spec["accepted"] > 100, spec


@pytest.mark.parametrize("ranks, extra, draft", [(2, ["--prompt-lookup"], False), (3, ["--split", "3,1,4"], True)])
def test_speculation_through_the_ring_gives_the_same_tokens(hf_checkpoint, tmp_path, ranks, extra, draft):
    """Verification frames through real rings, rejected drafts trimmed on every rank,
    far past the window: the greedy output and its logprobs as without speculation. With
    prompt lookup on 2 ranks; with a draft model (the checkpoint's first 4 layers) on 3, whose
    frames the other ranks build ahead of their coming (the TRIM says how long the next is)."""
    ref_tokens, ref_logprobs = mlx_lm_greedy(hf_checkpoint, PROMPT, 200, 8)
    if draft:
        extra = [*extra, "--draft-model", str(truncated_draft(hf_checkpoint, tmp_path / "draft", 4))]
    out = run_json(["--model", str(hf_checkpoint), "--prompt-ids", IDS, "--max-tokens", "200",
                    "--speculate", "always", "--num-draft-tokens", "3", *extra], ranks)
    assert out["token_ids"] == ref_tokens
    assert max(abs(a - b) for a, b in zip(out["logprobs"], ref_logprobs)) < 1e-4
    spec = out["speculative"]
    assert spec["passes"] > 0 and 0 < spec["accepted"] <= spec["drafted"] <= 3 * spec["passes"], spec


def test_every_flag_is_read_into_one_settings_group():
    """parse_settings reads every flag of the parser into exactly one frozen group, so nothing below
    the command line needs the argparse Namespace."""
    from dataclasses import FrozenInstanceError, fields

    from distributed.command_line import build_parser
    from distributed.startup.settings import Settings

    settings = parse_settings(["--model", "M", "--temp", "0.5", "--split", "auto", "--max-context", "auto",
                               "--serve", "127.0.0.1:1", "--no-draft-ahead", "--log-level", "debug"])
    groups = [getattr(settings, f.name) for f in fields(Settings) if f.name not in ("model", "log_level")]
    read = [f.name for group in groups for f in fields(group)] + ["model", "log_level"]
    assert sorted(read) == sorted(vars(build_parser().parse_args([]))) and len(read) == len(set(read))
    assert (settings.model.checkpoint, settings.generation.temp, settings.ring.split, settings.sizing.max_context,
            settings.serving.serve, settings.speculation.draft_ahead) == ("M", 0.5, "auto", "auto", "127.0.0.1:1", False)
    with pytest.raises(FrozenInstanceError):
        settings.ring.split = "1,1"
    assert parse_settings([]) == Settings()  # the groups' defaults are the parser's
