"""run_trinity.py, the script every rank runs: one generation, or serving (--serve), across 1..N ranks.

    python run_trinity.py --prompt "Hi"                      # 1 rank
    python run_trinity.py --stages 2 --prompt "Hi"           # 2 stages, one process
    mlx.launch -n 2 python run_trinity.py --prompt "Hi"      # 2 processes (ring)

Rank 0 prints; other ranks print nothing on stdout.
"""

import argparse
import json
import sys
import threading
from typing import List, Optional

from . import TrinityError
from .runtime.prefill import PREFILL_STEP_SIZE
from .runtime.prefix_cache import default_budget
from .runtime.request import GenerationRequest, RequestError, TokenEvent
from .runtime.scheduler import Scheduler
from .serving.front_ends import start_front_ends
from .serving.options import AUTH_TOKEN_ENV, ServeOptions, check_options
from .serving.requests import prompt_ids
from .shard.config import model_args
from .shard.kv_budget import DEFAULT_CONTEXT, MAX_BATCH, kv_budget
from .startup.join import build_pipeline, join_ranks
from .startup.lifecycle import Lifecycle, RankStop, launched_by_launcher
from .startup.preflight import check_launch
from .startup.watchdog import Watchdog

DEFAULT_PROMPT = "Explain pipeline parallelism in one sentence."
EPILOG = """\
examples:
  python run_trinity.py --prompt "Hi"                          1 rank
  mlx.launch -n 2 python run_trinity.py --prompt "Hi"          2 local ranks (ring)
  mlx.launch --hostfile hosts.json python run_trinity.py --model REPO --serve 127.0.0.1:50051
  python -m launch run --hostfile hosts.json -- run_trinity.py --model REPO --serve 127.0.0.1:50051

where things are (README.md, "How it is built"): distributed/shard (what a rank holds),
distributed/transport (how frames move), distributed/runtime (the ring: pipeline, scheduler),
distributed/startup (joining, watchdog, stopping), distributed/serving (gRPC, HTTP, client),
launch/ (planning a split, starting and supervising rings)."""


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="run_trinity.py", description=__doc__.split("\n")[0], epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local checkpoint directory or Hugging Face repo id "
                   "(default: an embedded tiny AFMoE checkpoint, made locally)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="text; the chat template is applied unless --no-chat-template")
    prompt.add_argument("--prompt-ids", help="comma-separated token ids, fed as they are")
    p.add_argument("--no-chat-template", action="store_true")
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--temp", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 disables")
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--stages", type=int, default=1, help="run N stages inside this one process")
    p.add_argument("--split", help="layers per rank, e.g. 10,12,10; `auto` plans from each rank's memory")
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
    p.add_argument("--max-context", type=int, default=None,
                   help="prompt + max tokens limit (default: max_position_embeddings)")
    faults = p.add_argument_group("faults (several ranks)")
    faults.add_argument("--peer-timeout", type=float, default=5.0, metavar="SECONDS",
                        help="a rank silent this long on the control channel counts as failed: every rank exits")
    faults.add_argument("--connect-timeout", type=float, default=60.0, metavar="SECONDS",
                        help="at start-up, how long rank 0 waits for every rank to connect")
    serve = p.add_argument_group("serving (rank 0)")
    serve.add_argument("--serve", metavar="HOST:PORT", help="serve gRPC (trinity.v1.Generation) instead of one generation")
    serve.add_argument("--http", metavar="HOST:PORT", help="also serve the OpenAI-compatible HTTP API")
    serve.add_argument("--auth-token", help=f"require `authorization: Bearer TOKEN` (or set {AUTH_TOKEN_ENV})")
    serve.add_argument("--insecure", action="store_true", help="allow a non-loopback bind without a token")
    serve.add_argument("--tls-cert", help="PEM certificate chain for TLS")
    serve.add_argument("--tls-key", help="PEM private key for TLS")
    serve.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond this get RESOURCE_EXHAUSTED")
    serve.add_argument("--max-tokens-cap", type=int, default=4096, help="largest max_tokens a client may ask for")
    serve.add_argument("--prefix-cache-bytes", type=int, default=None, metavar="N",
                       help="KV caches kept across requests, so a prompt that extends an earlier one (a chat's "
                       "next turn) prefills only the rest: at most N bytes on any rank; 0 disables; default: a "
                       "quarter of what the tightest rank has beside its weights (its usable memory measured "
                       "before loading, less 10%%), set aside before the default --max-batch")
    return p.parse_args(argv)


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
    if args.prefix_cache_bytes is not None and args.prefix_cache_bytes < 0:
        raise TrinityError(f"--prefix-cache-bytes must be >= 0, got {args.prefix_cache_bytes}")
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


