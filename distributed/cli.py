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
from typing import List, Optional

from . import TrinityError, logs
from .help_format import HelpFormatter
from .runtime.prefill import PREFILL_STEP_SIZE
from .runtime.request import GenerationRequest, RequestError, TokenEvent
from .runtime.scheduler import Scheduler
from .serving.front_ends import start_front_ends
from .serving.metrics import Metrics
from .serving.options import ALLOWED_HOSTS_ENV, AUTH_TOKEN_ENV, ServeOptions, check_options, split_hosts
from .serving.request_log import RequestLog
from .serving import speculation_flags
from .serving.requests import prompt_ids
from .shard.config import model_args
from .shard.kv_budget import DEFAULT_CONTEXT, MAX_BATCH
from .shard.memory_limit import parse_memory_limit
from .startup.join import build_pipeline, join_ranks
from .startup.sizing import beside_draft, context_arg, context_limit, memory_admission, serving_sizes
from .startup.lifecycle import Lifecycle, RankStop, launched_by_launcher, launcher_restarts
from .startup.preflight import check_launch
from .startup.watchdog import Watchdog

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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=EPILOG, formatter_class=HelpFormatter)
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
    speculation_flags.add_arguments(p)
    return p


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def validate(args: argparse.Namespace) -> None:
    """Checks that need no model; sampling values are checked with the request."""
    if args.stages < 1:
        raise TrinityError(f"--stages must be at least 1, got {args.stages}")
    for flag in ("peer_timeout", "connect_timeout"):
        if not getattr(args, flag) > 0:
            raise TrinityError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.prefill_step_size < 1:
        raise TrinityError(f"--prefill-step-size must be at least 1, got {args.prefill_step_size}")
    if args.max_batch is not None and args.max_batch < 1:
        raise TrinityError(f"--max-batch must be at least 1, got {args.max_batch}")
    if args.prefill_batch_tokens < 1:
        raise TrinityError(f"--prefill-batch-tokens must be at least 1, got {args.prefill_batch_tokens}")
    speculation_flags.options(args)
    if args.prefix_cache_bytes is not None and args.prefix_cache_bytes < 0:
        raise TrinityError(f"--prefix-cache-bytes must be >= 0, got {args.prefix_cache_bytes}")
    if args.chat:
        clash = next((f for f in ("serve", "http", "json", "no_chat_template") if getattr(args, f)), None)
        if clash:
            raise TrinityError(f"--chat cannot be combined with --{clash.replace('_', '-')}")
    try:
        _request(args, []).validate_sampling()
    except RequestError as e:
        raise _flag_error(e) from None


def _request(args, prompt_ids: List[int]) -> GenerationRequest:
    return GenerationRequest(
        prompt_ids=prompt_ids,
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
    )


def _flag_error(e: RequestError) -> TrinityError:
    flag = {"token_ids": "--prompt-ids", "temperature": "--temp"}.get(e.field, "--" + e.field.replace("_", "-"))
    return TrinityError(f"{flag}: {str(e).split(': ', 1)[1]}")


def build_request(args, tokenizer, config, max_context: Optional[int] = None) -> GenerationRequest:
    try:
        return validated_request(args, prompt_tokens(args, tokenizer), config, max_context)
    except RequestError as e:
        raise _flag_error(e) from None


def validated_request(args, prompt_ids: List[int], config, max_context: Optional[int] = None) -> GenerationRequest:
    """The flags' request for `prompt_ids` (within `max_context`, else --max-context's limit); raises RequestError."""
    request = _request(args, prompt_ids)
    request.validate(model_args(config).vocab_size, max_context or context_limit(args, config))
    return request


