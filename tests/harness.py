"""Test helpers for running pipelines and servers: one module, two entry points.

- ``make_context``: a ``RankContext`` built by hand (what ``start_rank`` builds on a rank), its
  settings a real ``ServeConfig``, for tests that load a pipeline without starting ranks.
- ``start_server`` and friends: a real ``tilecast serve`` (torchrun ranks) for a test, and make sure
  nothing outlives it. The server binds ports the OS picks (``--port 0``, and ``--http-port 0`` with
  ``http=True``) and reports them in its ready file, so no test ever races another process for a
  port. The ready file's path, unique per server, is also what finds the server's processes (its
  command line).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tilecast.client import Client, read_ready_file


def tiny_families() -> dict[str, type]:
    """Built-in name → class of every diffusers family with a tiny checkpoint, read from the registry:
    a family declared there is tested by the family tests without editing them."""
    from tilecast.runtime.models.families.common import DiffusersBatchPipeline
    from tilecast.runtime.registry import pipelines

    return {
        cls.builtin_name: cls
        for cls in pipelines()
        if issubclass(cls, DiffusersBatchPipeline) and cls.checkpoint is not None
    }


def make_context(
    output_dir: str | Path = ".",
    *,
    rank: int = 0,
    world_size: int = 1,
    device: Any = "cpu",
    cpu_group: Any = None,
    device_group: Any = None,
    groups: Any = None,
    cache_dir: str | Path | None = None,
    settings: Any = None,
    **fields: Any,
):
    """A ``RankContext`` for rank ``rank`` of ``world_size`` on ``device`` (text or ``torch.device``).

    Its settings are ``settings`` (a ``ServeConfig``), or a ``ServeConfig`` of ``fields`` (its field
    names: ``dtype="bfloat16"``, ``vae={"fast_decode": False}``, ``compile=True``, ...) on ``device``'s
    type with ``num_gpus=world_size``: the same checks as the command line. ``cache_dir``: where
    built-in tiny checkpoints are generated. Other keywords of ``RankContext`` (``heartbeat``,
    ``on_progress``, ``flat_output``, ``plan``) may be set on the result."""
    import torch

    from tilecast.runtime.config import ServeConfig
    from tilecast.runtime.pipeline import RankContext

    device = torch.device(device)
    if settings is None:
        settings = ServeConfig(**{"device": device.type, "num_gpus": world_size, **fields})
    elif fields:
        raise TypeError(f"give either settings or ServeConfig fields, not both ({', '.join(fields)})")
    return RankContext(
        rank=rank,
        world_size=world_size,
        device=device,
        cpu_group=cpu_group,
        device_group=device_group,
        groups=groups,
        output_dir=Path(output_dir),
        settings=settings,
        cache_dir=Path(cache_dir) if cache_dir is not None else None,
    )


def processes_with(marker: str) -> list[int]:
    """Pids whose command line contains ``marker`` (a server's unique ``--ready-file`` path)."""
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

    def __init__(self, *args: str, http: bool = False, env: dict | None = None, ready_timeout: float = 120.0):
        self.workdir = tempfile.mkdtemp(prefix="tilecast-serve-")
        self.ready_file = os.path.join(self.workdir, "ready.json")
        self.marker = self.ready_file
        self.log_file = open(os.path.join(self.workdir, "serve.log"), "wb")
        command = [sys.executable, "-m", "tilecast", "serve", *args, "--port", "0", "--ready-file", self.ready_file]
        if http:
            command += ["--http-port", "0"]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(command, stdout=self.log_file, stderr=subprocess.STDOUT, env=full_env)
        try:
            ready = self._wait_ready_file(ready_timeout)
            self.endpoint, self.http_url, self.pid = ready.endpoint, ready.http_url, ready.pid
            """The bound ZeroMQ endpoint, the HTTP base URL (``http=True``) and rank 0's pid."""
            with Client(self.endpoint) as client:
                client.wait_ready(10)
        except BaseException as error:
            self.stop()
            raise AssertionError(f"server did not come up:\n{self.log()}") from error

    def _wait_ready_file(self, timeout: float):
        """The ready file's contents; fails at once if the server exits first."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return read_ready_file(self.ready_file, timeout=0.5)
            except TimeoutError:
                if self.proc.poll() is not None:
                    raise AssertionError(f"the server exited with {self.proc.returncode} before it was ready") from None
                if time.monotonic() >= deadline:
                    raise

    def client(self, **kwargs) -> Client:
        return Client(self.endpoint, **kwargs)

    def log(self) -> str:
        self.log_file.flush()
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
