"""Test helpers for running pipelines, servers and commands, and for driving servers: one module.

- ``make_context``: a ``RankContext`` built by hand (what ``start_rank`` builds on a rank), its
  settings a real ``ServeConfig``, for tests that load a pipeline without starting ranks.
- ``in_process_server``: a one-rank ``InProcessServer`` that answers, its loop checked at the end.
- ``ServerProcess`` and friends: a real ``tilecast serve`` (torchrun ranks) for a test, and make sure
  nothing outlives it. The server binds ports the OS picks (``--port 0``, and ``--http-port 0`` with
  ``http=True``) and reports them in its ready file, so no test ever races another process for a
  port. The ready file's path, unique per server, is also what finds the server's processes (its
  command line).
- Command lines: ``serve_args`` (``ServerProcess(*serve_args(model, out, num_gpus=2, ...))``),
  ``cli_flags`` (any command's flags from keywords), ``run_generate``, ``k6sr_generate_args`` with ``saved_frames``;
  ``record_rank_starts`` runs the CLI without ranks; ``flux_step_bench`` the step bench on the CPU.
- Waiting and talking to a server: ``wait_until`` (poll a condition, fail on a timeout),
  ``wait_for_state``, ``collect_outcomes`` (every job awaited from a thread of its own; after a
  rank's ``kill -9``: ``outcomes_after_kill_9``), ``plain_socket`` (a raw ZeroMQ socket, no client
  library), ``send_chunks`` (a raw HTTP body).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import zmq

from tilecast.client import Client, JobFailedError, ServerDeadError, read_ready_file
from tilecast.launcher.torchrun import terminate


def tiny_families(*, variants: bool = True) -> dict[str, type]:
    """Built-in name → class of every diffusers family with a tiny checkpoint, read from the registry:
    a family declared there is tested by the family tests without editing them. ``variants=False``
    leaves out the declarations marked ``variant`` (Z-Image next to Z-Image-Turbo): a variant runs its
    family's transformer unchanged, so tests of the transformer alone (``--compile``, sequence
    parallelism) would only repeat themselves on it."""
    from tilecast.runtime.models.families.common import DiffusersBatchPipeline
    from tilecast.runtime.registry import pipelines

    return {
        cls.builtin_name: cls
        for cls in pipelines()
        if issubclass(cls, DiffusersBatchPipeline)
        and cls.checkpoint is not None
        and (variants or not cls.__dict__.get("variant", False))
    }


TORCHVISION_REASON = (
    "transformers 5 loads a Qwen2VLProcessor (the Qwen image-edit families' checkpoints) only with "
    "torchvision, and CI's pinned CPU torch has none that imports beside it (PyPI's wheels fail: "
    "'operator torchvision::nms does not exist'); run these tests where torchvision imports"
)
"""Why the tests of a family with ``required_modules = ("torchvision",)`` skip where it is missing."""


def skip_without_required_modules(cls) -> None:
    """Skip the calling test when ``cls`` (a pipeline class) needs a module this interpreter cannot
    import (``DiffusersBatchPipeline.required_modules``), naming the module and why it is needed."""
    import pytest

    missing = getattr(cls, "missing_modules", dict)()
    if missing:
        why = TORCHVISION_REASON if "torchvision" in missing else "needed by the family"
        pytest.skip(f"{cls.__name__} needs {', '.join(missing)} ({'; '.join(missing.values())}): {why}")


def hopper_codegen(*args: str) -> Any:
    """The JSON line ``python tests/hopper_codegen.py *args`` prints (sm_90 code compiled ahead of
    time), run in a process of its own without ``TRITON_INTERPRET``: where it is set, Triton's own
    library functions are interpreted and cannot be compiled. Asserts that the script succeeded."""
    import json

    repo = Path(__file__).resolve().parent.parent
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    script = [sys.executable, "-P", str(repo / "tests" / "hopper_codegen.py"), *args]
    done = subprocess.run(script, env=env, capture_output=True, text=True, timeout=300, cwd=repo, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


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


def cli_flags(**options: Any) -> list[str]:
    """Command-line flags from keywords, in their order: ``num_gpus=2`` gives ``--num-gpus 2`` (the
    value as text), ``save_output=True`` the bare switch ``--save-output``, ``None`` nothing."""
    flags: list[str] = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def run_generate(*, timeout: float = 200.0, **options: Any) -> subprocess.CompletedProcess:
    """``tilecast generate`` with ``cli_flags(**options)`` in a subprocess; its exit status must be 0."""
    command = [sys.executable, "-m", "tilecast", "generate", *cli_flags(**options)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


DYNAMIC_BATCHING = dict(batching_mode="dynamic", batching_max_size=4, batching_delay_ms=300.0)
"""The served tests' dynamic batching: up to 4 requests, 300 ms for the rest of a batch to arrive."""


