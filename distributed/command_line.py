"""run-trinity's command line: its parser (every flag and its help), read once into frozen
settings (startup/settings.py). The launcher reads the ranks' command lines with the same parser."""

import argparse
from argparse import ArgumentTypeError
from dataclasses import dataclass, fields
from typing import FrozenSet, List, Optional, Sequence, Tuple, Union

from . import TrinityError, logs
from .runtime.frames import DEFAULT_DRAFT_TOKENS, PREFILL_STEP_SIZE
from .serving.options import ALLOWED_HOSTS_ENV, AUTH_TOKEN_ENV
from .shard.memory import AUTO, DEFAULT_CONTEXT, MAX_BATCH, parse_memory_limit
from .startup.settings import (GenerationSettings, ModelSettings, RingSettings, ServingSettings, Settings,
                               SizingSettings, SpeculationSettings)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help of run-trinity and the launcher: description and epilog as written (examples keep
    their lines); each flag's default appended, unless it has none (None, off) or its help gives it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or default is None or default is False or default == argparse.SUPPRESS
                or "default" in text):
            return text
        return f"{text} (default: %(default)s)"


def context_arg(text: str) -> Union[int, str]:
    """--max-context's value: a token count, or auto."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        value = int(text)
    except ValueError:
        raise ArgumentTypeError(f"expected a token count or auto, got {text!r}") from None
    if value < 1:
        raise ArgumentTypeError(f"must be at least 1, got {value}")
    return value


DESCRIPTION = ("run_trinity.py (run-trinity), the script every rank runs: one generation, a chat or serving, "
               "across 1..N ranks.")
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


def build_parser(parser_class=argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = parser_class(description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter)
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
    p.add_argument("--max-batch", type=int, default=None,
                   help="sequences decoding together (split into one micro-batch per rank); default: as many "
                   f"as fit beside the weights on the tightest rank, each with a --max-context-token KV cache "
                   f"(for this estimate --max-context defaults to {DEFAULT_CONTEXT}), at most {MAX_BATCH}")
    p.add_argument("--max-context", type=context_arg, default=None, metavar="N|auto",
                   help="prompt + max tokens limit (default: max_position_embeddings); auto: the longest at which "
                   "--max-batch sequences' KV caches fit beside the weights on the tightest rank")
    p.add_argument("--memory-limit", type=parse_memory_limit, default=None, metavar="BYTES|auto",
                   help="memory each rank plans with and MLX holds it to (set_memory_limit, and the buffer cache "
                   "bounded to the planning margin); auto: its share of its host's memory (ranks of one host divide "
                   "it); default: that share, MLX unbounded")
    kv_arguments(p)
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
    serve.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                       help="with --serve or --chat: each rank also keeps its layers' share of cached prefixes in "
                       "files here, read back after a restart ('none': RAM only; default: "
                       "~/.cache/trinity-pipeline/prefix-cache, or under $XDG_CACHE_HOME)")
    serve.add_argument("--prefix-cache-disk-bytes", type=int, default=None, metavar="N",
                       help="the most the prefix cache's folder holds, least recently used first "
                       "(default: a quarter of the disk's free space at start, at most 64 GiB)")
    prefill_arguments(p)
    speculation_arguments(p)
    return p


def kv_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV cache (shard/kv_quant.py)")
    g.add_argument("--kv-bits", type=int, choices=[4, 8], default=None,
                   help="keep the full-attention layers' KV caches quantized to this many bits on every rank "
                   "(longer contexts in the same memory; sliding windows stay whole); default: the model's dtype")
    g.add_argument("--kv-group-size", type=int, choices=[32, 64, 128], default=64,
                   help="values per quantization group of --kv-bits (must divide the head size)")
    g.add_argument("--quantized-kv-start", type=int, default=0, metavar="N",
                   help="with --kv-bits: a sequence's caches stay whole until it holds N tokens, then are "
                   "quantized (mlx-lm's quantized_kv_start)")


def prefill_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefill: prompts in chunks, beside running streams (runtime/step_budget.py)")
    g.add_argument("--prefill-step-size", type=int, default=PREFILL_STEP_SIZE,
                   help="prompt tokens per prefill frame (a batch of B prompts: N/B each); "
                   "several ranks work on successive chunks at once")
    g.add_argument("--prefill-batch-tokens", type=int, default=2048,
                   help="waiting prompts prefill together up to this many tokens (each padded to the longest)")
    g.add_argument("--max-step-tokens", type=int, default=None, metavar="N",
                   help="prompt tokens a step may carry beside the rows decoding (a long prompt then delays "
                   "running streams by about N tokens' time a step; alone it goes at full speed); default: "
                   "no bound, or as --itl-target-ms sets it")
    g.add_argument("--itl-target-ms", type=float, default=None, metavar="T",
                   help="let the prompt tokens a step carries beside decoding follow what steps cost, so that "
                   "a running stream's time between tokens stays near T ms (--max-step-tokens fixes it instead)")


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
