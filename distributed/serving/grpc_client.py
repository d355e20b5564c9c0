"""Command-line client for a trinity.v1.Generation server (run_trinity.py --serve).

    python -m distributed.client --target 127.0.0.1:50051 --prompt "Hello" --chat-template
    python -m distributed.client --target HOST:PORT --token-ids 1,2,3 --max-tokens 16 --json
    python -m distributed.client --target HOST:PORT --message system:"Be brief." --message user:Hi
    python -m distributed.client --target HOST:PORT --info
    python -m distributed.client --target HOST:PORT --prompt "The sky is blue" --prompt-logprobs --max-tokens 0 --json

Streams text to stdout as it is generated (a summary line goes to stderr);
--json prints one object instead. On an error prints the gRPC status and
message to stderr and exits 1.
"""

import argparse
import json
import math
import os
import sys
import time
from typing import List, Optional

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.json_format import MessageToDict

from .options import AUTH_TOKEN_ENV
from .proto import generation_pb2 as pb
from .proto import generation_pb2_grpc as pb_grpc
from .wire import set_field


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m distributed.client", description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, help="HOST:PORT of the server")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--prompt", help="text (raw unless --chat-template)")
    what.add_argument("--token-ids", help="comma-separated token ids, fed as they are")
    what.add_argument("--message", action="append", metavar="ROLE:CONTENT",
                      help="a chat message (repeat for a conversation); the chat template is applied")
    what.add_argument("--info", action="store_true", help="print the model and its rank map instead")
    p.add_argument("--chat-template", action="store_true", help="format --prompt as one user chat message")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--temperature", "--temp", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--min-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--presence-penalty", type=float)
    p.add_argument("--frequency-penalty", type=float)
    p.add_argument("--repetition-penalty", type=float)
    p.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS to token ID's logit (repeatable)")
    p.add_argument("--top-logprobs", type=int, default=0, metavar="N", help="report the N most likely tokens at each step")
    p.add_argument("--prompt-logprobs", action="store_true",
                   help="report the prompt's logprobs (with --max-tokens 0: score the prompt only)")
    p.add_argument("--separate-reasoning", action="store_true",
                   help="a thinking checkpoint's reasoning apart (stderr; --json: reasoning_text), the answer as text")
    p.add_argument("--timeout", type=float, help="deadline in seconds")
    p.add_argument("--auth-token", default=os.environ.get(AUTH_TOKEN_ENV), help=f"bearer token (or {AUTH_TOKEN_ENV})")
    p.add_argument("--tls", action="store_true", help="use TLS with the system's root certificates")
    p.add_argument("--tls-ca", metavar="PEM", help="use TLS, trusting this CA certificate")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if not (args.info or args.prompt is not None or args.token_ids is not None or args.message):
        p.error("give --prompt, --token-ids, --message or --info")
    return args


def make_request(args) -> pb.GenerateRequest:
    request = pb.GenerateRequest(prompt=args.prompt or "", chat_template=args.chat_template, stop=args.stop)
    if args.token_ids is not None:
        try:
            request.token_ids.extend(int(t) for t in args.token_ids.split(",") if t.strip())
        except ValueError:
            sys.exit(f"error: --token-ids {args.token_ids!r} is not a comma-separated list of integers")
    for message in args.message or []:
        role, sep, content = message.partition(":")
        if not sep:
            sys.exit(f"error: --message {message!r} is not ROLE:CONTENT")
        request.messages.add(role=role, content=content)
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                 "frequency_penalty", "repetition_penalty"):
        set_field(request, name, getattr(args, name))  # wire.py: the request's fields as the server reads them
    for bias in args.logit_bias:
        token, sep, value = bias.partition("=")
        try:
            request.logit_bias[int(token)] = float(value)
        except ValueError:
            sys.exit(f"error: --logit-bias {bias!r} is not ID=BIAS")
    request.top_logprobs, request.prompt_logprobs = args.top_logprobs, args.prompt_logprobs
    request.separate_reasoning = args.separate_reasoning
    return request


def _pairs(top: pb.TopLogprobs) -> list:
    return [[t, v] for t, v in zip(top.token_ids, top.logprobs)]


def channel(args) -> grpc.Channel:
    if args.tls or args.tls_ca:
        root = open(args.tls_ca, "rb").read() if args.tls_ca else None
        return grpc.secure_channel(args.target, grpc.ssl_channel_credentials(root_certificates=root))
    return grpc.insecure_channel(args.target)


