"""The local cache where built-in tiny checkpoints are generated (nothing is ever downloaded)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

logger = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """``$TILECAST_CACHE`` if set, else ``~/.cache/tilecast``."""
    env = os.environ.get("TILECAST_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "tilecast"


def ensure_model_dir(name: str, write: Callable[[Path], object], cache_dir: Path | None = None) -> Path:
    """``<cache>/models/<name>``, written by ``write(path)`` on first use.

    Safe against concurrent callers (several ranks): each writes a private temporary directory
    and renames it into place; the loser of the race discards its copy.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / "models" / name
    if (target / "model_index.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        write(staging / "ckpt")
        try:
            os.rename(staging / "ckpt", target)
            logger.info("wrote the tiny checkpoint %s", target)
        except OSError:
            if not (target / "model_index.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
