"""Hugging Face Hub model ids as ``--model-path``, resolved the way diffusers resolves them.

``local_dir("Qwen/Qwen-Image")`` is the snapshot directory of that repository in huggingface_hub's
cache: downloaded when online (``snapshot_download``), read from the cache alone when
``HF_HUB_OFFLINE=1`` (the cache's location: ``HF_HUB_CACHE`` / ``HF_HOME``, as huggingface_hub
reads them). An existing directory is returned as it is; built-in names never reach here.
"""

from __future__ import annotations

import re
from pathlib import Path

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
"""``owner/name``, as the Hub spells repository ids."""


BUILTIN_PREFIXES = ("tiny/", "random/", "test/")
"""tilecast's own names (``tiny/flux``, ...): never looked up on the Hub."""


def is_hub_id(model_path: str) -> bool:
    """Not an existing path nor a tilecast name, and shaped like a Hub repository id."""
    name = str(model_path)
    return not name.startswith(BUILTIN_PREFIXES) and not Path(name).exists() and bool(HUB_ID.match(name))


def local_dir(model_path: str, flag: str = "--model-path") -> Path:
    """The local directory ``model_path`` names (see the module doc); ``ValueError`` naming the
    problem (and ``flag``, the setting that gave it) when a Hub id is neither cached (offline) nor
    downloadable."""
    if not is_hub_id(model_path):
        return Path(model_path)
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    offline = bool(constants.HF_HUB_OFFLINE)
    try:
        return Path(snapshot_download(str(model_path), local_files_only=offline))
    except LocalEntryNotFoundError:
        where = "HF_HUB_OFFLINE is set" if offline else "it could not be downloaded"
        raise ValueError(
            f"{flag} {model_path!r}: no snapshot in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {where}"
        ) from None
    except HfHubHTTPError as exc:
        raise ValueError(f"{flag} {model_path!r}: the Hub refused it ({exc})") from None


def no_model_index(path: Path) -> str:
    """Why ``path``, a folder without ``model_index.json``, is no diffusers pipeline; where it holds
    ``.safetensors`` files, also where such single-file transformer weights go instead."""
    single_file = (
        "; single-file transformer weights (as FLUX.2-dev-NVFP4's) go to --transformer-weights-path, with "
        "their base pipeline as --model-path"
        if path.is_dir() and any(path.glob("*.safetensors"))
        else ""
    )
    return f"{path} has no model_index.json: not a diffusers-format model directory{single_file}"
