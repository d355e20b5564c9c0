"""The command line's speculative-decoding flags (runtime/speculation.py does the work)."""

import argparse

from .. import TrinityError
from ..runtime.speculation import DEFAULT_DRAFT_TOKENS, SpeculationOptions


def add_arguments(p: argparse.ArgumentParser) -> None:
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


def options(args: argparse.Namespace) -> SpeculationOptions:
    if args.num_draft_tokens < 1:
        raise TrinityError(f"--num-draft-tokens must be at least 1, got {args.num_draft_tokens}")
    return SpeculationOptions(prompt_lookup=args.prompt_lookup, num_draft_tokens=args.num_draft_tokens,
                              measured=args.speculate == "measured", ahead=args.draft_ahead)


def loaded(args: argparse.Namespace, tokenizer) -> SpeculationOptions:
    """options(args) with the draft model loaded (rank 0, beside its stage)."""
    from ..shard.draft import load_draft

    spec = options(args)
    if args.draft_model:
        spec.draft = load_draft(args.draft_model, tokenizer)
    return spec
