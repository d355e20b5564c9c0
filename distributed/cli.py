"""run_trinity.py (run-trinity), the script every rank runs: one generation, a chat or serving, across 1..N ranks.

    run-trinity --prompt "Hi"                      # 1 rank (in a checkout: python run_trinity.py)
    run-trinity --stages 2 --chat                  # 2 stages, one process, chat on stdin
    mlx.launch -n 2 run-trinity --prompt "Hi"      # 2 processes (ring)

Rank 0 prints; other ranks print nothing on stdout.
"""

import argparse
import logging
import json
import sys
import threading
from dataclasses import dataclass, fields
from typing import FrozenSet, List, Optional, Sequence, Tuple

from . import TrinityError, logs
from .help_format import HelpFormatter
from .runtime.batching import PREFILL_STEP_SIZE
from .runtime.request import GenerationRequest, RequestError, TokenEvent
from .runtime.scheduler import Scheduler
from .runtime.speculation import DEFAULT_DRAFT_TOKENS
from .serving.front_ends import start_front_ends
from .serving.metrics import Metrics
from .serving.options import ALLOWED_HOSTS_ENV, AUTH_TOKEN_ENV, ServeOptions, check_options, split_hosts
from .serving.request_log import RequestLog
from .serving.chat_format import ModelInfo, prompt_ids
from .shard.config import model_args
from .shard.memory import DEFAULT_CONTEXT, MAX_BATCH, parse_memory_limit
from .startup.join import Loaded, build_pipeline, join_ranks
from .startup.lifecycle import Lifecycle, RankStop, launched_by_launcher, launcher_restarts
from .startup.preflight import check_launch
from .startup.settings import (GenerationSettings, ModelSettings, RingSettings, ServingSettings, Settings,
                               SizingSettings, SpeculationSettings)
from .startup.sizing import Sizes, beside_draft, context_arg, memory_admission, serving_sizes

DEFAULT_PROMPT = "Explain pipeline parallelism in one sentence."
EPILOG = """\
examples (run-trinity is installed by pip; in a checkout `python run_trinity.py` is the same):
  run-trinity --prompt "Hi"                                 1 rank
  run-trinity --stages 2 --chat                             a chat on stdin, 2 stages in one process
  mlx.launch -n 2 run-trinity --prompt "Hi"                 2 local ranks (ring)
  mlx.launch --hostfile hosts.json -- "$(which run-trinity)" --model REPO --serve 127.0.0.1:50051
  trinity-launch run --hostfile hosts.json -- run-trinity --model REPO --serve 127.0.0.1:50051

more in the docs (docs/, a site: `mkdocs serve`), pages "command-line.md" (every flag), "chatting.md",
"serving.md", "launcher.md" (planning the split), "failures.md" (stopping) and "architecture.md"
(where things are in the code)."""

log = logging.getLogger(__name__)


