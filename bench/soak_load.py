"""The soak's load: client threads sending random gRPC requests, and the checks on what comes back.

Soak (one per soak) runs `--clients` threads of Soak.client; each request is invalid (must get
INVALID_ARGUMENT), cancelled mid-stream, or runs to its end; greedy streams are compared with
one-device mlx-lm (Reference, memoized per prompt), sampled ones checked for shape. Stats counts
the outcomes. bench/soak.py describes the mix.
"""

import logging
import json
import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Dict, List, Tuple

import grpc

from distributed.runtime.request import MAX_STOPS
from distributed.serving.proto import generation_pb2 as pb

log = logging.getLogger("bench")

WORDS = ("the quick brown fox jumps over a lazy dog while seven tired engineers watch memory "
         "graphs climb and fall across four small ranks").split()


class Reference:
    """Greedy tokens from one-device mlx-lm, memoized per prompt (tests/reference.py's approach)."""

    def __init__(self, model_path: Path, max_new: int):
        import mlx.core as mx
        from mlx_lm.generate import generate_step
        from mlx_lm.utils import load_model, load_tokenizer

        from distributed.shard.config import model_args, read_config

        self.mx, self.generate_step = mx, generate_step
        config = read_config(model_path)
        # HF-layout configs carry rope_parameters, which mlx-lm's ModelArgs ignores.
        self.model, _ = load_model(Path(model_path), model_config={"rope_theta": model_args(config).rope_theta})
        self.tokenizer = load_tokenizer(Path(model_path), eos_token_ids=config.get("eos_token_id"))
        self.eos = set(self.tokenizer.eos_token_ids)
        self.max_new = max_new
        self.lock = threading.Lock()
        self.memo: Dict[Tuple[int, ...], Tuple[List[int], List[float], List[float], bool]] = {}
        self.computed = 0

    def encode(self, text: str) -> List[int]:
        with self.lock:
            return list(self.tokenizer.encode(text))

    def greedy(self, ids: List[int], n: int):
        """(tokens, logprobs, top-2 margins, hit EOS) for up to n tokens."""
        key = tuple(ids)
        with self.lock:
            if key not in self.memo or (len(self.memo[key][0]) < n and not self.memo[key][3]):
                tokens, logprobs, margins, eos = [], [], [], False
                mx = self.mx
                for token, lp in self.generate_step(mx.array(ids), self.model, max_tokens=max(n, self.max_new)):
                    top2 = mx.topk(lp, 2).tolist()
                    margins.append(abs(top2[1] - top2[0]))
                    if token in self.eos:
                        eos = True
                        break
                    tokens.append(int(token))
                    logprobs.append(lp[token].item())
                self.memo[key] = (tokens, logprobs, margins, eos)
                self.computed += 1
            tokens, logprobs, margins, eos = self.memo[key]
        return tokens[:n], logprobs[:n], margins, eos and len(tokens) < n


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts: Counter = Counter()
        self.errors: List[str] = []
        self.wrong: List[dict] = []
        self.near_ties: List[dict] = []
        self.tokens = 0
        self.max_logprob_diff = 0.0

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n

    def error(self, message: str) -> None:
        with self.lock:
            self.counts["errors"] += 1
            if len(self.errors) < 50:
                self.errors.append(message)
        log.info(f"soak: ERROR {message}")


