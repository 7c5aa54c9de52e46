"""The ready file: how a supervisor learns where a server listens without racing for a port.

``tilecast serve --port 0 [--http-port 0] --ready-file F`` binds ports the OS picks; once both
sockets are bound, rank 0 writes ``F`` (JSON, replaced atomically: a temp file in the same
directory, then ``rename``) and prints one line on stdout::

    tilecast ready: endpoint=tcp://127.0.0.1:40123 http=http://127.0.0.1:40124 pid=5678

A client reads the file with ``read_ready_file(path, timeout)`` (``tilecast.client`` re-exports
it), which waits until the file names a live process. Rank 0 removes the file when it stops.

Imports nothing beyond the standard library (the light client uses it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReadyInfo:
    """What a serving rank 0 wrote into its ready file."""

    endpoint: str
    """The bound ZeroMQ endpoint, connectable from this machine (``tcp://127.0.0.1:PORT``)."""
    http_url: str | None
    """The HTTP front end's base URL (``--http-port``), else None."""
    pid: int
    """Rank 0's process id."""

    def line(self) -> str:
        """The ready line printed on stdout."""
        return f"tilecast ready: endpoint={self.endpoint} http={self.http_url or 'off'} pid={self.pid}"


def write_ready_file(path: Path, info: ReadyInfo) -> None:
    """Write ``info`` to ``path`` atomically (readers never see a partial file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(dataclasses.asdict(info), handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def remove_ready_file(path: Path | None, pid: int) -> None:
    """Remove ``path`` if it is still this process's (best effort, at exit)."""
    if path is None:
        return
    try:
        if _parse(Path(path).read_text()).pid == pid:
            Path(path).unlink()
    except (OSError, ValueError):
        pass


def _parse(text: str) -> ReadyInfo:
    data = json.loads(text)
    if not isinstance(data, dict) or not isinstance(data.get("endpoint"), str) or not isinstance(data.get("pid"), int):
        raise ValueError(f"not a tilecast ready file: {text[:200]!r}")
    http_url = data.get("http_url")
    return ReadyInfo(
        endpoint=data["endpoint"], http_url=http_url if isinstance(http_url, str) else None, pid=data["pid"]
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_ready_file(
    path: str | os.PathLike, timeout: float = 60.0, *, poll_s: float = 0.05, server: subprocess.Popen | None = None
) -> ReadyInfo:
    """Wait up to ``timeout`` seconds for the server's ready file and return what it says.

    A file left behind by a process that is gone is ignored (waited past), so a stale file from an
    earlier run is never taken for a server. Raises ``TimeoutError`` naming the path. A supervisor
    that started the server passes its process as ``server``: if it exits before it is ready, the
    wait stops at once with a ``RuntimeError`` naming its exit code.
    """
    path = Path(path)
    deadline = time.monotonic() + timeout
    problem = "it does not exist"
    while True:
        try:
            info = _parse(path.read_text())
            if _alive(info.pid):
                return info
            problem = f"it names pid {info.pid}, which is not running"
        except FileNotFoundError:
            problem = "it does not exist"
        except (OSError, ValueError) as exc:
            problem = f"it is unreadable ({exc})"
        if server is not None and server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode} before it was ready")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no server ready within {timeout:.1f} s: ready file {path}: {problem}")
        time.sleep(poll_s)


def connectable(endpoint: str) -> str:
    """A bound ZeroMQ endpoint as something a local client can connect to (wildcards -> loopback)."""
    for wildcard, loopback in (
        ("tcp://0.0.0.0:", "tcp://127.0.0.1:"),
        ("tcp://*:", "tcp://127.0.0.1:"),
        ("tcp://[::]:", "tcp://[::1]:"),
    ):
        if endpoint.startswith(wildcard):
            return loopback + endpoint[len(wildcard) :]
    return endpoint
