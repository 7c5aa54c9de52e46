"""``tilecast serve`` on one rank.

Rank 0 runs the router socket thread, the scheduler thread and the watchdog, and computes in
its main thread; every other rank computes and sends heartbeats. A dead or stuck rank, a failed
collective or a signal ends the whole run: every job gets a terminal state and a clear error,
then rank 0 exits (non-zero on failure), which makes torchrun stop the remaining ranks.

With data-parallel replica groups (``runtime/replicas.py``) rank 0 computes for group 0 and also
runs ``ReplicaHub``, the socket to the leaders of the other groups (``runtime/replica_link.py``);
each of those leaders runs a ``ReplicaLink`` thread next to its group's compute loop. The
scheduler thread dispatches to every group while rank 0's main thread computes, and a dead rank in
any group fails every job of every group (the watchdog covers all ranks).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import msgspec
import zmq

from tilecast.runtime.config import ServeConfig
from tilecast.runtime.distributed import broadcast_bytes, shutdown_ranks
from tilecast.runtime.pipeline import PlanHooks
from tilecast.runtime.rank import RankRuntime, SignalWatcher, configure_logging, start_rank
from tilecast.runtime.replica_link import ReplicaHub, ReplicaLink
from tilecast.runtime.settings import describe
from tilecast.runtime.watchdog import HeartbeatSender, Watchdog
from tilecast.runtime.worker import compute_loop, queue_source
from tilecast.scheduler.auth import ServerAuth
from tilecast.scheduler.io_thread import SocketThread
from tilecast.scheduler.lora import LoraRegistry
from tilecast.scheduler.outputs import OutputStore
from tilecast.scheduler.ready import ReadyInfo, connectable, remove_ready_file, write_ready_file
from tilecast.scheduler.scheduler import DEAD, Scheduler

logger = logging.getLogger(__name__)


REPLICA_CONNECT_TIMEOUT_S = 60.0
"""How long rank 0 waits at start-up for the other replica groups' leaders to connect."""


class _Endpoints(msgspec.Struct, frozen=True):
    """What rank 0 tells every rank at start-up."""

    heartbeat: str
    """The watchdog's PULL socket."""
    replicas: str | None = None
    """``ReplicaHub``'s ROUTER socket (None with one serving group)."""


