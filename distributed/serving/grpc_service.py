"""Rank 0's gRPC front end: trinity.v1.Generation, grpc.health.v1.Health and
server reflection (docs/serving.md; schema: proto/generation.proto).

Lifecycle (driven by cli.serve): start_grpc_server() listens at once, before the
weights load, with health NOT_SERVING and Generate answering UNAVAILABLE "model
is loading"; attach() makes it SERVING; set_not_serving(reason) after the ring
breaks (Generate then answers UNAVAILABLE with the reason); stop() at shutdown.

Status codes: bad input INVALID_ARGUMENT ("field: what is wrong", from
frontend/request validation); --max-queue exceeded, or a request a rank had no memory
for (runtime/memory_guard.py: it alone fails), RESOURCE_EXHAUSTED; loading,
ring broken or shutting down UNAVAILABLE; a client deadline cancels the request
within one decode step, as does the client cancelling the stream.

Auth: with a token, every call needs the metadata `authorization: Bearer TOKEN`
(else UNAUTHENTICATED): Generation and server reflection alike. Health stays
open, so probes (load balancers, orchestrators, grpc_health_probe) need no
secret; it tells only SERVING or NOT_SERVING.

Each Generate call is logged and counted as it ends (request_log.py), calls the
token check refuses excepted (they never reach it).

Reasoning (think tokens): `separate_reasoning` splits each response's text into the answer
(`text`) and the reasoning (`reasoning_text`) with chat_format.py; messages' reasoning_content
goes to the chat template. Unset, `text` stays all that was generated (the launcher's router
forwards it so and splits it in its own front ends).
"""

import hmac
import math
import sys
import threading
import time
from concurrent import futures
from typing import Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from .. import TrinityError
from ..runtime.request import FinishEvent, GenerationRequest, PromptEvent, RequestError, failure_kind
from ..runtime.scheduler import QueueFull, RingUnavailable
from ..shard.memory import MAX_BATCH
from .chat_format import ModelInfo, ReplySplitter, build_request, prompt_ids, reply_prompt
from .options import ServeOptions, split_address
from .proto import generation_pb2 as pb
from .proto import generation_pb2_grpc as pb_grpc
from .request_log import RequestLog, Trace
from .openai_api import clamp_max_tokens
from .tools import NO_THINKING
from .wire import from_wire

SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "trinity.v1.Generation"
DEFAULT_MAX_TOKENS = 100
OPEN_METHODS = ("/grpc.health.v1.Health/",)  # served without a token
STOP_GRACE_S = 2.0  # in-flight streams get this long to finish at shutdown, then are cancelled

