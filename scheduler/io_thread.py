"""The ROUTER socket and the thread that owns it.

Inbound messages are handed to ``deliver(identity, frames)``; any thread may call ``send``, which
queues the frames and wakes the IO thread through an inproc socket. Nothing else touches the
ROUTER socket. Oversize messages are dropped by ZeroMQ itself (``ZMQ_MAXMSGSIZE``).
"""

from __future__ import annotations

import logging
import queue
import threading

import zmq

from tilecast.scheduler.wakeup import Wakeup

logger = logging.getLogger(__name__)


class SocketThread(threading.Thread):
    """Owns a bound ROUTER socket; bridges it to ``deliver`` and ``send``."""

    def __init__(
        self,
        endpoint: str,
        deliver,
        *,
        max_message_bytes: int,
        context: zmq.Context | None = None,
    ) -> None:
        super().__init__(name="tilecast-router", daemon=True)
        self.endpoint = endpoint
        self.deliver = deliver
        self._context = context or zmq.Context.instance()
        self._outbox: "queue.Queue[tuple[bytes, list]]" = queue.Queue()
        self._halt = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None

        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 1000)
        self._router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._router.bind(endpoint)  # raises here, in the caller, when the port is taken
        self.bound_endpoint = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._wakeup = Wakeup(self._context, "router")

    def send(self, identity: bytes, frames: list) -> None:
        """Queue a reply to ``identity`` (thread-safe)."""
        self._outbox.put((identity, frames))
        self._wakeup.wake()

    def stop(self, timeout: float = 2.0) -> None:
        self._halt.set()
        try:
            self._wakeup.wake()
        except zmq.ZMQError:  # the thread already closed its sockets
            pass
        self.join(timeout)

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wakeup.pull, zmq.POLLIN)
        try:
            while not self._halt.is_set():
                events = dict(poller.poll(500))
                if self._router in events:
                    self._drain_inbound()
                if self._wakeup.pull in events:
                    self._wakeup.drain()
                self._drain_outbound()
            self._drain_outbound()
        except BaseException as exc:  # noqa: BLE001 - reported through the log; the watchdog sees the thread die
            self._error = exc
            logger.exception("router thread failed")
        finally:
            self._router.close(linger=500)
            self._wakeup.close()

    def _drain_inbound(self) -> None:
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity, *body = frames
            self.deliver(identity.bytes, [f.buffer for f in body])

    def _drain_outbound(self) -> None:
        while True:
            try:
                identity, frames = self._outbox.get_nowait()
            except queue.Empty:
                return
            try:
                self._router.send_multipart([identity, *frames], copy=False)
            except zmq.ZMQError as exc:  # peer gone: nothing to do
                logger.debug("reply to a vanished client dropped: %s", exc)