def prompt_tokens(args, tokenizer) -> List[int]:
    if args.prompt_ids is not None:
        try:
            ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise TrinityError(f"--prompt-ids {args.prompt_ids!r} is not a comma-separated list of integers") from None
        return ids
    text = DEFAULT_PROMPT if args.prompt is None else args.prompt
    if not text:
        raise TrinityError("--prompt: the prompt is empty")
    try:
        return prompt_ids(tokenizer, prompt=text, chat_template=not args.no_chat_template)
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


def serve_options(args) -> ServeOptions:
    for flag in ("http", "metrics"):
        if getattr(args, flag) and not args.serve:
            raise TrinityError(f"--{flag} needs --serve")
    return check_options(ServeOptions(
        grpc_address=args.serve, http_address=args.http, metrics_address=args.metrics,
        auth_token=args.auth_token, insecure=args.insecure,
        allowed_hosts=split_hosts(args.allowed_hosts) if args.allowed_hosts is not None else None,
        tls_cert=args.tls_cert, tls_key=args.tls_key, max_queue=args.max_queue, max_tokens_cap=args.max_tokens_cap,
        max_batch=args.max_batch,
    ))


GRACE_S = 1.0  # after a peer failed: for gRPC / HTTP threads to send their errors before the exit
_watchdog: Optional[Watchdog] = None  # main() tells the other ranks how this one ends


def serve(args, options: ServeOptions, front_ends, requests: RequestLog, group, watchdog: Optional[Watchdog],
          stop: RankStop) -> None:
    """Rank 0 with --serve: load, attach the scheduler to the front ends, serve until a signal."""
    from .serving.requests import ModelInfo

    def on_failure(reason: str) -> None:
        for front_end in front_ends:
            front_end.set_not_serving(reason)
        requests.ring_failed(reason)

    if watchdog is not None:  # a rank failing while we load: health says why, then we exit
        watchdog.on_failure, watchdog.grace = on_failure, GRACE_S
    try:
        built = build_pipeline(args, group, watchdog)
    except BaseException:
        for front_end in front_ends:
            front_end.stop()
        raise
    pipeline, path, config = built.pipeline, built.path, built.config
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    speculation = speculation_flags.loaded(args, tokenizer)
    ranks = pipeline.rank_info()
    for row, memory in zip(ranks, built.memory_bytes):
        row.update(memory_bytes=memory, memory_limited=args.memory_limit is not None)
    memory = beside_draft(args, config, built.memory_bytes, len(ranks))
    sizes = serving_sizes(args, config, ranks, memory)
    max_context, max_batch, prefix_cache_bytes = sizes.max_context, sizes.max_batch, sizes.prefix_cache_bytes

    # The scheduler runs on this main thread (see Scheduler.start); front ends' threads only queue.
    scheduler = Scheduler(pipeline, tokenizer, max_queue=options.max_queue,
                          prefill_step_size=sizes.prefill_step_size, max_batch=max_batch,
                          on_failure=on_failure, prefill_batch_tokens=args.prefill_batch_tokens,
                          prefix_cache_bytes=prefix_cache_bytes, speculation=speculation,
                          memory=memory_admission(args, config, ranks, memory, sizes),
                          chunk_budget=sizes.chunk_budget)
    log.info(f"prefix cache: up to {prefix_cache_bytes / 2**20:.1f} MiB on any rank" if prefix_cache_bytes
             else "prefix cache: off")
    if watchdog is not None:  # ends every stream with the failed rank's name, then NOT_SERVING
        watchdog.on_failure = scheduler.abort
    info = ModelInfo(
        model_id=args.model or "trinity-tiny",
        vocab_size=model_args(config).vocab_size,
        max_context=max_context,
        max_tokens_cap=options.max_tokens_cap,
        ranks=ranks,
        max_batch=max_batch,
    )
    requests.metrics.attach(scheduler, info)
    for front_end in front_ends:
        front_end.attach(scheduler, tokenizer, info)
    print(f"serving {info.model_id} on " + " and ".join(f.describe() for f in front_ends), flush=True)
    for line in sizes.lines:
        print(line, flush=True)
    stop.running(scheduler.stop)
    try:
        scheduler.serve_forever()
    finally:
        for front_end in front_ends:
            front_end.stop()
        scheduler.close()
        log.info(scheduler.prefix_cache.summary())
        requests.stopped(stop.lifecycle.reason or "stopped")
    if scheduler.failure is not None:
        raise TrinityError(f"the pipeline is down: {scheduler.failure}")


