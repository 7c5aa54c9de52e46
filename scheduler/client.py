"""``Client`` (threads) and ``AsyncClient`` (asyncio) for a tilecast server.

Both share one base: request building, reply decoding, errors and the dead-server rule. A
blocking wait that hears nothing from the server for ``heartbeat_s`` asks for ``health``; no
answer within ``dead_after_s`` raises ``ServerDeadError`` instead of waiting forever.

``api_key`` (default ``$TILECAST_API_KEY``) authenticates to a server started with ``--api-key``
(CURVE, ``scheduler/auth.py``); a refused handshake raises ``AuthenticationError`` at once.

Imports msgspec and pyzmq only (torch lazily, for ``JobResult.tensor``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import itertools
import os
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from tilecast.scheduler import protocol as P
from tilecast.scheduler.auth import HANDSHAKE_FAILURES, CurveKeys, api_key_from_env
from tilecast.scheduler.ready import ReadyInfo, read_ready_file  # noqa: F401 - re-exported
from tilecast.scheduler.wakeup import Wakeup

DEFAULT_ENDPOINT = "tcp://127.0.0.1:30010"


class TilecastError(Exception):
    """Base of every client error."""


class ServerError(TilecastError):
    """The server refused a request (``code``: bad_request, overloaded, not_found, server_dead, stopping)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


class ServerDeadError(TilecastError):
    """The server stopped answering, or reported that a rank died."""


class AuthenticationError(TilecastError):
    """The server refused this client's API key (or the lack of one)."""


class JobFailedError(TilecastError):
    """The job ended failed or cancelled."""

    def __init__(self, job: P.JobInfo) -> None:
        super().__init__(f"job {job.job_id} {job.state}: {job.error}")
        self.job = job


@dataclasses.dataclass
class OutputItem:
    name: str
    kind: str
    mime: str
    data: bytes | None
    """The file bytes or raw tensor bytes (None when only the server-side path was asked for)."""
    path: str | None
    meta: P.OutputMeta

    def save(self, directory: str | os.PathLike) -> Path:
        if self.data is None:
            raise ValueError(f"{self.name}: only the server-side path {self.path} was returned")
        target = Path(directory) / self.name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(self.data)
        return target


@dataclasses.dataclass
class JobResult:
    job: P.JobInfo
    outputs: list[OutputItem]
    info: dict[str, Any]

    @property
    def files(self) -> list[OutputItem]:
        return [item for item in self.outputs if item.kind == "file"]

    def tensor(self, name: str):
        for item in self.outputs:
            if item.kind == "tensor" and item.name == name:
                return P.frame_to_tensor(item.meta, item.data)
        raise KeyError(f"no tensor output {name!r}")


def _file_bytes(value: Any, field: str) -> bytes:
    """An upload's bytes: bytes as they are, a local path read, a PIL image encoded as PNG."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, (str, os.PathLike)):
        return Path(value).read_bytes()
    if hasattr(value, "save") and hasattr(value, "mode"):  # a PIL.Image (Pillow is imported only by the caller)
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return buffer.getvalue()
    raise TypeError(f"{field} must be bytes, a local path or a PIL image, got {type(value).__name__}")


def _split_uploads(fields: dict[str, Any]) -> tuple[dict[str, Any], list[str], list[bytes]]:
    """Request fields -> (params, upload names, upload payloads): a ``video`` given as bytes or a
    local path is uploaded; ``image`` (bytes, a local path, a PIL image, or a list of them) becomes
    uploads ``image.0``, ``image.1``, ... in order."""
    params, names, payloads = {}, [], []
    for key, value in fields.items():
        if key == "video" and value is not None:
            names.append("video")
            payloads.append(_file_bytes(value, "video"))
        elif key == "image" and value is not None:
            images = list(value) if isinstance(value, (list, tuple)) else [value]
            for index, image in enumerate(images):
                names.append(f"image.{index}")
                payloads.append(_file_bytes(image, f"image[{index}]" if len(images) > 1 else "image"))
        else:
            params[key] = str(value) if isinstance(value, os.PathLike) else value
            _check_wire_value(key, params[key])
    return params, names, payloads


def _check_wire_value(name: str, value: Any) -> None:
    """``ValueError`` naming a field the wire cannot carry: an integer outside 64 bits, text that is
    not UTF-8 (a lone surrogate). Checked here so the caller gets the field's name, not msgspec's
    ``OverflowError`` from deep inside the send."""
    if isinstance(value, bool):
        return
    if isinstance(value, int) and not -(2**63) <= value < 2**64:
        raise ValueError(f"{name} = {value} does not fit in 64 bits")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"{name} is not valid UTF-8 text ({exc.reason} at character {exc.start})") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_wire_value(f"{name}.{key}", item)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_wire_value(f"{name}[{index}]", item)


LARGE_UPLOAD_BYTES = 8 * 2**20
"""Uploads at least this large are checked against the server's message limit before they are sent."""