def http_server_config(model_path: str, output_dir: str | Path, **settings: Any):
    """The ``ServeConfig`` of an in-process CPU server of ``model_path`` with the HTTP front end, both
    on OS-picked ports, writing to ``output_dir``; ``settings`` add fields (``**DYNAMIC_BATCHING``)."""
    from tilecast.runtime.config import ServeConfig

    return ServeConfig(model_path=model_path, device="cpu", port=0, http_port=0, output_dir=output_dir, **settings)


@contextlib.contextmanager
def in_process_server(config, *, ready_s: float = 60.0) -> Iterator:
    """A started ``InProcessServer`` of ``config`` that answers; its compute loop must end without error."""
    from tilecast.runtime.inproc import InProcessServer

    with InProcessServer(config) as server:
        with Client(server.endpoint) as client:
            client.wait_ready(ready_s)
        yield server
    assert server.error is None, server.error


def serve_args(
    model: str, output_dir: str | Path, *extra: str, num_gpus: int, device: str = "cpu", **options
) -> list[str]:
    """The arguments of ``tilecast serve`` for ``model`` on ``num_gpus`` ranks of ``device``, writing
    to ``output_dir``; then ``options`` as flags (``cli_flags``: ``dp_degree=2``,
    ``enable_batching_metrics=True``) and ``extra`` as given (flags no keyword can name). For
    ``ServerProcess(*serve_args(...))``, which adds the ports and the ready file."""
    flags = cli_flags(model_path=model, num_gpus=num_gpus, device=device, output_dir=output_dir, **options)
    return [*flags, *extra]


def k6sr_generate_args(video: str | Path, output_path: str | Path) -> list[str]:
    """``tilecast generate`` of the SR topology tests (no topology flags: one rank): tiny/k6sr on
    the CPU, ``video`` x2 in 2 steps with seed 42, its MP4 and raw frames (``--save-frames``) saved
    in ``output_path`` (read them with ``saved_frames``)."""
    return [
        "generate",
        *cli_flags(model_path="tiny/k6sr", device="cpu", video_path=video, sr_resolution_scale=2),
        *cli_flags(num_inference_steps=2, seed=42, save_output=True, output_path=output_path, save_frames=True),
    ]


def saved_frames(output_path: Path):
    """The one MP4 that ``generate --save-frames`` wrote in ``output_path``, and its raw uint8 frames
    (saved beside it) as int32, so differences do not wrap."""
    import numpy as np

    (path,) = output_path.glob("*.mp4")
    return path, np.load(output_path / f"{path.stem}.frames.npy").astype(np.int32)


def record_rank_starts(monkeypatch) -> list:
    """Make the CLI record the ``ServeConfig`` it would start ranks with instead of starting them;
    the list the configs go to."""
    from tilecast.launcher import cli

    started: list = []

    def run_ranks(config, _entry):
        started.append(config)
        return 0

    monkeypatch.setattr(cli, "_run_ranks", run_ranks)
    return started