# A request's error by whose failure it is (runtime/request.py failure_kind). The router (launch/router)
# waits out UNAVAILABLE as the ring restarts and retries RESOURCE_EXHAUSTED.
FAILURE_CODES = {"request": grpc.StatusCode.INVALID_ARGUMENT, "memory": grpc.StatusCode.RESOURCE_EXHAUSTED,
                 "reset": grpc.StatusCode.ABORTED, "ring": grpc.StatusCode.UNAVAILABLE}


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, requests: Optional[RequestLog] = None):
        self.requests = requests or RequestLog()  # the access log and request metrics
        self.state = None  # (scheduler, tokenizer, ModelInfo) once attached
        self.unavailable: Optional[str] = "model is loading"
        self._tokenize = threading.Lock()  # one tokenizer, many request threads

    def _ready(self, context):
        reason, state = self.unavailable, self.state
        if reason is not None or state is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, reason or "model is loading")
        return state

    def Generate(self, request, context):
        trace = self.requests.begin("grpc", "Generate", context.peer())
        status = "CANCELLED"  # the client went away (the stream was closed early)
        try:
            yield from self._generate(request, context, trace)
            status = "OK"
        except GeneratorExit:
            raise
        except BaseException:
            status = context.code().name if context.code() is not None else "UNKNOWN"
            raise
        finally:
            details = context.details() if status != "OK" else None
            trace.end(status, details.decode(errors="replace") if details else None)

    def _submit(self, request, context, trace: Trace, scheduler, tokenizer, info):
        """(GenerationRequest, RequestHandle) of a Generate call, or the call aborted with why."""
        try:
            req = self._request(request, tokenizer, info, context.time_remaining())
        except RequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if request.HasField("max_tokens") and req.max_tokens != request.max_tokens:
            trace.clamp("max_tokens")  # held to the cap and the context's room, as over HTTP
        try:
            return req, scheduler.submit(req)
        except RequestError as e:  # a grammar the library rejects: named as the client set it
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, e.as_named(request.WhichOneof('constraint')))
        except QueueFull as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"server busy, retry later: {e}")
        except RingUnavailable as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the pipeline is down: {e}")

    def _generate(self, request, context, trace: Trace):
        scheduler, tokenizer, info = self._ready(context)
        with scheduler.arriving():  # a burst's requests prefill together (runtime/scheduler.py)
            req, handle = self._submit(request, context, trace, scheduler, tokenizer, info)
        if not context.add_callback(handle.cancel):  # client cancelled, deadline passed or server stopping
            handle.cancel()  # the RPC had already ended
        split = ReplySplitter(tokenizer, None, reply_prompt(req)) if request.separate_reasoning else None
        reasoning_tokens = 0
        try:
            for event in trace.events(handle):
                if isinstance(event, FinishEvent):
                    break
                if isinstance(event, PromptEvent):
                    yield pb.GenerateResponse(
                        prompt_token_ids=event.token_ids, prompt_top_logprobs=[_top(t) for t in event.top_logprobs],
                        prompt_logprobs=[math.nan if lp is None else lp for lp in event.logprobs])
                    continue
                top = [] if event.top_logprobs is None else [_top(event.top_logprobs)]
                reasoning, text = "", event.text
                if split is not None:
                    reasoning_tokens += split.state == "reasoning"
                    reasoning, text, _ = split.feed(event.text)
                yield pb.GenerateResponse(text=text, reasoning_text=reasoning, token_ids=[event.token_id],
                                          logprobs=[event.logprob], top_logprobs=top)
        finally:
            handle.cancel()  # the stream was closed early; a no-op once finished
        if event.finish_reason == "error":
            code = FAILURE_CODES[failure_kind(event.error)]
            context.abort(code, event.error if code != grpc.StatusCode.UNAVAILABLE
                          else f"generation failed, the pipeline is down: {event.error}")
        if event.finish_reason == "cancelled" and req.expired():
            # Our own deadline check can win the race with gRPC's: answer as gRPC would.
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        reasoning, text = "", event.text
        trace.reasoned(reasoning_tokens)
        if split is not None:
            first, last = split.feed(event.text), split.finish()
            reasoning, text = first.reasoning + last.reasoning, first.content + last.content
        yield pb.GenerateResponse(
            text=text,
            reasoning_text=reasoning,
            finish_reason=event.finish_reason,
            usage=pb.Usage(
                prompt_tokens=event.prompt_tokens,
                completion_tokens=event.completion_tokens,
                prefill_tokens_per_sec=event.prefill_tokens_per_sec,
                generation_tokens_per_sec=event.generation_tokens_per_sec,
                cached_tokens=event.cached_tokens,
                reasoning_tokens=reasoning_tokens,
            ),
        )

    def _request(self, r: pb.GenerateRequest, tokenizer, info: ModelInfo,
                 time_remaining: Optional[float]) -> GenerationRequest:
        thinking = tokenizer.has_thinking
        if r.separate_reasoning and not thinking:
            raise RequestError("separate_reasoning", NO_THINKING)
        messages = [{"role": m.role, "content": m.content} for m in r.messages]
        for i, m in enumerate(r.messages):
            if m.reasoning_content:
                if not thinking or m.role != "assistant":
                    raise RequestError(f"messages[{i}].reasoning_content", NO_THINKING if not thinking else
                                       "only assistant messages carry reasoning")
                messages[i]["reasoning_content"] = m.reasoning_content
        with self._tokenize:
            ids = prompt_ids(tokenizer, prompt=r.prompt or None, token_ids=list(r.token_ids) or None,
                             messages=messages or None, chat_template=r.chat_template)

        # Unset max_tokens: up to 100, within the cap and what the context leaves.
        default_max = max(1, min(DEFAULT_MAX_TOKENS, info.max_tokens_cap, info.max_context - len(ids)))
        fields = from_wire(r, ids, max_tokens=default_max, temperature=0.0)  # the one conversion (wire.py)
        fields["max_tokens"] = clamp_max_tokens(fields["max_tokens"], len(ids), info)
        return build_request(info, fields.pop("prompt_ids"), **fields,
                             deadline=None if time_remaining is None else time.monotonic() + time_remaining)

    def GetModelInfo(self, request, context):
        scheduler, _, info = self._ready(context)
        try:  # asked afresh, so peak memory includes the KV caches of what has run since
            rows = scheduler.rank_info()
        except RingUnavailable as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the pipeline is down: {e}")
        planned = {r["rank"]: r for r in info.ranks}  # the memory each rank plans with, from the start
        live = scheduler.rank_reports()  # MLX's memory now: rank 0's, the others' as last heard
        ranks = [
            pb.RankInfo(rank=r["rank"], host=r["host"], layer_start=r["layers"][0], layer_end=r["layers"][1],
                        embed=r["embed"], head=r["head"], peak_memory_bytes=r["peak_memory_bytes"],
                        parameter_bytes=r.get("parameter_bytes", 0),
                        memory_bytes=planned.get(r["rank"], {}).get("memory_bytes", 0),
                        memory_limited=planned.get(r["rank"], {}).get("memory_limited", False),
                        active_memory_bytes=live.get(r["rank"], {}).get("active_memory_bytes", 0),
                        cache_memory_bytes=live.get(r["rank"], {}).get("cache_memory_bytes", 0),
                        tensor=_tensor_share(r.get("tensor")))
            for r in rows
        ]
        return pb.ModelInfo(model_id=info.model_id, vocab_size=info.vocab_size, max_context=info.max_context,
                            max_tokens_cap=info.max_tokens_cap, ranks=ranks, max_batch=info.max_batch,
                            kv_bits=info.kv_bits or 0)


