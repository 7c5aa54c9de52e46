"""Run a function on N local gloo ranks, for multi-rank tests on CPU.

    from tests.distributed import run_ranks    # tests/ is a package (tests/__init__.py)

    def _body(rank, world_size, n):            # module level, so spawn can pickle it
        return rank * n

    def test_x():
        assert run_ranks(_body, 2, 10, timeout=60) == [0, 10]

Every rank gets ``fn(rank, world_size, *args)`` with the default process group already
initialised (gloo, joined through a TCPStore this process holds on a port the OS picked, so
no port is ever chosen and then lost) and torch limited to one thread. The
return values (picklable) come back in rank order. If any rank raises, ``RankError`` is raised
with every failing rank's traceback. If the ranks do not all finish within ``timeout`` seconds,
the stragglers are killed and ``TimeoutError`` is raised. The process group is destroyed and
every child is joined or killed in all cases.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed
import torch.multiprocessing as mp

__all__ = ["RankError", "one_thread", "run_ranks"]


def _tests_importable_without_the_root() -> None:
    """Rank processes unpickle test functions by module name (``tests.<file>``), but the checkout
    root stays off ``sys.path`` (its ``kernels/`` would shadow the PyPI package). Put a directory
    holding only a ``tests`` link to this package on ``sys.path``: spawned ranks inherit it."""
    import sys
    import tempfile
    import zlib

    package = os.path.dirname(os.path.realpath(__file__))
    holder = os.path.join(
        tempfile.gettempdir(), f"tilecast-tests-path-{os.getuid()}-{zlib.crc32(package.encode()):08x}"
    )
    link = os.path.join(holder, "tests")
    os.makedirs(holder, exist_ok=True)
    if os.path.realpath(link) != package:
        try:
            os.symlink(package, link)
        except FileExistsError:
            pass
    if holder not in sys.path:
        sys.path.append(holder)


_tests_importable_without_the_root()


class RankError(RuntimeError):
    """One or more ranks raised; ``failures`` maps rank → formatted traceback."""

    def __init__(self, failures: dict[int, str]):
        self.failures = failures
        details = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        super().__init__(f"{len(failures)} rank(s) failed: {sorted(failures)}\n{details}")


def _worker(fn, rank: int, world_size: int, store_port: int, pg_timeout: float, results, args) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        timeout = datetime.timedelta(seconds=pg_timeout)
        store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        try:
            # Plain pickle copies tensors by value (no shared-memory handles that die with the child).
            results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, False, traceback.format_exc()))


DEFAULT_PRELOAD: tuple[str, ...] = (
    # First: the server starts as ``python -c ...`` without ``-P`` under pytest-xdist, so the
    # checkout root (its working directory) leads its sys.path, and transformers' ``import kernels``
    # (the PyPI package) would find our ``kernels/``; ``import tilecast`` takes the root off.
    "tilecast",
    "torch",
    "torch.distributed",
    "torch.distributed.device_mesh",
    "diffusers.models.modeling_utils",
    "diffusers.models.attention",
)
"""Modules the fork server imports once, so each rank starts in milliseconds instead of seconds."""


def _context(start_method: str, preload: tuple[str, ...]):
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # Takes effect when the server starts (first call in this process); later lists are ignored.
        ctx.set_forkserver_preload(list(dict.fromkeys(DEFAULT_PRELOAD + preload)))
    return ctx


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120,
    start_method: str | None = None,
    preload: tuple[str, ...] = (),
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; results in rank order.

    ``start_method="forkserver"`` (the default without a GPU) forks ranks from a clean server
    process that has imported ``DEFAULT_PRELOAD + preload`` once (it never ran torch kernels, so
    fork is safe with OpenMP); ``"spawn"`` starts fresh interpreters (slower, fully isolated; the
    default where a GPU is visible: there ``torch.compile`` in a rank asks for the CUDA RNG state,
    which a forked process refuses once CUDA was initialized before the fork, as seen on an H100).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if start_method is None:
        start_method = "spawn" if torch.cuda.is_available() else "forkserver"
    ctx = _context(start_method, preload)
    results = ctx.Queue()
    # The parent hosts the rendezvous store: bound to port 0 and held until every rank is done.
    store = torch.distributed.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    deadline = time.monotonic() + timeout
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, store.port, max(timeout, 10), results, args),
            daemon=True,
            name=f"rank{rank}",
        )
        for rank in range(world_size)
    ]
    outcomes: dict[int, tuple[bool, Any]] = {}
    try:
        for proc in procs:
            proc.start()
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                # A rank that died without reporting (segfault, OOM kill) will never answer.
                for r, p in enumerate(procs):
                    if r not in outcomes and p.exitcode not in (None, 0):
                        outcomes[r] = (False, f"process exited with code {p.exitcode} without reporting")
                        deadline = min(deadline, time.monotonic() + 5)
                continue
            outcomes[rank] = (ok, value)
            if not ok:
                # One failure usually hangs the others in a collective: collect what comes quickly.
                deadline = min(deadline, time.monotonic() + 5)
    finally:
        for proc in procs:
            proc.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())) if proc.is_alive() else 0)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        results.close()
        results.cancel_join_thread()
        del store

    failures = {r: v for r, (ok, v) in outcomes.items() if not ok}
    if failures:
        raise RankError(failures)
    missing = [r for r in range(world_size) if r not in outcomes]
    if missing:
        raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout}s (killed)")
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]


@contextlib.contextmanager
def one_thread():
    """Run torch on one thread, as each rank does: CPU conv kernels split work by thread count,
    which changes rounding, so "the same topology" for a single-rank reference includes it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
