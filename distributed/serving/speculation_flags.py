"""The command line's speculative-decoding flags (runtime/speculation.py does the work)."""

import argparse

from .. import TrinityError
from ..runtime.speculation import DEFAULT_DRAFT_TOKENS, SpeculationOptions


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (output unchanged: greedy token for token, sampled in distribution)")
    g.add_argument("--prompt-lookup", action="store_true",
                   help="draft from the prompt and the text so far (n-gram lookup, no model): a sequence decoding "
                   "alone verifies up to --num-draft-tokens drafts in one pass through the ring")
    g.add_argument("--num-draft-tokens", type=int, default=DEFAULT_DRAFT_TOKENS, metavar="K",
                   help="drafts per verification pass")


def options(args: argparse.Namespace) -> SpeculationOptions:
    if args.num_draft_tokens < 1:
        raise TrinityError(f"--num-draft-tokens must be at least 1, got {args.num_draft_tokens}")
    return SpeculationOptions(prompt_lookup=args.prompt_lookup, num_draft_tokens=args.num_draft_tokens)
