"""How rank 0's scheduler reaches the replica groups it does not belong to, and how their results come back.

Design: one ZeroMQ ROUTER socket on rank 0 (``ReplicaHub``, bound like the heartbeat socket on
``MASTER_ADDR`` with a port the OS picks, broadcast to every rank at start-up) and one DEALER
socket per leader of groups 1.. (``ReplicaLink``, identity ``group-<n>``). Each socket lives in an
IO thread of its own, joined to the scheduler or the compute loop by queues, so a compute loop
never touches a socket and rank 0's scheduler keeps dispatching to group 1 while rank 0's main
thread computes for group 0.

Why ZeroMQ and not gloo point-to-point on the world group: a gloo ``recv`` blocks its thread until
a peer sends or the collective timeout fires (many minutes), and rank 0 would need a thread per
group sitting in gloo calls next to its main thread's own collectives; a socket is polled, never
blocks the scheduler, frames tensors without copies, and a dead leader is noticed by the heartbeat
watchdog in seconds exactly as for any rank. The compute groups keep gloo/NCCL for the plan
broadcast inside a group, so every rank of a group still runs the same plan in the same order.

Messages (``scheduler/protocol.py``, ``REPLICA_TYPES``): ``ReplicaHello`` once from each leader
(the hub counts a group ready only then); rank 0 sends ``Plan`` (run or stop) and ``ReplicaCancel``;
a leader sends throttled ``ReplicaProgress`` and one ``ReplicaDone`` per plan with its outputs:
the files are already in the job folder on the shared filesystem (the leader is the group's
output rank), so only their paths travel, plus ``Output.info`` and ``Output.tensors`` as frames.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path
from typing import Callable

import zmq

from tilecast.runtime.pipeline import Output, OutputFile, PlanHooks
from tilecast.runtime.watchdog import heartbeat_host
from tilecast.scheduler import protocol as P
from tilecast.scheduler.scheduler import PLAN_CANCELLED
from tilecast.scheduler.wakeup import PollingThread, Wakeup

logger = logging.getLogger(__name__)

PROGRESS_EVERY_S = 0.05
"""A leader sends a plan's progress at most this often (a FLUX step can take microseconds)."""


def _identity(group: int) -> bytes:
    return f"group-{group}".encode()


# ------------------------------------------------------------------------------------ outputs
def encode_outcome(seq: int, outcome) -> list:
    """Frames of ``ReplicaDone`` for a compute loop outcome (outputs, ``PLAN_CANCELLED`` or an error)."""
    if outcome is PLAN_CANCELLED:
        return P.encode(P.ReplicaDone(seq=seq, status="cancelled"))
    if isinstance(outcome, str):
        return P.encode(P.ReplicaDone(seq=seq, status="failed", error=outcome))
    records, frames = [], []
    for output in outcome:
        files = [
            P.OutputMeta(name=f.name, kind="file", mime=f.mime, path=str(Path(f.path).resolve())) for f in output.files
        ]
        tensors = []
        for name, tensor in output.tensors.items():
            meta, data = P.tensor_to_frame(name, tensor)
            tensors.append(meta)
            frames.append(data)
        records.append(P.ReplicaOutput(files=files, tensors=tensors, info=dict(output.info)))
    return P.encode(P.ReplicaDone(seq=seq, status="ok", outputs=records), *frames)


def decode_outcome(msg: P.ReplicaDone, frames: list):
    """The outcome the scheduler takes (``Scheduler._on_done``) from a ``ReplicaDone`` and its frames."""
    if msg.status == "cancelled":
        return PLAN_CANCELLED
    if msg.status != "ok":
        return msg.error or "the batch failed in another replica group (see its log)"
    frames = list(frames)
    outputs = []
    for record in msg.outputs:
        tensors = {meta.name: P.frame_to_tensor(meta, frames.pop(0)) for meta in record.tensors}
        files = [OutputFile(name=f.name, path=Path(f.path or ""), mime=f.mime) for f in record.files]
        outputs.append(Output(files=files, tensors=tensors, info=dict(record.info)))
    return outputs


