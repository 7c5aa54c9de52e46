"""Waking a thread that blocks in a ZeroMQ poll, from any other thread.

The socket threads (the server's ROUTER thread, the client's I/O thread) take work from a
``queue.Queue`` but sleep in ``zmq.Poller.poll``, which a queue cannot interrupt. ``Wakeup`` is
an inproc PUSH/PULL pair: another thread queues its work, then ``wake()``; the socket thread
polls ``pull`` with its own sockets and ``drain()``s it before handling the queue.

``PollingThread`` is that loop for the threads that own their sockets outright (the server's
ROUTER thread, the replica hub and links): poll, hand each readable socket to its handler, drain
the wake-ups, send what is queued; ``stop()`` wakes it to finish.
"""

from __future__ import annotations

import queue
import threading
import uuid
from typing import Callable

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


class PollingThread(threading.Thread):
    """A daemon thread that owns ZeroMQ sockets and serves them until ``stop()``.

    Other threads ``_queue(*item)`` what to send; the thread calls ``_send_now(*item)`` for each,
    every turn and once more after ``stop()``. A subclass sets ``_wakeup`` (a ``Wakeup``) in its
    ``__init__`` and implements ``_handlers`` (each socket to poll and what drains it),
    ``_send_now``, ``_close`` (its sockets, in ``run``'s ``finally``) and ``_failed`` (log an
    exception that ended the loop).
    """

    _wakeup: Wakeup

    def __init__(self, *, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self._halt = threading.Event()
        self._outbox: queue.Queue[tuple] = queue.Queue()

    def _queue(self, *item) -> None:
        """Have the thread call ``_send_now(*item)`` (thread-safe)."""
        self._outbox.put(item)
        self._wakeup.wake()

    def _handlers(self) -> dict[zmq.Socket, Callable[[], None]]:
        raise NotImplementedError

    def _send_now(self, *item) -> None:
        raise NotImplementedError

    def _drain_outbound(self) -> None:
        while True:
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                return
            self._send_now(*item)

    def _close(self) -> None:
        raise NotImplementedError

    def _failed(self, exc: BaseException) -> None:
        """The loop raised ``exc`` (called inside the ``except``: ``logger.exception`` logs it); the
        thread then closes its sockets and ends."""
        raise NotImplementedError

    def stop(self, timeout: float = 2.0) -> None:
        self._halt.set()
        try:
            self._wakeup.wake()
        except zmq.ZMQError:  # the thread already closed its sockets
            pass
        self.join(timeout)

    def run(self) -> None:
        handlers = self._handlers()
        poller = zmq.Poller()
        for sock in handlers:
            poller.register(sock, zmq.POLLIN)
        poller.register(self._wakeup.pull, zmq.POLLIN)
        try:
            while not self._halt.is_set():
                events = dict(poller.poll(500))
                for sock, drain in handlers.items():
                    if sock in events:
                        drain()
                if self._wakeup.pull in events:
                    self._wakeup.drain()
                self._drain_outbound()
            self._drain_outbound()
        except BaseException as exc:  # noqa: BLE001 - the subclass logs it and says who notices
            self._failed(exc)
        finally:
            self._close()
            self._wakeup.close()
