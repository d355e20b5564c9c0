"""The interactive chat on rank 0 (run_trinity.py --chat): each line on stdin is a
user message, and the reply streams to stdout as it is generated.

Every turn sends the whole conversation through the chat template, as an OpenAI
client does, to the same Scheduler the servers use; its prefix cache restores
the KV caches of the turns before, so a turn prefills only what is new. The chat
runs on a thread of its own, as the network front ends do, while the scheduler
runs on the main thread (parking the other ranks between turns).

Where the checkpoint thinks (think tokens), each reply is split as the servers split it
(chat_format.py): the reasoning streams to stderr after "thinking: ", apart from the answer
on stdout, and stays in the history (the assistant turn's reasoning_content, which the chat
template renders as it renders an API client's).
"""

import os
import select
import sys
import threading
import time
from typing import Callable, List, Optional, TextIO

from .. import TrinityError
from ..runtime.request import GenerationRequest, RequestError, TokenEvent
from ..runtime.scheduler import Scheduler
from .chat_format import ReplySplitter, prompt_ids

PROMPT = ">>> "
COMMANDS = {
    "/reset": "forget the conversation",
    "/exit": "stop every rank (also /quit, end of input, Ctrl-C)",
    "/help": "this list",
}
POLL_S = 0.1  # how often a wait for input looks for a stop