class RankZero:
    """Rank 0's threads and the one-way door to a terminal exit."""

    def __init__(self, rt: RankRuntime, *, exit_process: bool = True) -> None:
        config = rt.config
        self.rt = rt
        self.exit_process = exit_process
        max_message_bytes = int(config.max_message_mb * 2**20)
        self.hub: ReplicaHub | None = None
        """The socket to the other replica groups' leaders (None with one group)."""
        groups = self._layout_groups(rt)
        if len(groups) > 1:
            self.hub = ReplicaHub(num_groups=len(groups), deliver=lambda event: self.scheduler.inbox.put(event))
        self.scheduler = Scheduler(
            pipeline=rt.pipeline,
            send=self._send,
            batching=config.batching,
            max_queued=config.max_queued_requests,
            world_size=rt.ranks.world_size,
            outputs=OutputStore(
                config.output_dir, retention_s=config.output_retention_s, max_stored=config.max_stored_outputs
            ),
            max_queued_upload_bytes=int(config.max_queued_upload_mb * 2**20),
            max_message_bytes=max_message_bytes,
            wire_stats=lambda: self.sockets.stats(),
            groups=groups,
            dispatch=self.hub.send_plan if self.hub else None,
            cancel_plan=self.hub.cancel if self.hub else None,
            lora=LoraRegistry.from_settings(config.lora_paths, config.lora_dirs),
        )
        self.sockets = SocketThread(
            config.endpoint,
            lambda peer, frames: self.scheduler.inbox.put(("msg", peer, frames)),
            max_message_bytes=max_message_bytes,
            auth=ServerAuth(config.api_key, zmq.Context.instance()) if config.api_key else None,
        )
        self.watchdog = Watchdog(
            world_size=rt.ranks.world_size,
            beat=rt.beat,
            config=config.watchdog,
            on_fatal=self.fail,
            groups=groups,
        )
        self.http = None
        """The OpenAI-style HTTP front end (``--http-port``), a ZeroMQ client of this scheduler."""
        if config.http_port is not None:
            from tilecast.scheduler.http_server import HttpFrontEnd

            self.http = HttpFrontEnd.for_scheduler(
                endpoint=self.sockets.bound_endpoint,
                pipeline=rt.pipeline,
                host=config.http_host,
                port=config.http_port,
                max_upload_mb=config.max_upload_mb,
                max_message_mb=config.max_message_mb,
                api_key=config.api_key,
                serve_config=config,
                world_size=rt.ranks.world_size,
            )
        self._exit_lock = threading.Lock()
        self._exiting = False

    @staticmethod
    def _layout_groups(rt: RankRuntime) -> tuple[tuple[int, ...], ...]:
        """Global ranks of every serving group (one group of all ranks without replicas)."""
        from tilecast.runtime.replicas import layout_of

        if rt.replica.num_groups == 1:
            return (tuple(range(rt.ranks.world_size)),)
        return layout_of(rt.config, rt.ranks.world_size).groups

    def _send(self, peer, frames: list) -> None:
        self.sockets.send(peer, frames)

    def start(self) -> None:
        self.scheduler.start()
        self.sockets.start()
        self.watchdog.start()
        if self.hub is not None:
            self.hub.start()
        if self.http is not None:
            self.http.start()

    def compute(self) -> None:
        """Rank 0's compute loop: plans from the scheduler, outcomes back to it (until ``stop``)."""
        rt, inbox = self.rt, self.scheduler.inbox

        def hooks(seq: int) -> PlanHooks:
            return PlanHooks(
                seq,
                report=lambda s, fraction: inbox.put(("progress", s, fraction)),
                cancelled=self.scheduler.plan_cancelled,
            )

        compute_loop(
            ranks=rt.ranks,
            pipeline=rt.pipeline,
            ctx=rt.ctx,
            beat=rt.beat,
            next_plan=queue_source(self.scheduler.work),
            on_done=lambda seq, result: inbox.put(("done", seq, result)),
            hooks=hooks,
            replica=rt.replica,
        )

    def wait_for_replicas(self, timeout: float) -> None:
        """Every other group's leader connected (``ReplicaHello``), or the run fails naming the missing ones."""
        if self.hub is None:
            return
        missing = self.hub.wait_ready(timeout)
        if missing:
            self.fail(f"replica group(s) {missing} did not connect to rank 0 within {timeout:.0f} s")

    def announce(self) -> ReadyInfo:
        """Once both sockets are bound: the ready line on stdout, and the ready file (``--ready-file``)."""
        info = ReadyInfo(
            endpoint=connectable(self.sockets.bound_endpoint),
            pid=os.getpid(),
            http_url=self.http.url if self.http is not None else None,
        )
        if self.rt.config.ready_file is not None:
            write_ready_file(self.rt.config.ready_file, info)
        print(info.line(), flush=True)
        return info

    def forget_ready_file(self) -> None:
        remove_ready_file(self.rt.config.ready_file, os.getpid())

    def stop_http(self) -> None:
        """Stop the HTTP front end (before the scheduler's socket goes away)."""
        if self.http is not None:
            self.http.stop()

    def fail(self, reason: str, *, exit_code: int = 1) -> None:
        """Fail every job with ``reason``, flush the replies, exit the process (when it owns it)."""
        with self._exit_lock:
            if self._exiting:
                return
            self._exiting = True
        logger.error("tilecast: %s; failing all jobs and exiting", reason)
        self.scheduler.inbox.put(("fatal", reason))
        deadline = time.monotonic() + 3.0
        while self.scheduler.status != DEAD and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # let the last replies reach the socket thread
        if not self.exit_process:
            self.stop_http()
        self.sockets.stop()
        self.watchdog.stop()
        if self.hub is not None:
            self.hub.stop()
        if self.exit_process:
            self.forget_ready_file()
            logging.shutdown()
            os._exit(exit_code)

    def dead_worker(self) -> str | None:
        """Name a worker rank whose process is gone, if any (for a clearer error)."""
        for rank, pid in sorted(self.watchdog.pids.items()):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return f"rank {rank} (pid {pid}) died"
            except PermissionError:
                pass
        return None

    def on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        dead = self.dead_worker()
        if dead:
            self.fail(f"{dead}; the launcher stopped the remaining ranks ({name})")
        else:
            self.fail(f"server stopped by {name}", exit_code=0)