def flux_step_bench(**options: Any) -> list[dict]:
    """``run_step_bench`` rows of tiny/flux as the tests run it: float32 on the CPU, no compiled
    blocks, one warm-up iteration; ``options`` (sizes, ``batch_sizes``, ``iters``, ...) add to those."""
    from tilecast.launcher.bench.step import run_step_bench

    settings = dict(device="cpu", dtype="float32", compile_blocks=False, warmup=1)
    return run_step_bench("tiny/flux", **{**settings, **options})


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
    """``tilecast serve`` in a subprocess; ``stop()`` leaves no process behind, and notes in
    ``left_behind`` what it had to kill after the launcher exited."""

    def __init__(self, *args: str, http: bool = False, env: dict | None = None, ready_timeout: float = 120.0):
        self.left_behind: list[int] = []
        """Pids ``stop()`` found alive 5 s after the launcher exited (and killed): a test of clean
        shutdown asserts this is empty."""
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
            ready = read_ready_file(self.ready_file, ready_timeout, server=self.proc)
            self.endpoint, self.http_url, self.pid = ready.endpoint, ready.http_url, ready.pid
            """The bound ZeroMQ endpoint, the HTTP base URL (``http=True``) and rank 0's pid."""
            with Client(self.endpoint) as client:
                client.wait_ready(10)
        except BaseException as error:
            self.stop()
            raise AssertionError(f"server did not come up:\n{self.log()}") from error

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
        if not terminate(self.proc, timeout):
            self.proc.kill()
            self.proc.wait(timeout=5)
        left = self.leftovers_after(5, poll_s=0.1)
        self.left_behind += left
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, *, interval: float = 0.05) -> Any:
    """Call ``predicate`` every ``interval`` s until it returns something true, and return that; fail
    the test if ``timeout`` s pass first (``what`` names the awaited event in the message)."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(interval)
    return value


def wait_for_state(client: Client, job_id: str, state: str, timeout: float = 20.0) -> None:
    """Wait until ``job_id`` is in ``state``; fail the test if it is not within ``timeout``."""
    deadline = time.monotonic() + timeout
    while (current := client.status(job_id).state) != state:
        assert time.monotonic() < deadline, f"job {job_id} still {current} after {timeout} s (waited for {state})"
        time.sleep(0.05)


def collect_outcomes(
    server: ServerProcess, job_ids: Iterable[str], timeout: float, connected: threading.Barrier | None = None
) -> dict[str, str]:
    """Wait for every job from its own thread (a client that declares the server dead after 3 s of
    silence); map job id -> outcome text: ``"<state>: <error>"``, ``"dead: ..."`` or
    ``"timeout: ..."``. With ``connected``, every thread first hears the server answer ``health``,
    then waits on the barrier."""
    outcomes: dict[str, str] = {}

    def wait(job_id: str) -> None:
        with Client(server.endpoint, heartbeat_s=1.0, dead_after_s=3.0) as client:
            try:
                if connected is not None:
                    client.health()
                    connected.wait()
                result = client.result(job_id, timeout=timeout)
                outcomes[job_id] = f"{result.job.state}: {result.job.error}"
            except (ServerDeadError, JobFailedError) as exc:
                outcomes[job_id] = f"dead: {exc}"
            except TimeoutError as exc:
                outcomes[job_id] = f"timeout: {exc}"

    threads = [threading.Thread(target=wait, args=(job_id,)) for job_id in job_ids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 10)
    return outcomes


def outcomes_after_kill_9(
    server: ServerProcess, rank: int, job_ids: Iterable[str], timeout: float
) -> tuple[dict[str, str], float]:
    """``kill -9`` rank ``rank`` of ``server`` (failing the test, with the log, if it has no such
    rank), then ``collect_outcomes`` of ``job_ids``; the outcomes, and the seconds from the kill
    until every one was known."""
    worker = rank_pid(server.marker, rank)
    assert worker is not None, server.log()
    killed_at = time.monotonic()
    os.kill(worker, signal.SIGKILL)
    outcomes = collect_outcomes(server, job_ids, timeout)
    return outcomes, time.monotonic() - killed_at


@contextlib.contextmanager
def plain_socket(
    endpoint: str, kind: int = zmq.DEALER, *, receive_timeout_ms: int | None = None
) -> Iterator[zmq.Socket]:
    """A ZeroMQ socket of ``kind`` connected to ``endpoint`` without the client library (no CURVE
    key, frames as the test writes them), closed on leaving; LINGER 0, so closing never waits.
    ``receive_timeout_ms``: a receive raises ``zmq.Again`` after that long (default: waits)."""
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if receive_timeout_ms is not None:
        sock.setsockopt(zmq.RCVTIMEO, receive_timeout_ms)
    sock.connect(endpoint)
    try:
        yield sock
    finally:
        sock.close()


def send_chunks(sock: socket.socket, chunks: Iterable[bytes], *, chunked: bool = False) -> None:
    """Send an HTTP body's ``chunks`` (each in chunked transfer encoding with ``chunked``) for as long
    as the server takes them: it may answer and close early."""
    for chunk in chunks:
        try:
            sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n" if chunked else chunk)
        except OSError:  # the server answered and closed: stop sending
            break