class Soak:
    def __init__(self, args, stub, info, reference: Reference, stats: Stats, end: float):
        self.args, self.stub, self.info, self.ref, self.stats, self.end = args, stub, info, reference, stats, end
        rng = random.Random(args.seed)
        self.pool = [self.random_ids(rng) for _ in range(args.pool)]
        self.broken = threading.Event()  # the ring is down: nothing more to learn
        self.time_up = threading.Event()
        self.lock = threading.Lock()
        self.active: set = set()  # calls in flight

    def cut_in_flight(self) -> None:
        """Time is up: cancel what is still streaming or queued (counted apart, not as requests)."""
        self.time_up.set()
        with self.lock:
            calls = list(self.active)
        for call in calls:
            call.cancel()

    def random_ids(self, rng: random.Random) -> List[int]:
        # Mostly short prompts, some long ones (past the sliding window).
        n = rng.randint(1, 24) if rng.random() < 0.6 else rng.randint(1, self.args.max_prompt)
        return [rng.randrange(0, 256) for _ in range(n)]

    def prompt(self, rng: random.Random) -> Tuple[dict, List[int]]:
        """Request fields for a prompt, and its token ids."""
        if rng.random() < 0.2:
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))
            return {"prompt": text}, self.ref.encode(text)
        ids = rng.choice(self.pool) if rng.random() < 0.7 else self.random_ids(rng)
        return {"token_ids": ids}, ids

    def invalid(self, rng: random.Random) -> Tuple[str, dict]:
        info = self.info
        ids = [rng.randrange(0, 256) for _ in range(rng.randint(1, 8))]
        cases = [
            ("temperature<0", dict(token_ids=ids, temperature=-rng.uniform(0.01, 5))),
            ("top_p=0", dict(token_ids=ids, top_p=0.0)),
            ("top_p>1", dict(token_ids=ids, top_p=rng.uniform(1.01, 3))),
            ("min_p>1", dict(token_ids=ids, min_p=rng.uniform(1.01, 3))),
            ("top_k<0", dict(token_ids=ids, top_k=-rng.randint(1, 50))),
            ("token out of vocab", dict(token_ids=ids + [info.vocab_size + rng.randint(0, 10**6)])),
            ("prompt too long", dict(token_ids=[rng.randrange(0, 256) for _ in range(info.max_context + 1)],
                                     max_tokens=1)),
            # (max_tokens above the cap is clamped now, as vLLM and llama.cpp do: not invalid)
            ("context size past the context", dict(token_ids=ids, repetition_penalty=1.1,
                                                   repetition_context_size=info.max_context + 1)),
            ("too many stop strings", dict(token_ids=ids, stop=["x"] * (MAX_STOPS + 1))),
            ("max_tokens=0", dict(token_ids=ids, max_tokens=0)),
        ]
        return rng.choice(cases)

    def client(self, index: int) -> None:
        rng = random.Random(self.args.seed * 1000 + index + 1)
        first = True
        while time.monotonic() < self.end and not self.broken.is_set():
            roll = rng.random()
            if first:  # so that even a short soak has each kind: client 0 starts invalid, client 1 cancelled
                roll = {0: 0.0, 1: 0.1}.get(index, roll)
                first = False
            errors = self.stats.counts["errors"]
            try:
                if roll < 0.05:
                    self.run_invalid(rng)
                elif roll < 0.15:
                    self.run_valid(rng, cancel=True)
                else:
                    self.run_valid(rng, cancel=False)
            except Exception as e:  # a bug of this script must not pass for a clean soak
                self.stats.error(f"client {index}: {type(e).__name__}: {e}")
            if self.stats.counts["errors"] > errors:
                time.sleep(0.2)  # do not hammer a server in trouble

    def run_invalid(self, rng: random.Random) -> None:
        name, fields = self.invalid(rng)
        try:
            for _ in self.stub.Generate(pb.GenerateRequest(**fields), timeout=self.args.request_timeout):
                pass
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                self.stats.add("invalid_rejected")
                return
            self.stats.error(f"invalid request ({name}) got {e.code().name}: {e.details()}")
            return
        self.stats.error(f"invalid request ({name}) was accepted")

    def run_valid(self, rng: random.Random, cancel: bool) -> None:
        fields, ids = self.prompt(rng)
        n = rng.randint(1, self.args.max_new)
        greedy = rng.random() < 0.7
        if cancel:
            n = max(n, 4)
        fields["max_tokens"] = n
        if greedy:
            fields["temperature"] = 0.0
        else:
            fields.update(temperature=rng.uniform(0.3, 1.5), top_p=rng.uniform(0.5, 1.0), top_k=rng.randint(0, 40),
                          min_p=rng.uniform(0.0, 0.1), seed=rng.randrange(2**32))
        cancel_after = rng.randint(1, n - 1) if cancel else None
        tokens, logprobs, finish, usage = [], [], None, None
        call = self.stub.Generate(pb.GenerateRequest(**fields), timeout=self.args.request_timeout)
        with self.lock:
            self.active.add(call)
        cancelled = cut = False
        try:
            for r in call:
                tokens += list(r.token_ids)
                logprobs += list(r.logprobs)
                if r.finish_reason:
                    finish, usage = r.finish_reason, r.usage
                if cancel_after is not None and len(tokens) >= cancel_after and not finish:
                    call.cancel()
                    cancelled = True
                    break
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED and self.time_up.is_set() and not cancelled:
                cancelled = cut = True  # the soak's time was up: cut short, not counted
            elif not (cancelled and e.code() == grpc.StatusCode.CANCELLED):
                what = "greedy" if greedy else "sampled"
                self.stats.error(f"{what} request ({len(ids)} prompt tokens, max_tokens {n}) got "
                                 f"{e.code().name}: {e.details()}")
                return
        finally:
            with self.lock:
                self.active.discard(call)
        self.stats.add("tokens", len(tokens))
        if not cancelled and not self.check_shape(ids, n, tokens, logprobs, finish, usage):
            return
        if greedy:
            verdict = self.check_greedy(ids, n, tokens, logprobs, finish, partial=cancelled)
            if verdict != "ok":
                return  # counted as a wrong output or a near tie
        # Exactly one outcome per request: ok_greedy, ok_sampled or cancelled (the rest above).
        if cut:
            self.stats.add("cut_at_end")  # not counted as a request
        elif cancelled:
            self.stats.add("cancelled")
            if greedy:
                self.stats.add("cancelled_prefix_checked")
        else:
            self.stats.add("ok_greedy" if greedy else "ok_sampled")
            if cancel:
                self.stats.add("cancel_too_late")  # it finished before the chosen token

    def check_shape(self, ids, n, tokens, logprobs, finish, usage) -> bool:
        problems = []
        if finish not in ("stop", "length"):
            problems.append(f"finish_reason {finish!r}")
        if len(tokens) > n or (finish == "length" and len(tokens) != n):
            problems.append(f"{len(tokens)} tokens for max_tokens {n} ({finish})")
        if len(logprobs) != len(tokens):
            problems.append(f"{len(logprobs)} logprobs for {len(tokens)} tokens")
        if any(not 0 <= t < self.info.vocab_size for t in tokens):
            problems.append("a token id outside the vocabulary")
        if any(not lp <= 1e-4 for lp in logprobs):
            problems.append("a logprob above 0")
        if usage is not None and (usage.completion_tokens != len(tokens) or usage.prompt_tokens != len(ids)):
            problems.append(f"usage {usage.prompt_tokens}+{usage.completion_tokens} for {len(ids)}+{len(tokens)}")
        if problems:
            self.stats.error(f"malformed stream ({len(ids)} prompt tokens): " + "; ".join(problems))
        return not problems

    def check_greedy(self, ids, n, tokens, logprobs, finish, partial: bool) -> str:
        """"ok", "wrong" or "near tie" (the last two counted here)."""
        ref_tokens, ref_logprobs, margins, ref_eos = self.ref.greedy(ids, n)
        expected = ref_tokens[: len(tokens)] if partial else ref_tokens
        record = {"prompt_len": len(ids), "prompt_head": ids[:16], "max_tokens": n, "got": tokens,
                  "expected": expected, "finish": finish, "partial": partial}
        if tokens != expected or (not partial and finish != ("stop" if ref_eos else "length")):
            at = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), min(len(tokens), len(expected)))
            margin = margins[at] if at < len(margins) else None
            record.update(diverges_at=at, reference_top2_margin=margin)
            with self.stats.lock:
                if margin is not None and margin < self.args.tie_tolerance:
                    self.stats.near_ties.append(record)
                    self.stats.counts["near_tie_divergences"] += 1
                    return "near tie"
                self.stats.counts["wrong_outputs"] += 1
                if len(self.stats.wrong) < 20:
                    self.stats.wrong.append(record)
            log.info(f"soak: WRONG OUTPUT {json.dumps(record)}")
            return "wrong"
        diff = max((abs(a - b) for a, b in zip(logprobs, ref_logprobs)), default=0.0)
        with self.stats.lock:
            self.stats.max_logprob_diff = max(self.stats.max_logprob_diff, diff)
            if diff <= self.args.logprob_tolerance:
                return "ok"
            self.stats.counts["wrong_outputs"] += 1
            record["logprob_diff"] = diff
            if len(self.stats.wrong) < 20:
                self.stats.wrong.append(record)
        log.info(f"soak: WRONG LOGPROBS {json.dumps(record)}")