def build_request(args, tokenizer, config) -> GenerationRequest:
    request = _request(args, prompt_tokens(args, tokenizer))
    max_context = args.max_context or config.get("max_position_embeddings") or 2**31
    try:
        request.validate(model_args(config).vocab_size, max_context)
    except RequestError as e:
        raise _flag_error(e) from None
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
    if args.http and not args.serve:
        raise TrinityError("--http needs --serve")
    return check_options(ServeOptions(
        grpc_address=args.serve, http_address=args.http, auth_token=args.auth_token, insecure=args.insecure,
        tls_cert=args.tls_cert, tls_key=args.tls_key, max_queue=args.max_queue, max_tokens_cap=args.max_tokens_cap,
    ))


GRACE_S = 1.0  # after a peer failed: for gRPC / HTTP threads to send their errors before the exit
_watchdog: Optional[Watchdog] = None  # main() tells the other ranks how this one ends


def serve(args, options: ServeOptions, front_ends, group, watchdog: Optional[Watchdog], stop: RankStop) -> None:
    """Rank 0 with --serve: load, attach the scheduler to the front ends, serve until a signal."""
    from .serving.requests import ModelInfo

    def on_failure(reason: str) -> None:
        for front_end in front_ends:
            front_end.set_not_serving(reason)

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
    ranks = pipeline.rank_info()
    max_context = args.max_context or config.get("max_position_embeddings") or 2**31
    context = min(max_context, args.max_context or DEFAULT_CONTEXT)
    prefix_cache_bytes = args.prefix_cache_bytes
    if prefix_cache_bytes is None:  # a share of the tightest rank's memory beside its weights
        prefix_cache_bytes = default_budget(kv_budget(config, ranks, built.memory_bytes, context).free_bytes)
    # The prefix cache's bytes come out of every rank's share before the default batch size.
    budget = kv_budget(config, ranks, built.memory_bytes, context, set_aside_bytes=prefix_cache_bytes)
    max_batch = args.max_batch or budget.max_batch

    # The scheduler runs on this main thread (see Scheduler.start); front ends' threads only queue.
    scheduler = Scheduler(pipeline, tokenizer, max_queue=options.max_queue,
                          prefill_step_size=args.prefill_step_size, max_batch=max_batch,
                          on_failure=on_failure, prefill_batch_tokens=args.prefill_batch_tokens,
                          prefix_cache_bytes=prefix_cache_bytes)
    print(f"prefix cache: up to {prefix_cache_bytes / 2**20:.1f} MiB on any rank" if prefix_cache_bytes
          else "prefix cache: off", file=sys.stderr, flush=True)
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
    for front_end in front_ends:
        front_end.attach(scheduler, tokenizer, info)
    print(f"serving {info.model_id} on " + " and ".join(f.describe() for f in front_ends), flush=True)
    print(f"max batch: {max_batch}" + (" (--max-batch)" if args.max_batch else f": {budget.describe()}"), flush=True)
    stop.running(scheduler.stop)
    try:
        scheduler.serve_forever()
    finally:
        for front_end in front_ends:
            front_end.stop()
        scheduler.close()
        print(scheduler.prefix_cache.summary(), file=sys.stderr, flush=True)
    if scheduler.failure is not None:
        raise TrinityError(f"the pipeline is down: {scheduler.failure}")


def run(args, stop: RankStop) -> None:
    global _watchdog
    validate(args)
    options = serve_options(args) if args.serve or args.http else None
    control = check_launch()  # None: one process, or a backend that needs init first (MPI)
    front_ends = []
    try:
        if options is not None and control is not None and control.rank == 0:
            front_ends = start_front_ends(options)  # NOT_SERVING while the ranks connect and load
        group, _watchdog = join_ranks(args, control, on_stop=lambda why: stop.lifecycle.request_stop(why, from_peer=True))
        stop.watchdog = _watchdog
        if options is not None and group.rank() == 0 and not front_ends:
            front_ends = start_front_ends(options)
    except BaseException:
        for front_end in front_ends:
            front_end.stop()
        raise
    if options is not None:
        if group.rank() != 0:
            build_pipeline(args, group, _watchdog, on_ready=stop.running)  # serves until rank 0 stops the ring
            return
        serve(args, options, front_ends, group, _watchdog, stop)
        return
    built = build_pipeline(args, group, _watchdog, on_ready=stop.running)
    if built is None:
        return
    pipeline, path, config = built.pipeline, built.path, built.config
    from mlx_lm.utils import load_tokenizer

    scheduler = Scheduler(pipeline, load_tokenizer(path, eos_token_ids=config.get("eos_token_id")),
                          prefill_step_size=args.prefill_step_size)
    if _watchdog is not None:
        _watchdog.on_failure = scheduler.abort
    try:
        request = build_request(args, scheduler.tokenizer, config)
        result = generate_once(scheduler, request, stream=not args.json, stop=stop)
        result["ranks"] = pipeline.rank_info()
    finally:
        scheduler.close()
    if args.json:
        print(json.dumps(result))
    else:
        print_summary(result)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
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
