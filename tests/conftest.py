"""Shared fixtures."""

from __future__ import annotations

import os

import pytest


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
