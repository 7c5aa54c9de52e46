"""Waking a thread that blocks in a ZeroMQ poll, from any other thread.

The socket threads (the server's ROUTER thread, the client's I/O thread) take work from a
``queue.Queue`` but sleep in ``zmq.Poller.poll``, which a queue cannot interrupt. ``Wakeup`` is
an inproc PUSH/PULL pair: another thread queues its work, then ``wake()``; the socket thread
polls ``pull`` with its own sockets and ``drain()``s it before handling the queue.
"""

from __future__ import annotations

import threading
import uuid

import zmq


class Wakeup:
    def __init__(self, context: zmq.Context, name: str) -> None:
        endpoint = f"inproc://tilecast-{name}-{uuid.uuid4().hex}"
        self.pull = context.socket(zmq.PULL)
        """Poll this for ``POLLIN`` in the socket thread."""
        self.pull.bind(endpoint)
        self._push = context.socket(zmq.PUSH)
        self._push.connect(endpoint)
        self._lock = threading.Lock()  # ZeroMQ sockets are not thread-safe; wakers may be many

    def wake(self) -> None:
        """Interrupt the poll (thread-safe). A full pipe already holds a pending wake-up."""
        with self._lock:
            try:
                self._push.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass

    def drain(self) -> None:
        """Consume every pending wake-up (socket thread only)."""
        while True:
            try:
                self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def close(self) -> None:
        with self._lock:
            self._push.close(linger=0)
        self.pull.close(linger=0)
