"""Whether torchrun started this process, read from its environment (no torch import: the
launcher asks before it decides to start torchrun)."""

from __future__ import annotations

import os


def under_torchrun() -> bool:
    """torchrun's rendezvous variables are set: this process is one of its ranks."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
