"""Start a real ``tilecast serve`` (torchrun ranks) for a test, and make sure nothing outlives it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tilecast.client import Client


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def processes_with(marker: str) -> list[int]:
    """Pids whose command line contains ``marker`` (a unique ``--port N`` identifies one server)."""
    pids = []
    needle = marker.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if needle in cmdline and b"tilecast" in cmdline:
            pids.append(int(entry.name))
    return pids


def rank_pid(marker: str, rank: int) -> int | None:
    """The pid of rank ``rank`` of the server identified by ``marker``."""
    for pid in processes_with(marker):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"TORCHELASTIC_RUN_ID" in b" ".join(environ):
            return pid
    return None


class ServerProcess:
    """``tilecast serve`` in a subprocess; ``stop()`` leaves no process behind."""

    def __init__(self, *args: str, port: int | None = None, env: dict | None = None, ready_timeout: float = 120.0):
        self.port = port or free_port()
        self.marker = f"--port {self.port}"
        self.log_file = tempfile.NamedTemporaryFile(prefix="tilecast-serve-", suffix=".log", delete=False)
        command = [sys.executable, "-m", "tilecast", "serve", *args, "--port", str(self.port)]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(command, stdout=self.log_file, stderr=subprocess.STDOUT, env=full_env)
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        try:
            with Client(self.endpoint) as client:
                client.wait_ready(ready_timeout)
        except BaseException:
            self.stop()
            raise AssertionError(f"server did not come up:\n{self.log()}")

    def client(self, **kwargs) -> Client:
        return Client(self.endpoint, **kwargs)

    def log(self) -> str:
        return Path(self.log_file.name).read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def leftovers(self) -> list[int]:
        return processes_with(self.marker)

    def leftovers_after(self, timeout: float, poll_s: float = 0.2) -> list[int]:
        """The server's processes still alive after waiting up to ``timeout`` for them to go."""
        deadline = time.monotonic() + timeout
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(poll_s)
        return self.leftovers()

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        for pid in self.leftovers_after(5, poll_s=0.1):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
