"""Downloading from the Hugging Face Hub, with each way it fails as one line.

`--model` is a local folder or a repo id, and a missing relative path such as
`models/mine` reads as a repo id: the message says both, and why the download
failed (no network, offline mode, no such repo, a gated one).
"""

import os
from pathlib import Path
from typing import List

from .. import TrinityError


def snapshot(model: str, patterns: List[str]) -> Path:
    """huggingface_hub.snapshot_download of the files matching `patterns` (progress bars on)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    try:
        return Path(snapshot_download(model, allow_patterns=patterns))
    except GatedRepoError:  # before RepositoryNotFoundError, its base class
        why = "the repo is gated: accept its terms on huggingface.co and set HF_TOKEN"
    except RepositoryNotFoundError:
        why = "no such repo on huggingface.co (or it is private: set HF_TOKEN)"
    except RevisionNotFoundError as e:
        why = f"no such revision ({_first_line(e)})"
    except LocalEntryNotFoundError as e:  # no answer from the Hub, and not in the local cache
        if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
            why = "HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache"
        else:
            cause = e.__cause__ or e.__context__
            why = "no network: " + (f"{type(cause).__name__}: {cause}" if cause else _first_line(e))
    except HfHubHTTPError as e:
        why = _first_line(e)
    raise TrinityError(f"--model {model}: no such folder, and not downloadable as a Hugging Face repo id ({why})")


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