def build_parser(parser_class=argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = parser_class(description=__doc__.split("\n")[0], epilog=EPILOG, formatter_class=HelpFormatter)
    p.add_argument("--model", help="local checkpoint directory or Hugging Face repo id "
                   "(default: the embedded tiny AFMoE, trained on Python's own docs)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="text; the chat template is applied unless --no-chat-template "
                        f"(default: {DEFAULT_PROMPT!r})")
    prompt.add_argument("--prompt-ids", help="comma-separated token ids, fed as they are")
    prompt.add_argument("--chat", action="store_true", help="an interactive chat on rank 0's stdin: streamed replies, "
                        "the conversation kept (its KV caches reused through the prefix cache); /reset, /exit")
    p.add_argument("--no-chat-template", action="store_true", help="feed --prompt as raw text")
    p.add_argument("--max-tokens", type=int, default=100, help="tokens to generate (per turn with --chat)")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1 disables")
    p.add_argument("--top-k", type=int, default=0, help="0 disables")
    p.add_argument("--min-p", type=float, default=0.0, help="0 disables")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--log-level", choices=logs.LEVELS, default="info", help="stderr's threshold (distributed/logs.py)")
    p.add_argument("--stages", type=int, default=1, help="run N stages inside this one process")
    p.add_argument("--split", help="layers per rank, e.g. 10,12,10; `auto` plans from each rank's memory "
                   "(default: an even split, rank 0 taking the fewest)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="T",
                   help="split every layer across T ranks (attention by KV heads, MLPs and experts by width): one "
                   "chat gets faster with each rank; T = the number of ranks, or groups of T as pipeline stages "
                   "(MPI); 1: the pipeline (layers split)")
    p.add_argument("--transport", choices=["auto", "p2p", "collective"], default="auto",
                   help="how hidden states move between ranks: point-to-point send/recv, or collectives "
                   "(for backends without send/recv, such as NCCL); auto picks collective under NCCL")
    p.add_argument("--prefill-step-size", type=int, default=PREFILL_STEP_SIZE,
                   help="prompt tokens per prefill frame (a batch of B prompts: N/B each); "
                   "several ranks work on successive chunks at once")
    p.add_argument("--max-batch", type=int, default=None,
                   help="sequences decoding together (split into one micro-batch per rank); default: as many "
                   f"as fit beside the weights on the tightest rank, each with a --max-context-token KV cache "
                   f"(for this estimate --max-context defaults to {DEFAULT_CONTEXT}), at most {MAX_BATCH}")
    p.add_argument("--prefill-batch-tokens", type=int, default=2048,
                   help="waiting prompts prefill together up to this many tokens (each padded to the longest)")
    p.add_argument("--max-context", type=context_arg, default=None, metavar="N|auto",
                   help="prompt + max tokens limit (default: max_position_embeddings); auto: the longest at which "
                   "--max-batch sequences' KV caches fit beside the weights on the tightest rank")
    p.add_argument("--memory-limit", type=parse_memory_limit, default=None, metavar="BYTES|auto",
                   help="memory each rank plans with and MLX holds it to (set_memory_limit, and the buffer cache "
                   "bounded to the planning margin); auto: its share of its host's memory (ranks of one host divide "
                   "it); default: that share, MLX unbounded")
    faults = p.add_argument_group("faults (several ranks)")
    faults.add_argument("--peer-timeout", type=float, default=5.0, metavar="SECONDS",
                        help="a rank silent this long on the control channel counts as failed: every rank exits")
    faults.add_argument("--connect-timeout", type=float, default=60.0, metavar="SECONDS",
                        help="at start-up, how long rank 0 waits for every rank to connect")
    serve = p.add_argument_group("serving (rank 0)")
    serve.add_argument("--serve", metavar="HOST:PORT", help="serve gRPC (trinity.v1.Generation) instead of one generation")
    serve.add_argument("--http", metavar="HOST:PORT", help="also serve the OpenAI-compatible HTTP API "
                       "(with GET /health and GET /metrics, Prometheus)")
    serve.add_argument("--metrics", metavar="HOST:PORT", help="serve GET /metrics (Prometheus) and GET /health on "
                       "a port of their own (e.g. when only gRPC is served)")
    serve.add_argument("--auth-token", help=f"require `authorization: Bearer TOKEN` (or set {AUTH_TOKEN_ENV})")
    serve.add_argument("--insecure", action="store_true", help="allow a non-loopback bind without a token")
    serve.add_argument("--allowed-hosts", metavar="NAME[,NAME…]",
                       help="without --auth-token, the HTTP ports answer only local names and IP addresses in "
                       "Host, and browsers' requests only from pages of those (Origin): these names too; '*' lets "
                       f"any in (or set {ALLOWED_HOSTS_ENV})")
    serve.add_argument("--tls-cert", help="PEM certificate chain for TLS")
    serve.add_argument("--tls-key", help="PEM private key for TLS")
    serve.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond this (and --max-batch running) get RESOURCE_EXHAUSTED")
    serve.add_argument("--max-tokens-cap", type=int, default=4096, help="largest max_tokens a client may ask for")
    serve.add_argument("--prefix-cache-bytes", type=int, default=None, metavar="N",
                       help="with --serve or --chat: KV caches kept across requests, so a prompt that extends an "
                       "earlier one (a chat's next turn) prefills only the rest: at most N bytes on any rank; 0 "
                       "disables; default: a quarter of what the tightest rank has beside its weights (its usable "
                       "memory measured before loading, less 10%%), set aside before the default --max-batch")
    speculation_arguments(p)
    return p


def speculation_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (output unchanged: greedy token for token, sampled in distribution)")
    g.add_argument("--prompt-lookup", action="store_true",
                   help="draft from the prompt and the text so far (n-gram lookup, no model): a sequence decoding "
                   "alone verifies up to --num-draft-tokens drafts in one pass through the ring")
    g.add_argument("--draft-model", metavar="PATH_OR_REPO",
                   help="draft with this small AFMoE checkpoint, which must share the model's tokenizer (loaded on "
                   "rank 0 only, counted in its memory); with --prompt-lookup too, a lookup match wins")
    g.add_argument("--speculate", choices=["measured", "always"], default="measured",
                   help="measured: a sequence whose passes cost more per token than its plain steps (timed on rank "
                   "0) decodes plainly between passes; always: every pass its drafter proposes (for tests)")
    g.add_argument("--num-draft-tokens", type=int, default=DEFAULT_DRAFT_TOKENS, metavar="K",
                   help="most drafts per verification pass (each sequence adapts: two more after a pass whose drafts "
                   "all held, one fewer otherwise)")
    g.add_argument("--no-draft-ahead", dest="draft_ahead", action="store_false",
                   help="one verification frame of a sequence in the ring at a time; by default, with several "
                   "ranks, a greedy sequence whose drafts held drafts its next frames while one is in the ring, as "
                   "if its drafts hold (up to one frame per rank; those behind a rejection are dropped)")


def read_settings(namespace: argparse.Namespace) -> Settings:
    """The parsed command line in its groups: each flag's dest is a field of one of them."""
    values = vars(namespace)

    def group(cls):
        return cls(**{f.name: values[f.name] for f in fields(cls)})

    return Settings(model=ModelSettings(values["model"]), generation=group(GenerationSettings),
                    ring=group(RingSettings), sizing=group(SizingSettings), serving=group(ServingSettings),
                    speculation=group(SpeculationSettings), log_level=values["log_level"])


def parse_settings(argv: Optional[List[str]] = None) -> Settings:
    return read_settings(build_parser().parse_args(argv))


class CommandError(TrinityError):
    """A rank's command line that run-trinity's parser refuses (read by the launcher)."""


class _RefusingParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise CommandError(f"the ranks' command: {message}")


@dataclass(frozen=True)
class RankCommand:
    """A rank's command line (a program, then run-trinity's flags) as run-trinity's own parser
    reads it, for the launcher: what it says, and which flags it gives (their dests)."""

    argv: Tuple[str, ...]
    settings: Settings
    given: FrozenSet[str]


def read_command(argv: Sequence[str]) -> RankCommand:
    """Raises CommandError where run-trinity would refuse its flags; the program's own words
    (`python -m run_trinity`) are left over, as are flags run-trinity lacks (the ranks refuse those)."""
    parser = build_parser(_RefusingParser)
    namespace, _ = parser.parse_known_args(list(argv))
    unset = object()  # a dest the parser finds set already keeps its value unless a flag gives one
    seen, _ = parser.parse_known_args(list(argv), argparse.Namespace(**dict.fromkeys(vars(namespace), unset)))
    given = frozenset(dest for dest, value in vars(seen).items() if value is not unset)
    return RankCommand(tuple(argv), read_settings(namespace), given)


def without_flags(argv: Sequence[str], flags: Sequence[str]) -> List[str]:
    """argv without these flags (each taking one value) and their values, every occurrence,
    abbreviated or not, as run-trinity's parser reads them."""
    read_command(argv)  # refuses what run-trinity would (an ambiguous abbreviation, a bad value)
    only = _RefusingParser(add_help=False)
    for flag in flags:
        only.add_argument(flag)
    return only.parse_known_args(list(argv))[1]


def validate(settings: Settings) -> None:
    """Checks that need no model; sampling values are checked with the request."""
    ring, sizing, generation = settings.ring, settings.sizing, settings.generation
    if ring.stages < 1:
        raise TrinityError(f"--stages must be at least 1, got {ring.stages}")
    for flag, value in (("--peer-timeout", ring.peer_timeout), ("--connect-timeout", ring.connect_timeout)):
        if not value > 0:
            raise TrinityError(f"{flag} must be positive, got {value}")
    if sizing.prefill_step_size < 1:
        raise TrinityError(f"--prefill-step-size must be at least 1, got {sizing.prefill_step_size}")
    if sizing.max_batch is not None and sizing.max_batch < 1:
        raise TrinityError(f"--max-batch must be at least 1, got {sizing.max_batch}")
    if sizing.prefill_batch_tokens < 1:
        raise TrinityError(f"--prefill-batch-tokens must be at least 1, got {sizing.prefill_batch_tokens}")
    settings.speculation.options()
    if sizing.prefix_cache_bytes is not None and sizing.prefix_cache_bytes < 0:
        raise TrinityError(f"--prefix-cache-bytes must be >= 0, got {sizing.prefix_cache_bytes}")
    if generation.chat:
        clashes = (("--serve", settings.serving.serve), ("--http", settings.serving.http),
                   ("--json", generation.json), ("--no-chat-template", generation.no_chat_template))
        clash = next((flag for flag, value in clashes if value), None)
        if clash:
            raise TrinityError(f"--chat cannot be combined with {clash}")
    try:
        _request(generation, []).validate_sampling()
    except RequestError as e:
        raise _flag_error(e) from None


def _request(generation: GenerationSettings, prompt_ids: List[int]) -> GenerationRequest:
    return GenerationRequest(
        prompt_ids=prompt_ids,
        max_tokens=generation.max_tokens,
        temperature=generation.temp,
        top_p=generation.top_p,
        top_k=generation.top_k,
        min_p=generation.min_p,
        seed=generation.seed,
    )


def _flag_error(e: RequestError) -> TrinityError:
    flag = {"token_ids": "--prompt-ids", "temperature": "--temp"}.get(e.field, "--" + e.field.replace("_", "-"))
    return TrinityError(f"{flag}: {str(e).split(': ', 1)[1]}")


def build_request(generation: GenerationSettings, tokenizer, config, max_context: int) -> GenerationRequest:
    try:
        return validated_request(generation, prompt_tokens(generation, tokenizer), config, max_context)
    except RequestError as e:
        raise _flag_error(e) from None


def validated_request(generation: GenerationSettings, prompt_ids: List[int], config,
                      max_context: int) -> GenerationRequest:
    """The flags' request for `prompt_ids` within `max_context`; raises RequestError."""
    request = _request(generation, prompt_ids)
    request.validate(model_args(config).vocab_size, max_context)
    return request


def prompt_tokens(generation: GenerationSettings, tokenizer) -> List[int]:
    if generation.prompt_ids is not None:
        try:
            ids = [int(t) for t in generation.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise TrinityError(f"--prompt-ids {generation.prompt_ids!r} is not a comma-separated list of "
                               "integers") from None
        return ids
    text = DEFAULT_PROMPT if generation.prompt is None else generation.prompt
    if not text:
        raise TrinityError("--prompt: the prompt is empty")
    try:
        return prompt_ids(tokenizer, prompt=text, chat_template=not generation.no_chat_template)
    except RequestError as e:
        raise _flag_error(e) from None


def generate_once(scheduler: Scheduler, request: GenerationRequest, stream: bool, stop: RankStop) -> dict:
    """Run one request on this (main) thread; a plain-Python thread prints text as it comes.
    A stop request cancels it: what was generated so far is the result."""
    handle = scheduler.submit(request)
    stop.running(handle.cancel)
    events = []

    def consume():
        for event in handle.events():
            events.append(event)
            if stream:
                print(event.text, end="", flush=True)
        if stream:
            print(flush=True)

    printer = threading.Thread(target=consume, name="printer")
    printer.start()
    scheduler.run_pending()
    printer.join()
    finish = events[-1]
    if finish.finish_reason == "error":
        raise TrinityError(f"generation failed: {finish.error}")
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    return {
        "text": "".join(e.text for e in events),
        "token_ids": [e.token_id for e in tokens],
        "logprobs": [e.logprob for e in tokens],
        "prompt_token_ids": request.prompt_ids,
        "finish_reason": finish.finish_reason,
        "prefill_tokens_per_sec": finish.prefill_tokens_per_sec,
        "generation_tokens_per_sec": finish.generation_tokens_per_sec,
    }


def print_summary(result: dict) -> None:
    print("=" * 10)
    print(f"Prompt: {len(result['prompt_token_ids'])} tokens, {result['prefill_tokens_per_sec']:.1f} tokens-per-sec")
    print(f"Generation: {len(result['token_ids'])} tokens, {result['generation_tokens_per_sec']:.1f} tokens-per-sec")
    for r in result["ranks"]:
        extra = " + embedding and head" if r["embed"] else ""
        print(f"rank {r['rank']} ({r['host']}): layers [{r['layers'][0]}, {r['layers'][1]}){extra}, "
              f"peak memory {r['peak_memory_bytes'] / 2**20:.1f} MiB")


def serve_options(settings: Settings) -> ServeOptions:
    serving = settings.serving
    for flag, address in (("--http", serving.http), ("--metrics", serving.metrics)):
        if address and not serving.serve:
            raise TrinityError(f"{flag} needs --serve")
    return check_options(ServeOptions(
        grpc_address=serving.serve, http_address=serving.http, metrics_address=serving.metrics,
        auth_token=serving.auth_token, insecure=serving.insecure,
        allowed_hosts=split_hosts(serving.allowed_hosts) if serving.allowed_hosts is not None else None,
        tls_cert=serving.tls_cert, tls_key=serving.tls_key, max_queue=serving.max_queue,
        max_tokens_cap=serving.max_tokens_cap, max_batch=settings.sizing.max_batch,
    ))


GRACE_S = 1.0  # after a peer failed: for gRPC / HTTP threads to send their errors before the exit


class FrontEnds:
    """Rank 0's front ends (none without --serve), and what they say when another rank fails
    (an instance is the watchdog's on_failure): while the ring loads, they turn NOT_SERVING
    naming the failure; once the scheduler runs, it aborts first, ending every stream with it."""

    def __init__(self, options: Optional[ServeOptions]):
        self.options = options
        self.requests = RequestLog(Metrics(restarts=launcher_restarts())) if options is not None else None
        self.started: list = []
        self._scheduler: Optional[Scheduler] = None

    def start(self) -> None:
        """Listening, NOT_SERVING until attached."""
        if self.options is not None and not self.started:
            self.started = start_front_ends(self.options, self.requests)

    def running(self, scheduler: Scheduler) -> None:
        """The scheduler runs now: a failed rank aborts it."""
        self._scheduler = scheduler

    def attach(self, scheduler: Scheduler, tokenizer, info: ModelInfo) -> None:
        self.requests.metrics.attach(scheduler, info)
        for front_end in self.started:
            front_end.attach(scheduler, tokenizer, info)

    def not_serving(self, reason: str) -> None:
        for front_end in self.started:
            front_end.set_not_serving(reason)
        if self.requests is not None:
            self.requests.ring_failed(reason)

    def __call__(self, reason: str) -> None:
        (self._scheduler.abort if self._scheduler is not None else self.not_serving)(reason)

    def stop(self) -> None:
        for front_end in self.started:
            front_end.stop()


def join_and_load(settings: Settings, front_ends: FrontEnds, stop: RankStop) -> Optional[Loaded]:
    """Join the ranks and load this one's stage: what rank 0 holds, None on another rank once it
    has served the ring until rank 0 stopped it. Rank 0's front ends listen meanwhile."""
    control = check_launch()  # None: one process, or a backend that needs init first (MPI)
    if control is not None and control.rank == 0:
        front_ends.start()  # NOT_SERVING while the ranks connect and load
    group, watchdog = join_ranks(settings.ring, control,
                                 on_stop=lambda why: stop.lifecycle.request_stop(why, from_peer=True),
                                 on_failure=front_ends, grace=GRACE_S if front_ends.options is not None else 0.0)
    stop.joined(watchdog)
    if group.rank() == 0:
        front_ends.start()
    return build_pipeline(settings, group, watchdog, on_ready=stop.running)


def start_scheduler(settings: Settings, built: Loaded, front_ends: FrontEnds,
                    batch: Optional[int] = None) -> Tuple[Scheduler, Sizes, List[dict]]:
    """Rank 0 once loaded: the tokenizer, the drafter, the sizes from each rank's memory, and the
    scheduler (`batch`: a fixed batch, as a run's or a chat's 1); with them the rank table."""
    from mlx_lm.utils import load_tokenizer

    config, sizing = built.config, settings.sizing
    tokenizer = load_tokenizer(built.path, eos_token_ids=config.get("eos_token_id"))
    speculation = settings.speculation.loaded(tokenizer)
    ranks = built.pipeline.rank_info()
    for row, memory in zip(ranks, built.memory_bytes):
        row.update(memory_bytes=memory, memory_limited=sizing.memory_limit is not None)
    memory = beside_draft(sizing, settings.speculation.draft_model, config, built.memory_bytes, len(ranks))
    sizes = serving_sizes(sizing, config, ranks, memory, batch=batch)
    cache_bytes = sizes.prefix_cache_bytes if batch is None or settings.generation.chat else 0
    # The scheduler runs on this main thread (see Scheduler.start); front ends' threads only queue.
    scheduler = Scheduler(built.pipeline, tokenizer, max_queue=settings.serving.max_queue,
                          prefill_step_size=sizes.prefill_step_size, max_batch=sizes.max_batch,
                          on_failure=front_ends.not_serving, prefill_batch_tokens=sizing.prefill_batch_tokens,
                          prefix_cache_bytes=cache_bytes, speculation=speculation,
                          memory=memory_admission(sizing, config, ranks, memory, sizes),
                          chunk_budget=sizes.chunk_budget)
    front_ends.running(scheduler)  # ends every stream with the failed rank's name, then NOT_SERVING
    return scheduler, sizes, ranks


def serve(settings: Settings, built: Loaded, front_ends: FrontEnds, stop: RankStop) -> None:
    """Rank 0 with --serve: attach the scheduler to the front ends, serve until a signal."""
    scheduler, sizes, ranks = start_scheduler(settings, built, front_ends)
    log.info(f"prefix cache: up to {sizes.prefix_cache_bytes / 2**20:.1f} MiB on any rank"
             if sizes.prefix_cache_bytes else "prefix cache: off")
    info = ModelInfo(model_id=settings.model.name, vocab_size=model_args(built.config).vocab_size,
                     max_context=sizes.max_context, max_tokens_cap=front_ends.options.max_tokens_cap, ranks=ranks,
                     max_batch=sizes.max_batch)
    front_ends.attach(scheduler, scheduler.tokenizer, info)
    print(f"serving {info.model_id} on " + " and ".join(f.describe() for f in front_ends.started), flush=True)
    for line in sizes.lines:
        print(line, flush=True)
    stop.running(scheduler.stop)
    try:
        scheduler.serve_forever()
    finally:
        front_ends.stop()
        scheduler.close()
        log.info(scheduler.prefix_cache.summary())
        front_ends.requests.stopped(stop.lifecycle.reason or "stopped")
    if scheduler.failure is not None:
        raise TrinityError(f"the pipeline is down: {scheduler.failure}")


def generate(settings: Settings, built: Loaded, front_ends: FrontEnds, stop: RankStop) -> None:
    """Rank 0 without --serve: one generation, or a chat on stdin."""
    generation = settings.generation
    scheduler, sizes, _ = start_scheduler(settings, built, front_ends, batch=1)
    for line in sizes.lines[1:]:  # the context, with --max-context auto
        log.info(line)
    try:
        if generation.chat:
            from .serving.chat import chat

            return chat(scheduler, lambda ids: validated_request(generation, ids, built.config, sizes.max_context),
                        stop.running)
        request = build_request(generation, scheduler.tokenizer, built.config, sizes.max_context)
        result = generate_once(scheduler, request, stream=not generation.json, stop=stop)
        result["ranks"] = built.pipeline.rank_info()
        if scheduler.batcher.verifier.options.enabled:
            result["speculative"] = scheduler.batcher.verifier.stats.as_dict()
    finally:
        scheduler.close()
    if generation.json:
        print(json.dumps(result))
    else:
        print_summary(result)


def run(settings: Settings, stop: RankStop) -> None:
    validate(settings)
    front_ends = FrontEnds(serve_options(settings) if settings.serving.wanted else None)
    try:
        built = join_and_load(settings, front_ends, stop)
    except BaseException:
        front_ends.stop()
        raise
    if built is None:  # another rank: it served the ring until rank 0 stopped it
        return
    if front_ends.options is not None:
        serve(settings, built, front_ends, stop)
    else:
        generate(settings, built, front_ends, stop)


def main(argv: Optional[List[str]] = None) -> None:
    settings = parse_settings(argv)
    logs.configure(settings.log_level)
    lifecycle = Lifecycle().start(watch_parent=launched_by_launcher())
    stop = RankStop(lifecycle)
    lifecycle.on_stop(stop)
    try:
        run(settings, stop)
    except BrokenPipeError:  # whoever read our output is gone (a stop): nothing more to say
        stop.leave(None)
        sys.exit(0 if lifecycle.stopping.is_set() else 1)
    except TrinityError as e:
        stop.leave(str(e))
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except BaseException as e:
        stop.leave(f"{type(e).__name__}: {e}")
        raise
    stop.leave(None)  # a clean exit: the other ranks stop watching this one