def _tensor_share(share: Optional[dict]) -> Optional[pb.TensorShare]:
    """A rank row's "tensor" (runtime/tensor.py's tensor_share), or None without tensor parallelism."""
    if not share:
        return None
    width = share["expert_width"] or [0, 0]
    return pb.TensorShare(rank=share["rank"], size=share["size"], head_start=share["heads"][0],
                          head_end=share["heads"][1], kv_head_start=share["kv_heads"][0],
                          kv_head_end=share["kv_heads"][1], experts=share["experts"],
                          expert_width_start=width[0], expert_width_end=width[1])


def tensor_share_row(t: pb.TensorShare) -> dict:
    """A RankInfo's TensorShare as a rank row's "tensor" again (the launcher's router)."""
    return {"rank": t.rank, "size": t.size, "heads": [t.head_start, t.head_end],
            "kv_heads": [t.kv_head_start, t.kv_head_end], "experts": t.experts,
            "expert_width": [t.expert_width_start, t.expert_width_end] if t.experts else None}


def _top(top) -> pb.TopLogprobs:
    """(token id, logprob) pairs; None (the first prompt token) is empty."""
    return pb.TopLogprobs(token_ids=[t for t, _ in top or ()], logprobs=[v for _, v in top or ()])


class BearerAuth(grpc.ServerInterceptor):
    """UNAUTHENTICATED unless the call carries `authorization: Bearer TOKEN` (health excepted).
    A refused Generate call is logged and counted like any other refused request."""

    def __init__(self, token: str, requests: RequestLog):
        self._expected = f"Bearer {token}".encode()
        self._requests = requests

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or details.method.startswith(OPEN_METHODS):
            return handler
        sent = dict(details.invocation_metadata or ()).get("authorization", "")
        if isinstance(sent, str) and hmac.compare_digest(sent.encode(), self._expected):
            return handler

        route = details.method.rpartition("/")[2]

        def deny(request, context):
            why = "missing or wrong token: send the metadata 'authorization: Bearer <token>'"
            if route == "Generate":
                self._requests.begin("grpc", route, context.peer()).end("UNAUTHENTICATED", why)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

        make = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(handler.request_streaming, handler.response_streaming)]
        return make(deny)


