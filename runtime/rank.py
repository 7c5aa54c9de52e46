"""Start-up shared by ``serve`` and ``generate`` on every rank: logging, signals, process groups,
the pipeline, and the agreement that every rank loaded it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Callable

from tilecast.runtime.config import ServeConfig
from tilecast.runtime.distributed import Ranks, all_ranks_ok, die_with_parent, init_ranks
from tilecast.runtime.pipeline import Pipeline, RankContext
from tilecast.runtime.registry import ensure_builtin_checkpoint, resolve_pipeline
from tilecast.runtime.replicas import Replica, ReplicaLayout, build_replica, layout_of, replica_context
from tilecast.runtime.torchrun_env import under_torchrun
from tilecast.runtime.watchdog import ProgressBeat

logger = logging.getLogger(__name__)


def configure_logging(rank: int, level: str = "INFO") -> None:
    """Rank 0 logs at ``level``; other ranks only warnings, each line tagged with its rank."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(level if rank == 0 else max(logging.WARNING, logging.getLevelName(level)))
    for noisy in ("diffusers", "transformers", "torch", "accelerate"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


class SignalWatcher(threading.Thread):
    """Receives SIGINT/SIGTERM in a thread of its own, so a main thread stuck inside a collective
    cannot delay shutdown.

    The signals are blocked in the main thread before it starts any thread, so every thread
    tilecast starts inherits the mask. A library may already have started threads of its own with
    the signals unblocked: numpy's OpenBLAS starts its thread pool when torch imports numpy (one
    thread per extra core unless ``OMP_NUM_THREADS``/``OPENBLAS_NUM_THREADS`` say 1, which is why a
    one-rank server died of SIGTERM while torchrun's ranks, started with ``OMP_NUM_THREADS=1``, did
    not). The kernel may deliver a signal to such a thread, so the signals get a Python handler
    (never the default, which kills the process) and a wakeup file descriptor: CPython's C-level
    handler writes the signal number to it in whichever thread the signal lands, and this thread,
    the only tilecast thread with the signals unblocked, reads it and calls ``on_signal``.
    """

    SIGNALS = {signal.SIGINT, signal.SIGTERM}

    def __init__(self, on_signal: Callable[[int], None]) -> None:
        super().__init__(name="tilecast-signals", daemon=True)
        self.on_signal = on_signal
        self._reader, self._writer = socket.socketpair()
        """CPython's signal handler writes to ``_writer`` (non-blocking); this thread reads ``_reader``.
        Both stay open for the life of the process."""
        self._writer.setblocking(False)

    @classmethod
    def install(cls, on_signal: Callable[[int], None]) -> "SignalWatcher":
        """Call from the main thread, before starting any other thread."""
        assert threading.current_thread() is threading.main_thread(), "signals are installed from the main thread"
        signal.pthread_sigmask(signal.SIG_BLOCK, cls.SIGNALS)
        watcher = cls(on_signal)
        for signum in cls.SIGNALS:
            signal.signal(signum, cls._noted)
        signal.set_wakeup_fd(watcher._writer.fileno(), warn_on_full_buffer=False)
        watcher.start()
        return watcher

    @staticmethod
    def _noted(signum, _frame) -> None:
        """The Python-level handler (main thread, later): the watcher already acted on the signal."""

    def run(self) -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, self.SIGNALS)
        while True:
            data = self._reader.recv(1)
            if not data:
                return
            if data[0] in self.SIGNALS:
                self.on_signal(data[0])
                return


@dataclasses.dataclass(kw_only=True)
class RankRuntime:
    config: ServeConfig
    ranks: Ranks
    pipeline: Pipeline
    ctx: RankContext
    beat: ProgressBeat
    replica: Replica
    """This rank's serving group (``runtime/replicas.py``): all ranks unless serving replica groups."""


def write_pid_file(rank: int) -> None:
    """Let the launcher find and reap this rank should torchrun leave it behind."""
    run_dir = os.environ.get("TILECAST_RUN_DIR")
    if run_dir:
        Path(run_dir, f"rank{rank}.pid").write_text(str(os.getpid()))


def build_groups(config: ServeConfig, ranks: Ranks):
    """The topology's process groups (collective on every rank); None with one rank.

    The world size is this run's, on every node (``WORLD_SIZE``); the data-parallel replicas fill
    it (``Topology``'s rules, so a mistake reads as it does before launch: ``TopologyError``).
    """
    if not ranks.distributed:
        return None
    from tilecast.runtime.topology import Topology

    topology = Topology(
        num_gpus=ranks.world_size,
        tp_size=config.tp_size,
        ulysses_degree=config.ulysses_degree,
        ring_degree=config.ring_degree,
        dp_degree=getattr(config, "dp_degree", None),
        attention_backend=config.attention_backend,
    )
    return topology.groups(topology.build_mesh(ranks.device.type))


def start_rank(
    config: ServeConfig,
    *,
    on_progress: Callable[[int, int], None] | None = None,
    replicas: bool = False,
) -> RankRuntime:
    """Process groups, pipeline load on every rank; raises on every rank if any rank failed to load.

    ``replicas`` (``tilecast serve``): split the ranks into serving groups (``replicas.layout_of``) and
    load the pipeline with this rank's group as its run (``replica_context``). Otherwise (``generate``)
    one group of all ranks."""
    if under_torchrun():
        die_with_parent()  # first: a rank still waiting on the checkpoint's lock goes down with torchrun too
        # A built-in checkpoint is made (or verified) before the process group exists: the first rank
        # to take the cache's lock builds it in this process, the others wait and verify
        # (runtime/cache.py). One rank alone makes it when its pipeline loads.
        ensure_builtin_checkpoint(config.model_path)
    ranks = init_ranks(config.device, timeout_s=config.stuck_timeout_s + 60.0)
    write_pid_file(ranks.rank)
    beat = ProgressBeat()

    def progress(done: int, total: int) -> None:
        beat.tick()
        if on_progress is not None:
            on_progress(done, total)

    if ranks.rank == 0:
        config.output_dir.mkdir(parents=True, exist_ok=True)
    ctx = RankContext(
        rank=ranks.rank,
        world_size=ranks.world_size,
        device=ranks.device,
        cpu_group=ranks.cpu_group,
        device_group=ranks.device_group,
        output_dir=config.output_dir,
        settings=config,
        on_progress=progress,
        heartbeat=beat.tick,
        groups=build_groups(config, ranks),
    )
    layout = (
        layout_of(config, ranks.world_size) if replicas else ReplicaLayout(groups=(tuple(range(ranks.world_size)),))
    )
    replica = build_replica(layout, ranks, ctx.groups)
    ctx = replica_context(ctx, replica)
    if ranks.rank == 0 and layout.num_groups > 1:
        logger.info("serving in %s", layout.describe())
    error = None
    pipeline = None
    try:
        pipeline_cls = resolve_pipeline(config.model_path, config.model_id)
        pipeline = pipeline_cls.load(config.model_path, ctx)
        pipeline.model_name = config.model_id or config.model_path
    except Exception as exc:  # noqa: BLE001 - every rank must learn about it before anyone proceeds
        error = exc
    if not all_ranks_ok(error is None, ranks):
        if error is not None:
            raise error
        raise RuntimeError("another rank failed to load the model (see its log)")
    return RankRuntime(config=config, ranks=ranks, pipeline=pipeline, ctx=ctx, beat=beat, replica=replica)
