"""Shared fixtures."""

from __future__ import annotations

import importlib.util
import os
import signal

import pytest
import torch

if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    # No GPU: Triton's interpreter runs the kernels on the CPU (tests/test_triton_kernels.py). Set
    # before any kernel is defined: ``triton.jit`` reads it when it wraps a function.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    """One checkpoint cache (``$TILECAST_CACHE``) for the tests that ask for it; under pytest-xdist
    one for every worker (each checkpoint is built once, under the cache's file lock)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's folder, not the worker's
    cache = base / "tilecast-cache"
    previous = os.environ.get("TILECAST_CACHE")
    os.environ["TILECAST_CACHE"] = str(cache)
    yield cache
    if previous is None:
        os.environ.pop("TILECAST_CACHE", None)
    else:
        os.environ["TILECAST_CACHE"] = previous


@pytest.fixture(autouse=True)
def signal_mask_unchanged():
    """Fail a test that leaves this process's signal mask changed, and restore it: a blocked signal is
    inherited by every process started later (``fork`` and ``exec`` keep it), so a test that ran
    ``SignalWatcher.install`` in the pytest process made every later server on that worker ignore
    SIGTERM (stopped only by a kill 30 s later, its torchrun left behind)."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    after = signal.pthread_sigmask(signal.SIG_SETMASK, before)
    assert after == before, f"the test left the signal mask changed: {sorted(s.name for s in after ^ before)}"
