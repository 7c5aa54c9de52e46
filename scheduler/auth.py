"""Authentication of ZeroMQ peers with the server's API key, through CURVE.

Why CURVE and not the key inside every message: with CURVE the key never crosses the wire (the
handshake proves knowledge of it), every message after the handshake is encrypted, and a peer
without the key is refused before the server reads a single byte of its messages, so strangers
cannot make rank 0 allocate memory for a 512 MB upload either.

One shared secret is all an operator hands out: both CURVE key pairs are derived from it (BLAKE2b
with a per-role personalisation). A client that knows the key derives the server's public key and
its own key pair; the server accepts exactly that client public key (a ZAP handler, pyzmq's
``ThreadAuthenticator``), so knowing the server's public key alone is not enough. Refused
handshakes are counted (the server socket's monitor) for ``/metrics``.

Imports pyzmq only (the light client uses it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
import threading
import time

import zmq
import zmq.auth.thread
from zmq.utils import z85

logger = logging.getLogger(__name__)

API_KEY_ENV = "TILECAST_API_KEY"
"""Environment variable the server and the clients read the key from when none is passed."""
HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
"""Socket monitor events of a refused handshake (wrong key, no key, or a key the server lacks)."""


def api_key_from_env(api_key: str | None) -> str | None:
    """``api_key`` if given, else ``$TILECAST_API_KEY`` (None when neither is set or it is empty)."""
    return api_key if api_key is not None else (os.environ.get(API_KEY_ENV) or None)


@dataclasses.dataclass(frozen=True, repr=False)
class CurveKeys:
    """Both CURVE key pairs of one API key (Z85 text, as libzmq takes them)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def from_api_key(cls, api_key: str) -> "CurveKeys":
        if not api_key:
            raise ValueError("the API key must not be empty")

        def pair(role: bytes) -> tuple[bytes, bytes]:
            seed = hashlib.blake2b(api_key.encode(), digest_size=32, person=b"tilecast-" + role).digest()
            secret = z85.encode(seed)
            return zmq.curve_public(secret), secret

        server_public, server_secret = pair(b"server")
        client_public, client_secret = pair(b"client")
        return cls(server_public, server_secret, client_public, client_secret)

    def secure_server(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before ``bind``) a CURVE server."""
        sock.curve_server = True
        sock.curve_publickey = self.server_public
        sock.curve_secretkey = self.server_secret

    def secure_client(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before ``connect``) a CURVE client of this key's server."""
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.client_public
        sock.curve_secretkey = self.client_secret


class _KeyCheck:
    """ZAP credentials provider: the one client public key of the API key, nothing else."""

    def __init__(self, client_public: bytes) -> None:
        self.client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        """``key``: the peer's public key, Z85 text (pyzmq encodes it before calling)."""
        return hmac.compare_digest(key, self.client_public)  # a refusal: HANDSHAKE_FAILED_AUTH on the monitor


ZAP_RELEASE_S = 5.0
"""How long ``ServerAuth.start`` waits for the ZAP endpoint a just-stopped server still holds."""


class ServerAuth:
    """The server side: ZAP handler plus the handshake-failure counter of one bound socket.

    ``start()`` before binding the socket it protects; ``watch(sock)`` returns the monitor socket to
    poll (in the socket's own thread) and ``count(monitor)`` drains it; ``stop()`` at exit.
    """

    def __init__(self, api_key: str, context: zmq.Context) -> None:
        self.keys = CurveKeys.from_api_key(api_key)
        self._context = context
        self._check = _KeyCheck(self.keys.client_public)
        self._authenticator: zmq.auth.thread.ThreadAuthenticator | None = None
        self._lock = threading.Lock()
        self.refused_handshakes = 0
        """Connections refused during the handshake (no key, a wrong key): what ``/metrics`` reports."""

    def start(self) -> None:
        """Start the ZAP handler (one per context: it binds ``inproc://zeromq.zap.01``). A keyed server
        stopped just before in this process may still hold that name: libzmq releases a closed
        socket's endpoint on its reaper thread, a moment after ``close``; wait up to ``ZAP_RELEASE_S``."""
        deadline = time.monotonic() + ZAP_RELEASE_S
        while True:
            authenticator = zmq.auth.thread.ThreadAuthenticator(self._context, log=logger)
            try:
                authenticator.start()
                break
            except zmq.ZMQError as exc:
                if getattr(authenticator, "zap_socket", None) is not None:
                    authenticator.zap_socket.close(linger=0)
                if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        self._authenticator = authenticator
        authenticator.configure_curve_callback(domain="*", credentials_provider=self._check)

    def secure(self, sock: zmq.Socket) -> zmq.Socket:
        """Make ``sock`` a CURVE server and return the monitor socket that reports refused handshakes."""
        self.keys.secure_server(sock)
        return sock.get_monitor_socket(HANDSHAKE_FAILURES)

    def count(self, monitor: zmq.Socket) -> None:
        """Drain ``monitor``'s events into ``refused_handshakes`` (the socket's own thread calls this)."""
        while True:
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) == 2:  # event frame + endpoint frame
                with self._lock:
                    self.refused_handshakes += 1

    def stop(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
