"""Drafts that are right by construction, inside a ring's rank 0, for `python -m bench speculation
--ring-ceiling` (a benchmark device, never on by default).

Python imports `sitecustomize` at start-up from PYTHONPATH: with this folder on it and
TRINITY_REPLAY set to a JSON file {"tokens": [...], "miss": M}, a `run_trinity.py --prompt-lookup`
process drafts the given tokens (a plain run's greedy output) in place of prompt lookup, the
draft for every M-th position wrong (0: none): what drafting costs and gains through a
real ring when the drafts' acceptance is known, whatever the model.
"""

import json
import os
import sys
from pathlib import Path

if os.environ.get("TRINITY_REPLAY"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: its bench package
    from bench.speculation import Replay  # noqa: E402

    from distributed.runtime import speculation  # noqa: E402

    _replay = json.loads(Path(os.environ["TRINITY_REPLAY"]).read_text())
    speculation.make_drafter = lambda options, sequences=1: Replay(_replay["tokens"], _replay["miss"])