def generate(stub, request: pb.GenerateRequest, metadata, timeout: Optional[float], stream: bool) -> dict:
    """Run one Generate; print text as it comes if `stream`. Returns the collected result."""
    result = {"text": "", "token_ids": [], "logprobs": []}
    tic = time.perf_counter()
    call = stub.Generate(request, metadata=metadata, timeout=timeout)
    try:
        for response in call:
            if response.token_ids and "time_to_first_token_s" not in result:
                result["time_to_first_token_s"] = time.perf_counter() - tic
            result["text"] += response.text
            if request.separate_reasoning:
                result["reasoning_text"] = result.get("reasoning_text", "") + response.reasoning_text
                if stream and response.reasoning_text:
                    print(response.reasoning_text, end="", file=sys.stderr, flush=True)
            result["token_ids"] += list(response.token_ids)
            result["logprobs"] += list(response.logprobs)
            if response.top_logprobs:
                result.setdefault("top_logprobs", []).extend(_pairs(t) for t in response.top_logprobs)
            if response.prompt_token_ids:  # NaN (the first token's) becomes null in --json
                result["prompt_token_ids"] = list(response.prompt_token_ids)
                result["prompt_logprobs"] = [None if math.isnan(v) else v for v in response.prompt_logprobs]
                result["prompt_top_logprobs"] = [_pairs(t) for t in response.prompt_top_logprobs]
            if stream:
                print(response.text, end="", flush=True)
            if response.finish_reason:
                usage = response.usage
                result["finish_reason"] = response.finish_reason
                result["usage"] = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                                   **({"reasoning_tokens": usage.reasoning_tokens} if request.separate_reasoning else {})}
                result["prefill_tokens_per_sec"] = usage.prefill_tokens_per_sec
                result["generation_tokens_per_sec"] = usage.generation_tokens_per_sec
    except KeyboardInterrupt:
        call.cancel()
        raise
    return result


INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
         FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}


def message_json(message) -> dict:
    """A message as JSON with proto field names and every field present; 64-bit
    integers as numbers (protobuf's JSON mapping makes them strings)."""
    fields = MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    return _int64_as_numbers(message.DESCRIPTOR, fields)


def _int64_as_numbers(descriptor: Descriptor, fields: dict) -> dict:
    for field in descriptor.fields:
        if field.name not in fields:
            continue
        values = fields[field.name] if field.is_repeated else [fields[field.name]]
        if field.message_type is not None and not field.message_type.GetOptions().map_entry:
            values = [_int64_as_numbers(field.message_type, v) for v in values]
        elif field.type in INT64:
            values = [int(v) for v in values]
        else:
            continue
        fields[field.name] = values if field.is_repeated else values[0]
    return fields


def print_info(info: pb.ModelInfo) -> None:
    print(f"model {info.model_id}: vocab {info.vocab_size}, context {info.max_context}, "
          f"max_tokens cap {info.max_tokens_cap}")
    for r in info.ranks:
        extra = " + embedding and head" if r.embed else ""
        print(f"rank {r.rank} ({r.host}): layers [{r.layer_start}, {r.layer_end}){extra}, "
              f"peak memory {r.peak_memory_bytes / 2**20:.1f} MiB")


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    metadata = [("authorization", f"Bearer {args.auth_token}")] if args.auth_token else None
    try:
        with channel(args) as ch:
            stub = pb_grpc.GenerationStub(ch)
            if args.info:
                info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=args.timeout)
                if args.json:
                    print(json.dumps(message_json(info)))
                else:
                    print_info(info)
                return
            result = generate(stub, make_request(args), metadata, args.timeout, stream=not args.json)
    except grpc.RpcError as e:
        if not args.json and not args.info:
            print(flush=True)
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("\ncancelled", file=sys.stderr)
        sys.exit(130)
    if args.json:
        print(json.dumps(result))
    else:
        print(flush=True)
        usage = result.get("usage", {})
        print(f"[{result.get('finish_reason')}: {usage.get('prompt_tokens')} prompt + "
              f"{usage.get('completion_tokens')} completion tokens, "
              f"prefill {result.get('prefill_tokens_per_sec', 0):.1f} tok/s, "
              f"generation {result.get('generation_tokens_per_sec', 0):.1f} tok/s]", file=sys.stderr)


if __name__ == "__main__":
    main()
