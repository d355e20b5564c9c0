"""run_trinity.py (run-trinity), the script every rank runs: one generation, a chat or serving, across 1..N ranks.

    run-trinity --prompt "Hi"                      # 1 rank (in a checkout: python run_trinity.py)
    run-trinity --stages 2 --chat                  # 2 stages, one process, chat on stdin
    mlx.launch -n 2 run-trinity --prompt "Hi"      # 2 processes (ring)

Rank 0 prints; other ranks print nothing on stdout.
"""

import logging
import json
import sys
import threading
from typing import List, Optional, Tuple

from . import TrinityError, logs
from .command_line import DEFAULT_PROMPT, parse_settings
from .runtime.request import GenerationRequest, RequestError, TokenEvent
from .runtime.scheduler import Scheduler
from .runtime.step_budget import StepBudget
from .serving.options import ServeOptions, check_options, split_hosts
from .shard.config import model_args
from .startup.join import join_ranks, start_rank
from .startup.loaded import Loaded
from .startup.lifecycle import Lifecycle, RankStop, launched_by_launcher, launcher_restarts
from .startup.preflight import check_launch
from .startup.settings import GenerationSettings, Settings
from .startup.sizing import Sizes, beside_draft, memory_admission, serving_sizes

log = logging.getLogger(__name__)


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
    if sizing.max_step_tokens is not None and sizing.max_step_tokens < 1:
        raise TrinityError(f"--max-step-tokens must be at least 1, got {sizing.max_step_tokens}")
    if sizing.itl_target_ms is not None and not sizing.itl_target_ms > 0:
        raise TrinityError(f"--itl-target-ms must be positive, got {sizing.itl_target_ms}")
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
    return TrinityError(e.as_named(flag))


def one_shot_request(generation: GenerationSettings, tokenizer, config, max_context: int) -> GenerationRequest:
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
        from .serving.chat_format import prompt_ids  # rank 0's serving modules: see FrontEnds.start

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
        self.requests = None  # the access log and metrics, once started
        self.started: list = []
        self._scheduler: Optional[Scheduler] = None

    def start(self) -> None:
        """Listening, NOT_SERVING until attached. Rank 0 alone starts them, so the serving modules
        (gRPC, uvicorn, the APIs' models: about 0.25 CPU-s) are imported here, not by every rank."""
        if self.options is None or self.started:
            return
        from .serving.front_ends import start_front_ends
        from .serving.metrics import Metrics
        from .serving.request_log import RequestLog

        self.requests = RequestLog(Metrics(restarts=launcher_restarts()))
        self.started = start_front_ends(self.options, self.requests)

    def running(self, scheduler: Scheduler) -> None:
        """The scheduler runs now: a failed rank aborts it."""
        self._scheduler = scheduler

    def attach(self, scheduler: Scheduler, tokenizer, info) -> None:
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
    return start_rank(settings, group, watchdog, on_ready=stop.running)


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
                          chunk_budget=sizes.chunk_budget,
                          step_budget=StepBudget(sizing.max_step_tokens, sizing.itl_target_ms, sizes.prefill_step_size))
    front_ends.running(scheduler)  # ends every stream with the failed rank's name, then NOT_SERVING
    return scheduler, sizes, ranks


def serve(settings: Settings, built: Loaded, front_ends: FrontEnds, stop: RankStop) -> None:
    """Rank 0 with --serve: attach the scheduler to the front ends, serve until a signal."""
    from .serving.chat_format import ModelInfo

    scheduler, sizes, ranks = start_scheduler(settings, built, front_ends)
    log.info(f"prefix cache: up to {sizes.prefix_cache_bytes / 2**20:.1f} MiB on any rank"
             if sizes.prefix_cache_bytes else "prefix cache: off")
    info = ModelInfo(model_id=settings.model.name, vocab_size=model_args(built.config).vocab_size,
                     max_context=sizes.max_context, max_tokens_cap=front_ends.options.max_tokens_cap, ranks=ranks,
                     max_batch=sizes.max_batch, kv_bits=settings.sizing.kv_bits)
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
        request = one_shot_request(generation, scheduler.tokenizer, built.config, sizes.max_context)
        result = generate_once(scheduler, request, stream=not generation.json, stop=stop)
        result["ranks"] = built.pipeline.rank_info()
        result["kv_bits"] = settings.sizing.kv_bits  # None: the caches in the model's dtype
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
        # One write, newline included: ranks sharing a terminal or pipe print theirs at the same moment,
        # and print()'s two writes (the text, then "\n") let another rank's line in between.
        sys.stderr.write(f"error: {e}\n")
        sys.stderr.flush()
        sys.exit(2)
    except BaseException as e:
        stop.leave(f"{type(e).__name__}: {e}")
        raise
    stop.leave(None)  # a clean exit: the other ranks stop watching this one
