"""The ROUTER socket and the thread that owns it.

Inbound messages are handed to ``deliver(peer, frames)``; any thread may call ``send(peer,
frames)``, which queues the frames and wakes the IO thread through an inproc socket. Nothing else
touches the ROUTER socket.

- **Peers**: a ``Peer`` is the reply route plus what the socket knows of the sender: its address
  (ZeroMQ's ``Peer-Address``) and whether it passed CURVE authentication. DEALER clients send
  ``[type, body, *payloads]``; REQ clients add an empty delimiter frame first, which is stripped
  here and put back on the reply, so REQ sockets work too (one reply per request, as they expect).
- **Size limit**: a message larger than ``max_message_bytes`` is answered with a ``bad_request``
  error naming the limit. ZeroMQ itself drops frames over ``hard_limit_bytes``
  (``ZMQ_MAXMSGSIZE``, twice the limit) so rank 0's memory stays bounded; the client library
  checks the limit before it sends, so its users always get the error.
- **Replies that cannot be delivered** (the peer disconnected, or its queue is full) are counted
  (``stats()``), never block the thread.
- **Authentication** (``auth``): the socket is a CURVE server and only peers holding the API key
  complete the handshake (``scheduler/auth.py``); refused handshakes are counted.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging

import zmq

from tilecast.scheduler import protocol as P
from tilecast.scheduler.auth import ServerAuth
from tilecast.scheduler.wakeup import PollingThread, Wakeup

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Peer:
    """Where a request came from, and so where its reply goes."""

    route: tuple[bytes, ...]
    """The envelope frames to put before a reply: the ROUTER identity (and REQ's empty delimiter)."""
    address: str | None = None
    """The sender's IP address as ZeroMQ saw it (None when unknown)."""
    authenticated: bool = False
    """Whether the sender proved it holds the API key (CURVE)."""

    @property
    def local(self) -> bool:
        """Whether the sender connected from this machine."""
        if self.address is None:
            return False
        try:
            return ipaddress.ip_address(self.address).is_loopback
        except ValueError:
            return False


class SocketThread(PollingThread):
    """Owns a bound ROUTER socket; bridges it to ``deliver`` and ``send``."""

    def __init__(
        self,
        endpoint: str,
        deliver,
        *,
        max_message_bytes: int,
        auth: ServerAuth | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        super().__init__(name="tilecast-router")
        self.endpoint = endpoint
        self.deliver = deliver
        self.max_message_bytes = max_message_bytes
        self.auth = auth
        self._context = context or zmq.Context.instance()
        self._error: BaseException | None = None
        self.dropped_replies = 0
        """Replies that could not be delivered (peer gone, or its queue full)."""
        self.oversize_messages = 0
        """Inbound messages refused for their size."""

        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 1000)
        self._router.setsockopt(zmq.MAXMSGSIZE, 2 * max_message_bytes)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an undeliverable reply raises: counted
        self._monitor = None
        if auth is not None:
            auth.start()
            self._monitor = auth.secure(self._router)
        try:
            self._router.bind(endpoint)  # raises here, in the caller, when the port is taken
        except zmq.ZMQError:
            self._close()
            raise
        self.bound_endpoint = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._wakeup = Wakeup(self._context, "router")

    def send(self, peer: Peer, frames: list) -> None:
        """Queue a reply to ``peer`` (thread-safe)."""
        self._queue(peer, frames)

    def stats(self) -> dict[str, int]:
        return {
            "dropped_replies": self.dropped_replies,
            "oversize_messages": self.oversize_messages,
            "refused_handshakes": self.auth.refused_handshakes if self.auth is not None else 0,
        }

    # -- the thread (``PollingThread``)
    def _handlers(self) -> dict:
        handlers = {self._router: self._drain_inbound}
        if self._monitor is not None:
            monitor = self._monitor
            handlers[monitor] = lambda: self.auth.count(monitor)
        return handlers

    def _failed(self, exc: BaseException) -> None:
        self._error = exc
        logger.exception("router thread failed")  # the watchdog sees the thread die

    def _close(self) -> None:
        if self._monitor is not None:
            self._router.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        self._router.close(linger=500)
        if self.auth is not None:
            self.auth.stop()

    def _drain_inbound(self) -> None:
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity, *body = frames
            route = (identity.bytes,)
            if body and len(body[0].buffer) == 0:  # a REQ socket's envelope delimiter
                route, body = (identity.bytes, b""), body[1:]
            first = body[0] if body else identity
            peer = Peer(route=route, address=first.get("Peer-Address"), authenticated=self.auth is not None)
            size = sum(len(frame.buffer) for frame in body)
            if size > self.max_message_bytes:
                self.oversize_messages += 1
                reply = P.ErrorReply(
                    req_id=P.peek_req_id([frame.buffer for frame in body]),
                    code="bad_request",
                    message=f"the message is {size} bytes, over this server's limit of {self.max_message_bytes}"
                    " bytes (--max-message-mb)",
                )
                self._send_now(peer, P.encode(reply))
                continue
            self.deliver(peer, [frame.buffer for frame in body])

    def _send_now(self, peer: Peer, frames: list) -> None:
        try:
            self._router.send_multipart([*peer.route, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: peer gone; EAGAIN: its queue is full
            self.dropped_replies += 1
            logger.debug("reply to a vanished or saturated client dropped: %s", exc)