def run(args, stop: RankStop) -> None:
    global _watchdog
    validate(args)
    options = serve_options(args) if args.serve or args.http or args.metrics else None
    control = check_launch()  # None: one process, or a backend that needs init first (MPI)
    front_ends = []
    requests = RequestLog(Metrics(restarts=launcher_restarts())) if options is not None else None
    try:
        if options is not None and control is not None and control.rank == 0:
            front_ends = start_front_ends(options, requests)  # NOT_SERVING while the ranks connect and load
        group, _watchdog = join_ranks(args, control, on_stop=lambda why: stop.lifecycle.request_stop(why, from_peer=True))
        stop.watchdog = _watchdog
        if options is not None and group.rank() == 0 and not front_ends:
            front_ends = start_front_ends(options, requests)
    except BaseException:
        for front_end in front_ends:
            front_end.stop()
        raise
    if options is not None:
        if group.rank() != 0:
            build_pipeline(args, group, _watchdog, on_ready=stop.running)  # serves until rank 0 stops the ring
            return
        serve(args, options, front_ends, requests, group, _watchdog, stop)
        return
    built = build_pipeline(args, group, _watchdog, on_ready=stop.running)
    if built is None:
        return
    pipeline, path, config = built.pipeline, built.path, built.config
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    speculation = speculation_flags.loaded(args, tokenizer)
    ranks = pipeline.rank_info()
    memory = beside_draft(args, config, built.memory_bytes, len(ranks))
    sizes = serving_sizes(args, config, ranks, memory, batch=1)
    for line in sizes.lines[1:]:  # the context, with --max-context auto
        log.info(line)
    cache_bytes = sizes.prefix_cache_bytes if args.chat else 0
    scheduler = Scheduler(pipeline, tokenizer, prefill_step_size=sizes.prefill_step_size,
                          prefix_cache_bytes=cache_bytes, speculation=speculation,
                          memory=memory_admission(args, config, ranks, memory, sizes),
                          chunk_budget=sizes.chunk_budget)
    if _watchdog is not None:
        _watchdog.on_failure = scheduler.abort
    try:
        if args.chat:
            from .serving.chat import chat

            return chat(scheduler, lambda ids: validated_request(args, ids, config, sizes.max_context), stop.running)
        request = build_request(args, scheduler.tokenizer, config, sizes.max_context)
        result = generate_once(scheduler, request, stream=not args.json, stop=stop)
        result["ranks"] = pipeline.rank_info()
        if scheduler.batcher.verifier.options.enabled:
            result["speculative"] = scheduler.batcher.verifier.stats.as_dict()
    finally:
        scheduler.close()
    if args.json:
        print(json.dumps(result))
    else:
        print_summary(result)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    logs.configure(args.log_level)
    lifecycle = Lifecycle().start(watch_parent=launched_by_launcher())
    stop = RankStop(lifecycle)
    lifecycle.on_stop(stop)
    try:
        run(args, stop)
    except BrokenPipeError:  # whoever read our output is gone (a stop): nothing more to say
        if _watchdog is not None:
            _watchdog.close()
        sys.exit(0 if lifecycle.stopping.is_set() else 1)
    except TrinityError as e:
        if _watchdog is not None:
            _watchdog.leave(str(e))
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except BaseException as e:
        if _watchdog is not None:
            _watchdog.leave(f"{type(e).__name__}: {e}")
        raise
    if _watchdog is not None:
        _watchdog.close()  # a clean exit: the other ranks stop watching this one