class Conversation:
    """The messages so far; the prompt of the next turn."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.messages: List[dict] = []

    def prompt_ids(self, user: str) -> List[int]:
        return prompt_ids(self.tokenizer, messages=[*self.messages, {"role": "user", "content": user}])

    def add(self, user: str, reply: str, reasoning: str = "") -> None:
        self.messages += [{"role": "user", "content": user},
                          {"role": "assistant", "content": reply, **({"reasoning_content": reasoning} if reasoning else {})}]

    def reset(self) -> None:
        self.messages = []


class LineReader:
    """Lines from a file descriptor, read in short waits so that a stop is noticed:
    a thread blocked in read() would keep the process from ending (stop signals
    reach another thread, which cannot interrupt it)."""

    def __init__(self, fd: int, stopped: threading.Event):
        self.fd, self.stopped = fd, stopped
        self._buffer = b""
        self._eof = False

    def readline(self) -> Optional[str]:
        """The next line without its newline; None at the end of input or a stop."""
        while b"\n" not in self._buffer and not self._eof:
            if self.stopped.is_set():
                return None
            if select.select([self.fd], [], [], POLL_S)[0]:
                data = os.read(self.fd, 65536)
                self._buffer += data
                self._eof = not data
        if not self._buffer:
            return None
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode(errors="replace").rstrip("\r")


class Chat:
    """Reads stdin, runs one turn at a time, prints replies and a stats line per
    turn (stderr). Ends at /exit or the end of input by stopping the scheduler;
    stop() (a stop signal) ends it as well."""

    def __init__(self, scheduler: Scheduler, tokenizer, make_request: Callable[[List[int]], GenerationRequest],
                 fd: int = 0, out: TextIO = sys.stdout, err: TextIO = sys.stderr):
        if getattr(tokenizer, "chat_template", None) is None:
            raise TrinityError("--chat: the model's tokenizer has no chat template")
        self.scheduler, self.make_request = scheduler, make_request
        self.conversation = Conversation(tokenizer)
        self.out, self.err = out, err
        self.stopped = threading.Event()
        self.reader = LineReader(fd, self.stopped)
        self.error: Optional[str] = None  # a turn that failed (the ring broke)
        self._thread = threading.Thread(target=self._run, name="chat", daemon=True)

    def start(self) -> "Chat":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()

    def join(self, timeout: Optional[float] = None) -> None:
        self._thread.join(timeout)

    def _say(self, text: str) -> None:
        print(text, file=self.err, flush=True)

    def _run(self) -> None:
        self._say("chat: type a message; " + ", ".join(f"{c} {what}" for c, what in COMMANDS.items()))
        try:
            while not self.stopped.is_set():
                self.out.write(PROMPT)
                self.out.flush()
                line = self.reader.readline()
                if line is None:
                    self.out.write("\n")
                    break
                line = line.strip()
                if line in ("/exit", "/quit"):
                    break
                if line == "/reset":
                    self.conversation.reset()
                    self._say("chat: conversation forgotten")
                elif line == "/help" or line.startswith("/"):
                    prefix = "" if line == "/help" else f"chat: unknown command {line}; "
                    self._say(prefix + "commands: " + ", ".join(f"{c} {what}" for c, what in COMMANDS.items()))
                elif line and not self._turn(line):
                    break
        finally:
            self.stopped.set()
            self.scheduler.stop()  # the main thread's serve_forever() returns
            self.out.flush()

    def _turn(self, user: str) -> bool:
        """One exchange; False when the chat cannot go on (the ring broke, a stop)."""
        try:
            request = self.make_request(self.conversation.prompt_ids(user))
        except RequestError as e:  # e.g. the conversation outgrew the context
            self._say(f"error: {e} (/reset starts a new conversation)")
            return True
        sent = time.perf_counter()
        first, parts, thoughts, reasoning_tokens = None, [], [], 0
        split = ReplySplitter(self.conversation.tokenizer, None, request.prompt_ids)
        try:
            handle = self.scheduler.submit(request)
        except Exception as e:  # the ring is down
            self.error = str(e)
            return False
        for event in handle.events():
            if isinstance(event, TokenEvent):
                first = time.perf_counter() - sent if first is None else first
                reasoning_tokens += split.state == "reasoning"
            pieces = [split.feed(event.text)] + ([split.finish()] if not isinstance(event, TokenEvent) else [])
            for reasoning, text, _ in pieces:
                self._show(reasoning, text, thoughts, parts)
        if thoughts and not parts:
            self.err.write("\n")  # the reasoning's line ends even where no answer came
        self.out.write("\n")
        if event.finish_reason == "error":
            if not self.stopped.is_set():  # not our own stop: the ring broke
                self.error = event.error
            return False
        self.conversation.add(user, "".join(parts), "".join(thoughts))
        self._say(f"[{event.finish_reason}: {event.prompt_tokens} prompt tokens ({event.cached_tokens} cached), "
                  f"{event.completion_tokens} generated;" + (f" {reasoning_tokens} reasoning;" if split.thinks else "")
                  + f" first token after {first or 0:.2f} s, "
                  f"{event.generation_tokens_per_sec:.1f} tokens-per-sec]")
        return True


    def _show(self, reasoning: str, text: str, thoughts: List[str], parts: List[str]) -> None:
        """Reasoning on stderr (its line begun with "thinking: "), the answer on stdout."""
        if reasoning:
            self.err.write(("" if thoughts else "thinking: ") + reasoning)
            self.err.flush()
            thoughts.append(reasoning)
        if text:
            if thoughts and not parts:
                self.err.write("\n")
                self.err.flush()
            parts.append(text)
            self.out.write(text)
            self.out.flush()


def chat(scheduler: Scheduler, make_request: Callable[[List[int]], GenerationRequest],
         running: Callable[[Callable[[], None]], None]) -> None:
    """Chat until /exit, the end of input, a stop or a failure: the chat on its thread,
    the scheduler on this one. `running(stop)` hands over what a stop signal calls."""
    session = Chat(scheduler, scheduler.tokenizer, make_request)
    running(lambda: (session.stop(), scheduler.stop()))
    session.start()
    scheduler.serve_forever()
    session.stop()
    session.join()
    print(scheduler.prefix_cache.summary(), file=sys.stderr, flush=True)
    if scheduler.failure is not None or session.error:
        raise TrinityError(f"the pipeline is down: {scheduler.failure or session.error}")
