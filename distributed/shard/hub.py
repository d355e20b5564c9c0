"""Downloading from the Hugging Face Hub, with each way it fails as one line.

`--model` is a local folder or a repo id, and a missing relative path such as
`models/mine` reads as a repo id: the message says both, and why the download
failed (hub unreachable, offline mode, no such repo, a gated one), naming the
hub asked (huggingface.co, or the mirror that HF_ENDPOINT points at).
"""

import os
from pathlib import Path
from typing import List, Optional

from .. import TrinityError


def where() -> str:
    """The hub that downloads go to, as a message names it."""
    from huggingface_hub import constants

    if constants.ENDPOINT == "https://huggingface.co":
        return "huggingface.co"
    return f"{constants.ENDPOINT} (HF_ENDPOINT)"


def snapshot(model: str, patterns: List[str], revision: Optional[str] = None) -> Path:
    """huggingface_hub.snapshot_download of the files matching `patterns` (progress bars on).
    Files already in the cache for that commit are not downloaded again."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    try:
        return Path(snapshot_download(model, allow_patterns=patterns, revision=revision))
    except GatedRepoError:  # before RepositoryNotFoundError, its base class
        why = f"the repo is gated: accept its terms on {where()} and set HF_TOKEN"
    except RepositoryNotFoundError:
        why = f"no such repo on {where()} (or it is private: set HF_TOKEN)"
    except RevisionNotFoundError as e:
        why = f"no such revision ({_first_line(e)})"
    except LocalEntryNotFoundError as e:  # no answer from the Hub, and not in the local cache
        if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
            why = "HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache"
        else:
            cause = e.__cause__ or e.__context__
            why = f"cannot reach {where()}: " + (f"{type(cause).__name__}: {cause}" if cause else _first_line(e))
    except HfHubHTTPError as e:
        why = _first_line(e)
    raise TrinityError(f"--model {model}: no such folder, and not downloadable as a Hugging Face repo id ({why})")


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
