"""run_trinity.py --chat as real processes fed stdin: 1 process (--stages 2) and 2 ranks
under mlx.launch (rank 0 reads the stdin mlx.launch relays); a thinking checkpoint's
reasoning apart from its answer. Every process must be gone
afterwards, on success and failure."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
from mlx_lm.utils import load_tokenizer

from conftest import ROOT, RUN, free_port_range, kill_group, mlx_launch, run_json
from distributed.serving.chat import PROMPT, Conversation
from stop_paths import TAG_ENV, describe, tagged
from tool_checkpoint import ANSWER, REASONING, make_think_checkpoint

STATS = re.compile(r"^\[(\w+): (\d+) prompt tokens \((\d+) cached\), (\d+) generated;", re.M)
ARGS = ["--chat", "--max-tokens", "8"]


def command(model, ranks: int, extra=()):
    rank = [sys.executable, RUN, "--model", str(model), *ARGS, *extra]
    if ranks == 1:
        return rank
    return [mlx_launch(), "-n", str(ranks), "--starting-port", str(free_port_range(ranks + 1)), "--", *rank]


def start(cmd, tag: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{TAG_ENV: tag})
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            cwd=ROOT, start_new_session=True)


def assert_all_gone(tag: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not tagged(tag), describe(tagged(tag))


def chat(model, lines, ranks=1, extra=(), timeout=240):
    """Feed `lines` to a chat, then end its input; returns (status, stdout, stderr)."""
    tag = uuid.uuid4().hex
    proc = start(command(model, ranks, extra), tag)
    try:
        out, err = proc.communicate("".join(f"{line}\n" for line in lines).encode(), timeout=timeout)
    finally:
        kill_group(proc)
    assert_all_gone(tag)
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def replies(out: str):
    """What followed each prompt marker, the replies (the last marker is the input's end)."""
    return [part[:-1] for part in out.split(PROMPT)[1:-1]]


def turns(err: str):
    return [dict(reason=m[0], prompt=int(m[1]), cached=int(m[2]), generated=int(m[3])) for m in STATS.findall(err)]


def drain(stream, buf: bytearray) -> None:
    for chunk in iter(lambda: stream.read1(4096), b""):
        buf.extend(chunk)


def test_the_next_turn_extends_the_conversation(hf_checkpoint):
    tokenizer = load_tokenizer(hf_checkpoint)
    conversation = Conversation(tokenizer)
    first = conversation.prompt_ids("hello there")
    conversation.add("hello there", "some reply")
    second = conversation.prompt_ids("how are you")
    assert second[:len(first)] == first and len(second) > len(first) + len(b"some reply")
    conversation.reset()
    assert conversation.prompt_ids("hello there") == first


@pytest.mark.parametrize("ranks, extra", [(1, ["--stages", "2"]), (2, [])], ids=["stages-2", "mlx.launch-2"])
def test_two_turns_the_second_restores_the_first_from_the_prefix_cache(hf_checkpoint, ranks, extra):
    # mlx.launch never passes the end of its input on: /exit ends the chat there.
    status, out, err = chat(hf_checkpoint, ["hello there", "how are you", "/exit"], ranks, extra)
    assert status == 0 and "Traceback" not in err, err[-3000:]
    first, second = turns(err)
    assert first["cached"] == 0 and second["cached"] >= first["prompt"] > 0, err
    assert second["prompt"] > first["prompt"] + first["generated"]  # the history is in the prompt
    assert "1 of 2 prompts hit" in err
    one_shot = run_json(["--model", str(hf_checkpoint), "--prompt", "hello there", "--max-tokens", "8"])
    assert replies(out)[0] == one_shot["text"]  # a first turn is the one-shot request
    if ranks == 1:  # greedy replies do not depend on the cache
        status, uncached_out, uncached_err = chat(hf_checkpoint, ["hello there", "how are you"], ranks,
                                                  [*extra, "--prefix-cache-bytes", "0"])
        assert status == 0, uncached_err[-3000:]
        assert [t["cached"] for t in turns(uncached_err)] == [0, 0]
        assert replies(uncached_out) == replies(out)[:2]


def test_commands_and_the_end_of_input(hf_checkpoint):
    status, out, err = chat(hf_checkpoint, ["/help", "/bogus", "", "hi", "/reset", "hi"])
    assert status == 0 and "Traceback" not in err, err[-3000:]
    assert "/reset forget the conversation" in err and "chat: unknown command /bogus" in err
    assert "chat: conversation forgotten" in err
    first, again = turns(err)
    assert again["prompt"] == first["prompt"]  # nothing of the first exchange is left
    answered = [r for r in replies(out) if r]
    assert len(answered) == 2 and answered[0] == answered[1]
    assert out.endswith(PROMPT + "\n")  # the end of input ends the chat


@pytest.mark.parametrize("ranks, extra", [(1, ["--stages", "2"]), (2, [])], ids=["stages-2", "mlx.launch-2"])
def test_ctrl_c_at_the_prompt_stops_every_rank(hf_checkpoint, ranks, extra):
    tag = uuid.uuid4().hex
    proc = start(command(hf_checkpoint, ranks, extra), tag)
    out, err = bytearray(), bytearray()
    readers = [threading.Thread(target=drain, args=(stream, buf), daemon=True)
               for stream, buf in ((proc.stdout, out), (proc.stderr, err))]
    for reader in readers:
        reader.start()
    try:
        deadline = time.monotonic() + 180
        while b"chat: type a message" not in err and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert b"chat: type a message" in err, err.decode(errors="replace")[-3000:]
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends: the whole foreground group
        status = proc.wait(timeout=30)
        for reader in readers:
            reader.join(10)
    finally:
        kill_group(proc)
    assert_all_gone(tag)
    text = err.decode(errors="replace")
    if ranks == 1:
        assert status == 0 and "stopped by SIGINT" in text and "Traceback" not in text, text[-3000:]
    else:
        # mlx.launch's own loop dies of the KeyboardInterrupt (its traceback, and the ranks' last lines
        # lost); it still reports any rank that exits non-zero.
        assert "exited with code" not in text and "was killed" not in text, text[-3000:]
        assert "/distributed/" not in text and "run_trinity.py" not in text, text[-3000:]  # no rank's traceback


def test_a_tokenizer_without_a_chat_template_is_refused(hf_checkpoint, tmp_path):
    import shutil

    model = shutil.copytree(hf_checkpoint, tmp_path / "plain")
    config = json.loads((model / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    status, out, err = chat(model, ["hi"])
    assert status == 2 and "error: --chat: the model's tokenizer has no chat template" in err, err[-3000:]
    assert "Traceback" not in err


def test_reasoning_apart_from_the_answer_and_in_the_history(tmp_path):
    """The thinking checkpoint (tests/tool_checkpoint.py): its reasoning streams to stderr, its answer to
    stdout, and the next turn's prompt holds both, as the chat template renders them."""
    model = make_think_checkpoint(tmp_path / "think")
    status, out, err = chat(model, ["hi", "again"], 1, ["--stages", "2"])
    assert status == 0 and "Traceback" not in err, err[-3000:]
    thought, said = "".join(REASONING), "".join(ANSWER)
    assert replies(out) == [said, said] and err.count(f"thinking: {thought}\n") == 2
    first, second = turns(err)
    assert first["generated"] == 5 and "5 generated; 3 reasoning;" in err
    tokenizer = load_tokenizer(model)
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": said, "reasoning_content": thought},
               {"role": "user", "content": "again"}]
    assert second["prompt"] == len(tokenizer.apply_chat_template(history, add_generation_prompt=True))