def _result_from(reply: P.ResultReply, payloads: list) -> JobResult:
    outputs, frames = [], iter(payloads)
    for meta in reply.outputs:
        data = None if meta.path is not None else bytes(next(frames))
        outputs.append(OutputItem(name=meta.name, kind=meta.kind, mime=meta.mime, data=data, path=meta.path, meta=meta))
    return JobResult(job=reply.job, outputs=outputs, info=dict(reply.info))


def _too_large(payloads: list[bytes], limit: int) -> None:
    size = sum(len(p) for p in payloads)
    if limit and size + 64 * 1024 > limit:
        raise ValueError(
            f"the upload is {size} bytes, over the server's message limit of {limit / 2**20:g} MiB (--max-message-mb)"
        )


def _check(msg) -> Any:
    if isinstance(msg, P.ErrorReply):
        if msg.code == "server_dead":
            raise ServerDeadError(msg.message)
        raise ServerError(msg.code, msg.message)
    return msg


def _finished(result: JobResult) -> JobResult:
    if result.job.state != "completed":
        if result.job.error and result.job.error.startswith("server dead"):
            raise ServerDeadError(result.job.error)
        raise JobFailedError(result.job)
    return result


class _Base:
    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        *,
        timeout: float = 30.0,
        heartbeat_s: float = 2.0,
        dead_after_s: float = 10.0,
        model: str | None = None,
        api_key: str | None = None,
    ) -> None:
        self.endpoint, self.timeout, self.heartbeat_s, self.dead_after_s = endpoint, timeout, heartbeat_s, dead_after_s
        self.model = model
        key = api_key_from_env(api_key)
        self._keys = CurveKeys.from_api_key(key) if key else None
        self._auth_error: AuthenticationError | None = None
        self._message_limit: int | None = None
        """The server's ``max_message_bytes`` (asked once, before the first large upload)."""
        self._ids = itertools.count(1)
        self._ids_lock = threading.Lock()

    def _next_id(self) -> int:
        with self._ids_lock:
            return next(self._ids)

    def _wait_step(self, deadline: float | None, wait_long: bool) -> float:
        """How long to wait for a reply before checking on the server."""
        step = self.heartbeat_s if wait_long else self.dead_after_s
        return step if deadline is None else min(step, max(0.0, deadline - time.monotonic()))

    def _after_silence(self, deadline: float | None, timeout: float | None, step: float, wait_long: bool) -> None:
        """A wait of ``step`` heard nothing: raise, or return to have the caller probe ``health``."""
        if self._auth_error is not None:
            raise self._auth_error
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"no reply from {self.endpoint} within {timeout:.1f} s") from None
        if not wait_long:
            raise ServerDeadError(f"no reply from {self.endpoint} within {step:.1f} s") from None

    def _dead(self) -> ServerDeadError:
        return ServerDeadError(
            f"{self.endpoint} stopped answering: no reply to a health check within"
            f" {self.dead_after_s:.1f} s while waiting"
        )

    def _refused(self) -> AuthenticationError:
        """Record (and return) a refused handshake; every pending call fails with it."""
        has_key = "this client's API key" if self._keys is not None else "a client without an API key"
        self._auth_error = AuthenticationError(
            f"{self.endpoint} refused {has_key}: pass the server's --api-key (api_key=... or $TILECAST_API_KEY)"
        )
        for future in list(self._pending.values()):
            self._fail(future, self._auth_error)
        return self._auth_error

    def _resolve(self, frames: list) -> None:
        """Hand a reply to the call waiting for its request id (undecodable replies are dropped)."""
        try:
            msg, payloads = P.decode(frames, allowed=P.REPLY_TYPES)
        except P.WireError:
            return
        future = self._pending.pop(msg.req_id, None)
        if future is not None and not future.done():
            future.set_result((msg, payloads))

    def _socket(self, context: zmq.Context):
        """The DEALER socket (CURVE client with a key) and a monitor of its refused handshakes."""
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
        if self._keys is not None:
            self._keys.secure_client(sock)
        monitor = sock.get_monitor_socket(HANDSHAKE_FAILURES)
        sock.connect(self.endpoint)
        return sock, monitor