def serve(config: ServeConfig) -> int:
    """Entry point on every rank; returns the process exit code."""
    holder: dict = {}

    def on_signal(signum: int) -> None:
        if "zero" in holder:
            holder["zero"].on_signal(signum)
        else:
            os._exit(0 if signum == signal.SIGINT else 128 + signum)

    SignalWatcher.install(on_signal)
    configure_logging(int(os.environ.get("RANK", "0")))
    if int(os.environ.get("RANK", "0")) == 0:
        logger.info("effective settings:\n%s", describe(config))
    rt = start_rank(config, replicas=True)
    ranks = rt.ranks
    if ranks.rank == 0:
        zero = RankZero(rt)
        holder["zero"] = zero
        endpoints = _Endpoints(heartbeat=zero.watchdog.endpoint, replicas=zero.hub.endpoint if zero.hub else None)
        broadcast_bytes(msgspec.json.encode(endpoints), ranks)
        zero.start()
        zero.wait_for_replicas(REPLICA_CONNECT_TIMEOUT_S)
        zero.announce()
        logger.info(
            "tilecast serving %s on %s: %d rank(s)%s, device %s, batching %s",
            rt.pipeline.model_name,
            zero.sockets.bound_endpoint,
            ranks.world_size,
            f" in {rt.replica.num_groups} replica groups" if rt.replica.num_groups > 1 else "",
            config.device,
            f"dynamic (max {config.batching_max_size})" if zero.scheduler.batching.user_max > 1 else "off",
        )
        try:
            zero.compute()
        except Exception as exc:  # noqa: BLE001 - a broken collective ends the run
            zero.fail(f"a collective failed ({type(exc).__name__}: {exc}); a rank probably died")
        zero.watchdog.stop()
        zero.stop_http()
        time.sleep(0.3)  # final replies (shutdown acknowledgements) reach the socket thread
        zero.sockets.stop()
        if zero.hub is not None:
            zero.hub.stop()
        zero.forget_ready_file()
        logger.info("tilecast stopped")
    else:
        endpoints = msgspec.json.decode(broadcast_bytes(None, ranks), type=_Endpoints)
        sender = HeartbeatSender(endpoints.heartbeat, ranks.rank, rt.beat, config.watchdog.heartbeat_interval_s)
        sender.start()
        link = None
        if rt.replica.is_leader:  # the leader of a replica group other than rank 0's
            assert endpoints.replicas is not None and rt.replica.index > 0
            link = ReplicaLink(endpoints.replicas, group=rt.replica.index, rank=ranks.rank)
            link.start()
        try:
            compute_loop(
                ranks=ranks,
                pipeline=rt.pipeline,
                ctx=rt.ctx,
                beat=rt.beat,
                replica=rt.replica,
                next_plan=link.next_plan if link else None,
                on_done=link.done if link else None,
                hooks=link.hooks if link else None,
            )
        except Exception as exc:  # noqa: BLE001
            logger.error("rank %d: collective failed (%s); exiting", ranks.rank, exc)
            os._exit(1)
        if link is not None:
            link.stop()
        sender.stop()
    rt.pipeline.close()
    shutdown_ranks(ranks)
    return 0