class GrpcFrontEnd:
    def __init__(self, options: ServeOptions, requests: Optional[RequestLog] = None):
        self.servicer = GenerationServicer(requests)
        self.health = health.HealthServicer()
        # Each open stream holds a worker thread, queued ones included: room for a full
        # batch and a full queue, and health / info calls besides (a stream beyond the
        # pool would wait unseen in gRPC's own queue). Threads start only as calls come.
        workers = (options.max_batch or MAX_BATCH) + options.max_queue + 32
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc"),
            interceptors=[BearerAuth(options.auth_token, self.servicer.requests)] if options.auth_token else [],
            options=[("grpc.so_reuseport", 0)],  # fail on a port in use instead of sharing it
        )
        pb_grpc.add_GenerationServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.address = self._listen(options)  # HOST:PORT as bound (port 0 picks a free one)
        self.port = int(self.address.rpartition(":")[2])
        self.server.start()
        print(f"gRPC listening on {self.address} (NOT_SERVING until loaded)", file=sys.stderr, flush=True)

    def _listen(self, options: ServeOptions) -> str:
        host, port = split_address(options.grpc_address, "--serve")
        host = f"[{host}]" if ":" in host else host
        try:
            if options.tls_cert:
                with open(options.tls_key, "rb") as key, open(options.tls_cert, "rb") as cert:
                    credentials = grpc.ssl_server_credentials([(key.read(), cert.read())])
                bound = self.server.add_secure_port(f"{host}:{port}", credentials)
            else:
                bound = self.server.add_insecure_port(f"{host}:{port}")
        except RuntimeError as e:
            raise TrinityError(f"--serve {options.grpc_address}: cannot listen ({e})") from None
        if not bound:
            raise TrinityError(f"--serve {options.grpc_address}: cannot listen (address in use?)")
        return f"{host}:{bound}"

    def describe(self) -> str:
        return f"{self.address} (gRPC)"

    def _set_health(self, status) -> None:
        for service in ("", SERVICE):
            self.health.set(service, status)

    def attach(self, scheduler, tokenizer, info: ModelInfo) -> None:
        """The model is loaded on every rank: start serving."""
        self.servicer.state = (scheduler, tokenizer, info)
        self.servicer.unavailable = None
        self._set_health(health_pb2.HealthCheckResponse.SERVING)

    def set_not_serving(self, reason: str) -> None:
        """The ring broke: health NOT_SERVING, Generate UNAVAILABLE with `reason`."""
        self.servicer.unavailable = f"the pipeline is down: {reason}"
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    def set_recovering(self, reason: str) -> None:
        """The ring is down and restarting (the launcher's router): health NOT_SERVING, while
        Generate still takes requests, which wait for it; attach() again when it is back."""
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    def stop(self) -> None:
        self.servicer.unavailable = "the server is shutting down"
        self.health.enter_graceful_shutdown()
        self.server.stop(STOP_GRACE_S).wait()


def start_grpc_server(options: ServeOptions, requests: Optional[RequestLog] = None) -> GrpcFrontEnd:
    """Listen on options.grpc_address now; NOT_SERVING until attach()."""
    return GrpcFrontEnd(options, requests)