class Client(_Base):
    """Blocking client, safe to share between threads."""

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, **kwargs) -> None:
        super().__init__(endpoint, **kwargs)
        self._context = zmq.Context.instance()
        self._pending: dict[int, Future] = {}
        self._outbox: "queue.Queue[list]" = queue.Queue()
        self._wakeup = Wakeup(self._context, "client")
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._io, name="tilecast-client", daemon=True)
        self._thread.start()

    # -- io thread
    def _io(self) -> None:
        sock, monitor = self._socket(self._context)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        poller.register(self._wakeup.pull, zmq.POLLIN)
        # A request no peer could take yet: sends never block this thread (after a refused handshake
        # libzmq drops the connection for good, and a blocking send would never return).
        unsent = None
        try:
            while not self._closed.is_set():
                events = dict(poller.poll(200))
                if self._wakeup.pull in events:
                    self._wakeup.drain()
                if monitor in events:
                    monitor.recv_multipart()
                    self._refused()
                while True:
                    try:
                        unsent = unsent or self._outbox.get_nowait()
                        sock.send_multipart(unsent, flags=zmq.NOBLOCK, copy=False)
                        unsent = None
                    except (queue.Empty, zmq.Again):
                        break
                if sock in events:
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._resolve(frames)
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)

    @staticmethod
    def _fail(future: Future, error: Exception) -> None:
        if not future.done():
            future.set_exception(error)

    # -- calls
    def _call(self, frames_for, timeout: float | None, *, wait_long: bool = False):
        if self._auth_error is not None:
            raise self._auth_error
        req_id = self._next_id()
        future: Future = Future()
        self._pending[req_id] = future
        self._outbox.put(frames_for(req_id))
        self._wakeup.wake()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                step = self._wait_step(deadline, wait_long)
                try:
                    return future.result(timeout=step)
                except FutureTimeout:
                    self._after_silence(deadline, timeout, step, wait_long)
                    self._probe()
        finally:
            self._pending.pop(req_id, None)

    def _probe(self) -> None:
        """A long wait heard nothing: ``ServerDeadError`` unless the server answers ``health``."""
        try:
            self.health()
        except TimeoutError:
            raise self._dead() from None

    def _check_size(self, payloads: list[bytes]) -> None:
        if sum(len(p) for p in payloads) >= LARGE_UPLOAD_BYTES:
            if self._message_limit is None:
                self._message_limit = self.health().max_message_bytes
            _too_large(payloads, self._message_limit)

    def submit(self, **fields) -> str:
        """Queue a request; returns its job id."""
        params, names, payloads = _split_uploads(fields)
        self._check_size(payloads)
        request = lambda rid: P.encode(
            P.SubmitRequest(req_id=rid, params=params, uploads=names, model=self.model), *payloads
        )
        msg, _ = self._call(request, self.timeout)
        return _check(msg).job_id

    def status(self, job_id: str) -> P.JobInfo:
        msg, _ = self._call(lambda rid: P.encode(P.StatusRequest(req_id=rid, job_id=job_id)), self.timeout)
        return _check(msg)

    def result(
        self, job_id: str, *, wait: bool = True, timeout: float | None = None, as_paths: bool = False
    ) -> JobResult:
        """The job's result; with ``wait`` block until it is terminal (``TimeoutError`` after ``timeout``)."""
        request = lambda rid: P.encode(P.ResultRequest(req_id=rid, job_id=job_id, wait=wait, as_paths=as_paths))
        msg, payloads = self._call(request, timeout if wait else self.timeout, wait_long=wait)
        return _result_from(_check(msg), payloads)

    def cancel(self, job_id: str) -> P.JobInfo:
        """Cancel a queued job, or stop a running one at its next step (it then writes no output)."""
        msg, _ = self._call(lambda rid: P.encode(P.CancelRequest(req_id=rid, job_id=job_id)), self.timeout)
        return _check(msg)

    def delete(self, job_id: str) -> P.JobInfo:
        """Forget a job: cancel it if it has not finished, delete its output files. Returns its last state."""
        msg, _ = self._call(lambda rid: P.encode(P.DeleteRequest(req_id=rid, job_id=job_id)), self.timeout)
        return _check(msg)

    def health(self, timeout: float | None = None) -> P.HealthReply:
        msg, _ = self._call(lambda rid: P.encode(P.HealthRequest(req_id=rid)), timeout or self.dead_after_s)
        return _check(msg)

    def stats(self) -> dict:
        msg, _ = self._call(lambda rid: P.encode(P.StatsRequest(req_id=rid)), self.timeout)
        return _check(msg).stats

    def set_lora(self, nickname: str, path: str | None = None, strength: float | None = None) -> dict:
        """Load (with ``path``, a server-side file under ``--lora-dir``) and activate an adapter,
        merged; returns ``list_loras()``. Requests without ``lora`` use it from then on."""
        return self._lora("set", nickname=nickname, path=path, strength=strength)

    def merge_lora_weights(self, strength: float | None = None) -> dict:
        return self._lora("merge", strength=strength)

    def unmerge_lora_weights(self) -> dict:
        """Requests without ``lora`` run on the base model again."""
        return self._lora("unmerge")

    def list_loras(self) -> dict:
        """``{"loaded_adapters": [{nickname, path}], "active": {"transformer": [{nickname, path, merged, strength}]}}``."""
        return self._lora("list")

    def _lora(self, op: str, **fields) -> dict:
        msg, _ = self._call(lambda rid: P.encode(P.LoraRequest(req_id=rid, op=op, **fields)), self.timeout)
        return _check(msg).loras

    def shutdown(self) -> P.HealthReply:
        """Ask the server to stop (needs the API key, or a connection from the server's machine)."""
        msg, _ = self._call(lambda rid: P.encode(P.ShutdownRequest(req_id=rid)), self.timeout)
        return _check(msg)

    def generate(self, *, timeout: float | None = None, return_paths: bool = False, **fields) -> JobResult:
        """Submit and wait; raises ``JobFailedError`` unless the job completed."""
        job_id = self.submit(**fields)
        return _finished(self.result(job_id, wait=True, timeout=timeout, as_paths=return_paths))

    def wait_ready(self, timeout: float = 60.0) -> P.HealthReply:
        """Poll ``health`` until the server answers (start-up)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.health(timeout=1.0)
            except (ServerDeadError, TimeoutError):
                if time.monotonic() >= deadline:
                    raise

    def close(self) -> None:
        self._closed.set()
        self._thread.join(2.0)
        self._wakeup.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient(_Base):
    """asyncio client; one instance per event loop."""

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, **kwargs) -> None:
        super().__init__(endpoint, **kwargs)
        self._context = zmq.asyncio.Context.instance()
        self._sock = None
        self._monitor = None
        self._pending: dict[int, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []

    async def _ensure(self) -> None:
        if self._sock is None:
            self._sock, self._monitor = self._socket(self._context)
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._read()), loop.create_task(self._watch())]

    async def _read(self) -> None:
        while True:
            self._resolve(await self._sock.recv_multipart())

    async def _watch(self) -> None:
        await self._monitor.recv_multipart()
        self._refused()

    @staticmethod
    def _fail(future: asyncio.Future, error: Exception) -> None:
        if not future.done():
            future.set_exception(error)

    async def _call(self, frames_for, timeout: float | None, *, wait_long: bool = False):
        if self._auth_error is not None:
            raise self._auth_error
        await self._ensure()
        req_id = self._next_id()
        future = asyncio.get_running_loop().create_future()
        self._pending[req_id] = future
        # Sent beside the wait, not before it: after a refused handshake no peer ever takes it, and
        # the refusal (``_watch``) or the deadline must still end the call.
        send = asyncio.ensure_future(self._sock.send_multipart(frames_for(req_id)))
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                step = self._wait_step(deadline, wait_long)
                try:
                    return await asyncio.wait_for(asyncio.shield(future), step)
                except asyncio.TimeoutError:
                    self._after_silence(deadline, timeout, step, wait_long)
                    await self._probe()
        finally:
            self._pending.pop(req_id, None)
            send.cancel()

    async def _probe(self) -> None:
        try:
            await self.health()
        except TimeoutError:
            raise self._dead() from None

    async def _check_size(self, payloads: list[bytes]) -> None:
        if sum(len(p) for p in payloads) >= LARGE_UPLOAD_BYTES:
            if self._message_limit is None:
                self._message_limit = (await self.health()).max_message_bytes
            _too_large(payloads, self._message_limit)

    async def submit(self, **fields) -> str:
        params, names, payloads = _split_uploads(fields)
        await self._check_size(payloads)
        request = lambda rid: P.encode(
            P.SubmitRequest(req_id=rid, params=params, uploads=names, model=self.model), *payloads
        )
        msg, _ = await self._call(request, self.timeout)
        return _check(msg).job_id

    async def status(self, job_id: str) -> P.JobInfo:
        msg, _ = await self._call(lambda rid: P.encode(P.StatusRequest(req_id=rid, job_id=job_id)), self.timeout)
        return _check(msg)

    async def result(
        self, job_id: str, *, wait: bool = True, timeout: float | None = None, as_paths: bool = False
    ) -> JobResult:
        request = lambda rid: P.encode(P.ResultRequest(req_id=rid, job_id=job_id, wait=wait, as_paths=as_paths))
        msg, payloads = await self._call(request, timeout if wait else self.timeout, wait_long=wait)
        return _result_from(_check(msg), payloads)

    async def cancel(self, job_id: str) -> P.JobInfo:
        msg, _ = await self._call(lambda rid: P.encode(P.CancelRequest(req_id=rid, job_id=job_id)), self.timeout)
        return _check(msg)

    async def delete(self, job_id: str) -> P.JobInfo:
        msg, _ = await self._call(lambda rid: P.encode(P.DeleteRequest(req_id=rid, job_id=job_id)), self.timeout)
        return _check(msg)

    async def health(self, timeout: float | None = None) -> P.HealthReply:
        msg, _ = await self._call(lambda rid: P.encode(P.HealthRequest(req_id=rid)), timeout or self.dead_after_s)
        return _check(msg)

    async def stats(self) -> dict:
        msg, _ = await self._call(lambda rid: P.encode(P.StatsRequest(req_id=rid)), self.timeout)
        return _check(msg).stats

    async def lora(self, op: str, **fields) -> dict:
        """``Client.set_lora`` and friends as one coroutine: ``op`` is ``set``, ``merge``, ``unmerge`` or ``list``."""
        msg, _ = await self._call(lambda rid: P.encode(P.LoraRequest(req_id=rid, op=op, **fields)), self.timeout)
        return _check(msg).loras

    async def shutdown(self) -> P.HealthReply:
        msg, _ = await self._call(lambda rid: P.encode(P.ShutdownRequest(req_id=rid)), self.timeout)
        return _check(msg)

    async def generate(self, *, timeout: float | None = None, return_paths: bool = False, **fields) -> JobResult:
        job_id = await self.submit(**fields)
        return _finished(await self.result(job_id, wait=True, timeout=timeout, as_paths=return_paths))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._sock is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._sock.close(linger=0)
            self._sock = self._monitor = None

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
