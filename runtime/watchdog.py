"""Heartbeats from every rank and the rank-0 watchdog that turns silence into a clear failure.

Each worker rank runs a ``HeartbeatSender`` thread (a ZeroMQ PUSH socket to rank 0) reporting
its progress counter. Rank 0's ``Watchdog`` thread declares the server dead when a rank's
heartbeats stop (the process died) or when no busy rank's counter has moved for
``--stuck-timeout-s`` (it is stuck), well before any collective timeout would fire.

The counter moves with every unit of a plan (``RankContext.progress``: a step, a tile) and inside
long stages without units (``RankContext.alive``: each VAE decoder block, each module call), so
a legitimately long stage keeps beating; only a rank that stops beating is stuck. A rank waiting
in a collective for a peer that still beats (uneven tiles, the last round of a gather) is not
stuck either: the verdict comes once every busy rank is still, and names the one still longest.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from typing import Callable

import msgspec
import zmq

logger = logging.getLogger(__name__)


class ProgressBeat:
    """A counter the compute loop bumps whenever it makes progress (thread-safe enough: one writer),
    with the time of its last move on this process's monotonic clock."""

    def __init__(self) -> None:
        self.counter = 0
        self.busy = False
        self.moved_at = time.monotonic()

    def tick(self) -> None:
        self.counter += 1
        self.moved_at = time.monotonic()

    def set_busy(self, busy: bool) -> None:
        self.busy = busy
        self.tick()

    def still_s(self) -> float:
        """Seconds since the counter last moved."""
        return time.monotonic() - self.moved_at


@dataclasses.dataclass(kw_only=True)
class WatchdogConfig:
    heartbeat_interval_s: float = 0.5
    """How often every rank reports."""
    heartbeat_timeout_s: float = 10.0
    """A rank silent this long is dead."""
    stuck_timeout_s: float = 300.0
    """A busy rank whose progress counter has not moved this long is stuck."""

    def __post_init__(self) -> None:
        for name in ("heartbeat_interval_s", "heartbeat_timeout_s", "stuck_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.heartbeat_timeout_s <= 2 * self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed twice the heartbeat interval"
                f" ({self.heartbeat_interval_s})"
            )


def heartbeat_host() -> str:
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        return socket.gethostbyname(addr)
    except OSError:
        return "127.0.0.1"


class HeartbeatSender(threading.Thread):
    def __init__(self, endpoint: str, rank: int, beat: ProgressBeat, interval_s: float) -> None:
        super().__init__(name=f"tilecast-heartbeat-{rank}", daemon=True)
        self.endpoint, self.rank, self.beat, self.interval_s = endpoint, rank, beat, interval_s
        self._halt = threading.Event()

    def run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 10)
        sock.connect(self.endpoint)
        encoder = msgspec.msgpack.Encoder()
        try:
            while not self._halt.is_set():
                try:
                    beat = self.beat
                    message = [self.rank, os.getpid(), beat.counter, beat.busy, beat.still_s(), socket.gethostname()]
                    sock.send(encoder.encode(message), zmq.NOBLOCK)
                except zmq.Again:
                    pass
                self._halt.wait(self.interval_s)
        finally:
            sock.close()

    def stop(self) -> None:
        self._halt.set()


class Watchdog(threading.Thread):
    """Rank 0: collects heartbeats, calls ``on_fatal(reason)`` once when a rank dies or sticks."""

    def __init__(
        self,
        *,
        world_size: int,
        beat: ProgressBeat,
        config: WatchdogConfig,
        on_fatal: Callable[[str], None],
        clock=time.monotonic,
        groups: tuple[tuple[int, ...], ...] | None = None,
    ) -> None:
        super().__init__(name="tilecast-watchdog", daemon=True)
        self.groups = groups or (tuple(range(world_size)),)
        """Ranks that run plans together (serving replica groups); the stuck rule applies per group."""
        self.world_size, self.beat, self.config, self.on_fatal, self.clock = world_size, beat, config, on_fatal, clock
        self._sock = zmq.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{heartbeat_host()}")
        self.endpoint = f"tcp://{heartbeat_host()}:{port}"
        self._halt = threading.Event()
        now = clock()
        self.last_seen = {rank: now for rank in range(1, world_size)}
        self.progress = {rank: (-1, now) for rank in range(world_size)}
        self.busy = {rank: False for rank in range(world_size)}
        self.pids: dict[int, int] = {}
        """Pids of the worker ranks on this host (a vanished one names the dead rank)."""
        self.fired = False

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        decoder = msgspec.msgpack.Decoder()
        try:
            while not self._halt.is_set():
                if self._sock.poll(int(self.config.heartbeat_interval_s * 1000)):
                    while True:
                        try:
                            message = decoder.decode(self._sock.recv(zmq.NOBLOCK))
                        except zmq.Again:
                            break
                        rank, pid, counter, busy, still_s, host = message
                        self._observe(rank, counter, busy, still_s)
                        self.last_seen[rank] = self.clock()
                        if host == socket.gethostname():
                            self.pids[rank] = pid
                self._observe(0, self.beat.counter, self.beat.busy, self.beat.still_s())
                reason = self.check()
                if reason and not self.fired:
                    self.fired = True
                    self.on_fatal(reason)
        finally:
            self._sock.close()

    def _observe(self, rank: int, counter: int, busy: bool, still_s: float = 0.0) -> None:
        """``still_s``: how long ago the rank's counter moved, on its own clock. A heartbeat is read
        up to an interval after it was sent: the time of the move, not of the reading, decides which
        rank stopped first (never before the last move seen, or this watchdog's start)."""
        self.busy[rank] = busy
        last_counter, last_moved = self.progress[rank]
        if last_counter != counter:
            self.progress[rank] = (counter, max(self.clock() - still_s, last_moved))

    def check(self) -> str | None:
        """The reason the server is dead, or None."""
        now = self.clock()
        for rank, seen in self.last_seen.items():
            silent = now - seen
            if silent > self.config.heartbeat_timeout_s:
                return f"rank {rank} sent no heartbeat for {silent:.1f} s (process died or hung hard)"
        for group in self.groups:
            still = {rank: now - self.progress[rank][1] for rank in group if self.busy[rank]}
            if still and min(still.values()) > self.config.stuck_timeout_s:
                # No busy rank of the group moves: name the one that stopped first (the others wait
                # for it in a collective).
                rank = max(still, key=still.get)
                return f"rank {rank} made no progress for {still[rank]:.1f} s (stuck; --stuck-timeout-s)"
        # Rank 0 idles by broadcasting every second; a silent rank 0 counter means its loop is blocked.
        counter0, changed0 = self.progress[0]
        if not self.busy[0] and now - changed0 > self.config.stuck_timeout_s:
            return f"rank 0 loop made no progress for {now - changed0:.1f} s (stuck)"
        return None