# ------------------------------------------------------------------------------------ rank 0
class ReplicaHub(PollingThread):
    """Rank 0's socket to the leaders of groups ``1 .. num_groups - 1``.

    ``deliver(event)`` receives scheduler inbox events: ``("replica_ready", group)``,
    ``("progress", seq, fraction)`` and ``("done", seq, outcome)``.
    """

    def __init__(self, *, num_groups: int, deliver: Callable[[tuple], None], context: zmq.Context | None = None):
        super().__init__(name="tilecast-replica-hub")
        self.num_groups = num_groups
        self.deliver = deliver
        self._context = context or zmq.Context.instance()
        self._sock = self._context.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 500)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        port = self._sock.bind_to_random_port(f"tcp://{heartbeat_host()}")
        self.endpoint = f"tcp://{heartbeat_host()}:{port}"
        self._wakeup = Wakeup(self._context, "replica-hub")
        self.ready: set[int] = set()
        """Groups whose leader said hello."""
        self._all_ready = threading.Event()
        self.undelivered = 0
        """Plans or cancels a vanished leader could not take (the watchdog then ends the run)."""

    def send_plan(self, group: int, plan: P.Plan) -> None:
        self._send(group, P.encode(plan))

    def cancel(self, group: int, seq: int) -> None:
        self._send(group, P.encode(P.ReplicaCancel(seq=seq)))

    def _send(self, group: int, frames: list) -> None:
        assert 1 <= group < self.num_groups, group
        self._queue(group, frames)

    def wait_ready(self, timeout: float) -> list[int]:
        """Wait for every leader's hello; the groups still missing after ``timeout`` (empty: all there)."""
        self._all_ready.wait(timeout)
        return [g for g in range(1, self.num_groups) if g not in self.ready]

    # -- the thread (``PollingThread``)
    def _handlers(self) -> dict:
        return {self._sock: self._drain_inbound}

    def _failed(self, exc: BaseException) -> None:
        logger.exception("replica hub thread failed")  # the heartbeat watchdog sees the groups go quiet

    def _close(self) -> None:
        self._sock.close()

    def _drain_inbound(self) -> None:
        while True:
            try:
                identity, *frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg, payloads = P.decode(frames, allowed=P.REPLICA_TYPES)
            except P.WireError as exc:
                logger.error("replica hub: undecodable message from %r: %s", identity, exc)
                continue
            if isinstance(msg, P.ReplicaHello):
                if identity != _identity(msg.group) or not 1 <= msg.group < self.num_groups:
                    logger.error("replica hub: hello from %r claims group %d", identity, msg.group)
                    continue
                self.ready.add(msg.group)
                logger.debug("replica group %d: leader rank %d connected", msg.group, msg.rank)
                self.deliver(("replica_ready", msg.group))
                if len(self.ready) == self.num_groups - 1:
                    self._all_ready.set()
            elif isinstance(msg, P.ReplicaProgress):
                self.deliver(("progress", msg.seq, msg.fraction))
            elif isinstance(msg, P.ReplicaDone):
                try:
                    outcome = decode_outcome(msg, payloads)
                except P.WireError as exc:
                    outcome = f"the outputs of the replica group could not be read: {exc}"
                self.deliver(("done", msg.seq, outcome))

    def _send_now(self, group: int, frames: list) -> None:
        try:
            self._sock.send_multipart([_identity(group), *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            self.undelivered += 1
            logger.error("replica group %d unreachable (%s)", group, exc)


# ------------------------------------------------------------------------------------ a leader
class ReplicaLink(PollingThread):
    """A group leader's socket to rank 0: plans in (``next_plan``), progress and outcomes out."""

    def __init__(self, endpoint: str, *, group: int, rank: int, context: zmq.Context | None = None) -> None:
        super().__init__(name=f"tilecast-replica-link-{group}")
        self.endpoint, self.group, self.rank = endpoint, group, rank
        self._context = context or zmq.Context.instance()
        self._sock = self._context.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, _identity(group))
        self._sock.setsockopt(zmq.LINGER, 2000)  # the last outcome reaches rank 0 before exit
        self._sock.connect(endpoint)
        self._wakeup = Wakeup(self._context, f"replica-link-{group}")
        self._plans: "queue.Queue[P.Plan]" = queue.Queue()
        self._cancelled: set[int] = set()
        self._last_progress: dict[int, float] = {}
        self._queue(P.encode(P.ReplicaHello(group=group, rank=rank)))

    # -- the compute loop's side
    def next_plan(self, timeout: float) -> P.Plan | None:
        try:
            return self._plans.get(timeout=timeout)
        except queue.Empty:
            return None

    def hooks(self, seq: int) -> PlanHooks:
        return PlanHooks(seq, report=self.progress, cancelled=lambda s: s in self._cancelled)

    def progress(self, seq: int, fraction: float) -> None:
        now = time.monotonic()
        if fraction < 1.0 and now - self._last_progress.get(seq, 0.0) < PROGRESS_EVERY_S:
            return
        self._last_progress[seq] = now
        self._queue(P.encode(P.ReplicaProgress(seq=seq, fraction=fraction)))

    def done(self, seq: int, outcome) -> None:
        self._last_progress.pop(seq, None)
        self._cancelled.discard(seq)
        self._queue(encode_outcome(seq, outcome))

    # -- the thread (``PollingThread``)
    def stop(self, timeout: float = 3.0) -> None:
        super().stop(timeout)

    def _handlers(self) -> dict:
        return {self._sock: self._drain_inbound}

    def _failed(self, exc: BaseException) -> None:
        logger.exception("replica link thread failed")  # rank 0's watchdog ends the run

    def _close(self) -> None:
        self._sock.close()

    def _drain_inbound(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg, _ = P.decode(frames, allowed=P.REPLICA_TYPES)
            except P.WireError as exc:
                logger.error("replica link: undecodable message from rank 0: %s", exc)
                continue
            if isinstance(msg, P.Plan):
                self._plans.put(msg)
            elif isinstance(msg, P.ReplicaCancel):
                self._cancelled.add(msg.seq)

    def _send_now(self, frames: list) -> None:
        self._sock.send_multipart(frames, copy=False)
