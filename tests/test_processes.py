"""The server's processes and ports, for real: OS-picked ports reported through the ready file,
no orphan after a ``kill -9`` of the launcher, a launcher started with SIGINT/SIGTERM blocked (an
inherited mask) that still stops on SIGTERM and leaves no orphan, a clean stop of a one-rank server
on SIGTERM and SIGINT, and ``ServerDeadError`` (not a timeout) for a client waiting when rank 0 dies."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.harness import ServerProcess, processes_with, rank_pid, serve_args, wait_for_state
from tilecast.client import AsyncClient, Client, JobFailedError, ServerDeadError, read_ready_file
from tilecast.launcher.torchrun import STOP_SIGNALS


def _serve(tmp_path, num_gpus: int, **kwargs) -> ServerProcess:
    """The probe on ``num_gpus`` CPU ranks, declared dead after 5 s without a heartbeat; ``kwargs``
    go to ``ServerProcess`` (``http``, ``env``)."""
    return ServerProcess(*serve_args("test/allreduce", tmp_path, num_gpus=num_gpus, heartbeat_timeout_s=5), **kwargs)


def _environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode(errors="replace").split("=", 1) for entry in entries if b"=" in entry)


# -- item 6: ports the OS picks, reported by the ready file and the ready line ---------------------


def test_read_ready_file_waits_for_a_live_server_and_ignores_a_stale_file(tmp_path):
    path = tmp_path / "ready.json"
    with pytest.raises(TimeoutError, match="does not exist"):
        read_ready_file(path, timeout=0.2)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path.write_text(json.dumps({"endpoint": "tcp://127.0.0.1:5", "http_url": None, "pid": dead.pid}))
    with pytest.raises(TimeoutError, match=f"pid {dead.pid}, which is not running"):
        read_ready_file(path, timeout=0.2)
    path.write_text(json.dumps({"endpoint": "tcp://127.0.0.1:5", "http_url": "http://127.0.0.1:6", "pid": os.getpid()}))
    info = read_ready_file(path, timeout=0.2)
    assert (info.endpoint, info.http_url, info.pid) == ("tcp://127.0.0.1:5", "http://127.0.0.1:6", os.getpid())


def test_the_light_client_reads_ready_files_without_torch():
    code = "import sys, tilecast.client as c; c.read_ready_file; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-P", "-c", code], check=True, timeout=60)


@pytest.mark.timeout(90)
def test_port_0_binds_os_picked_ports_reported_in_the_ready_file_and_line(tmp_path):
    server = _serve(tmp_path, 2, http=True)
    try:
        data = json.loads(Path(server.ready_file).read_text())
        assert set(data) == {"endpoint", "http_url", "pid"}
        endpoint = re.fullmatch(r"tcp://127\.0\.0\.1:(\d+)", data["endpoint"])
        http_url = re.fullmatch(r"http://127\.0\.0\.1:(\d+)", data["http_url"])
        assert endpoint and http_url and int(endpoint[1]) > 0 and int(http_url[1]) > 0, data
        assert data["pid"] == rank_pid(server.marker, 0), "the ready file names rank 0"
        line = f"tilecast ready: endpoint={data['endpoint']} http={data['http_url']} pid={data['pid']}"
        assert line in server.log().splitlines(), server.log()
        with Client(data["endpoint"]) as client:
            assert client.generate(size=2, timeout=30).job.state == "completed"
        assert httpx.get(f"{data['http_url']}/health", timeout=10).status_code == 200
        # torchrun's own rendezvous: the agent hosts the store on a port it bound, and the ranks use it.
        rank0 = _environ(data["pid"])
        assert rank0.get("TORCHELASTIC_USE_AGENT_STORE") == "True", rank0
        agent = int(Path(f"/proc/{data['pid']}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert b"--standalone" in Path(f"/proc/{agent}/cmdline").read_bytes().split(b"\0")
    finally:
        server.stop()
    assert server.proc.returncode == 0, server.log()
    assert not Path(server.ready_file).exists(), "the ready file outlived the server"
    assert not server.left_behind


# -- item 7: no orphans -------------------------------------------------------------------------


@contextlib.contextmanager
def _stop_signals_blocked():
    """Block SIGINT/SIGTERM in this thread while the block runs: a process started inside inherits
    the mask through ``fork`` and ``exec``, as under a parent that blocked them."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("blocked", [False, True], ids=["plain", "stop-signals-blocked"])
def test_kill_9_of_the_launcher_takes_torchrun_and_every_rank_down(tmp_path, blocked):
    """Also for a launcher started with SIGINT/SIGTERM blocked: torchrun's parent-death signal is
    SIGTERM, and with the inherited mask torchrun and both ranks outlived the launcher."""
    with _stop_signals_blocked() if blocked else contextlib.nullcontext():
        server = _serve(tmp_path, 2)
    try:
        assert len(server.leftovers()) == 4, "launcher, torchrun and two ranks"
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=10)
        left = server.leftovers_after(10)
        assert not left, f"still alive 10 s after kill -9 of the launcher: {left}"
    finally:
        server.stop()


@pytest.mark.timeout(90)
def test_a_launcher_started_with_the_stop_signals_blocked_still_stops_on_sigterm(tmp_path):
    """A blocked signal is inherited: started so, the launcher ignored SIGTERM (and torchrun the
    SIGTERM it forwards) until a kill 30 s later."""
    with _stop_signals_blocked():
        server = _serve(tmp_path, 2)
    try:
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait(timeout=20) == 0, server.log()
        assert not server.leftovers_after(10), "processes outlived the launcher"
    finally:
        server.stop()


# -- item 9: a one-rank server stops cleanly on SIGTERM and SIGINT -------------------------------


@pytest.mark.timeout(90)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_one_rank_server_stops_cleanly_on_a_signal(tmp_path, signum):
    # OpenBLAS (numpy, imported by torch) starts a thread pool at import when it may use more than
    # one thread: such threads exist before the signal thread and used to receive the signal.
    server = _serve(tmp_path, 1, env={"OMP_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "2"})
    try:
        assert processes_with(server.marker) == [server.proc.pid], "one rank runs in the launcher's process"
        outcome: dict = {}
        with server.client() as client:
            job = client.submit(size=2, steps=100, sleep_s=0.2)
            wait_for_state(client, job, "running")
            waiting = threading.Event()

            def wait() -> None:
                with Client(server.endpoint, heartbeat_s=1.0, dead_after_s=3.0) as waiter:
                    waiter.health()
                    waiting.set()
                    started = time.monotonic()
                    try:
                        result = waiter.result(job, timeout=30)
                        outcome["result"] = f"{result.job.state}: {result.job.error}"
                    except (ServerDeadError, JobFailedError, TimeoutError) as exc:
                        outcome["result"] = f"{type(exc).__name__}: {exc}"
                    outcome["elapsed"] = time.monotonic() - started

            thread = threading.Thread(target=wait)
            thread.start()
            assert waiting.wait(20), "the waiting client never reached the server"
            server.proc.send_signal(signum)
            assert server.wait(timeout=20) == 0, server.log()
            thread.join(30)
        name = signal.Signals(signum).name
        assert outcome["result"].startswith(("failed", "ServerDeadError")), outcome
        assert name in outcome["result"], outcome
        assert outcome["elapsed"] < 5, f"the waiting client heard after {outcome['elapsed']:.1f} s"
        log = server.log()
        assert f"server stopped by {name}" in log, log
        assert "Traceback" not in log and "KeyboardInterrupt" not in log, log
        assert not server.leftovers_after(5)
    finally:
        server.stop()


# -- item 10: rank 0 dies -> ServerDeadError for waiting clients ---------------------------------


@pytest.mark.timeout(90)
def test_rank_0_death_gives_waiting_clients_server_dead_error(tmp_path):
    server = _serve(tmp_path, 2)
    outcomes: dict[str, tuple[str, float]] = {}
    try:
        with server.client() as client:
            job = client.submit(size=2, steps=200, sleep_s=0.2)
            wait_for_state(client, job, "running")
        ready = threading.Barrier(3, timeout=20)
        killed_at: list[float] = []

        def record(kind: str, exc: BaseException | None) -> None:
            outcomes[kind] = (type(exc).__name__ if exc else "returned", time.monotonic() - killed_at[0])

        def blocking() -> None:
            with Client(server.endpoint, heartbeat_s=1.0, dead_after_s=4.0) as waiter:
                waiter.health()
                ready.wait()
                try:
                    waiter.result(job, timeout=60)
                    record("Client", None)
                except Exception as exc:  # noqa: BLE001 - the type is the assertion
                    record("Client", exc)

        def asynchronous() -> None:
            async def main() -> None:
                async with AsyncClient(server.endpoint, heartbeat_s=1.0, dead_after_s=4.0) as waiter:
                    await waiter.health()
                    await asyncio.to_thread(ready.wait)
                    try:
                        await waiter.result(job, timeout=60)
                        record("AsyncClient", None)
                    except Exception as exc:  # noqa: BLE001
                        record("AsyncClient", exc)

            asyncio.run(main())

        threads = [threading.Thread(target=blocking), threading.Thread(target=asynchronous)]
        for thread in threads:
            thread.start()
        ready.wait()  # (a result request sent after the kill must end the same way)
        rank0 = rank_pid(server.marker, 0)
        assert rank0 is not None, server.log()
        killed_at.append(time.monotonic())
        os.kill(rank0, signal.SIGKILL)
        for thread in threads:
            thread.join(40)
        assert outcomes.get("Client", ("missing",))[0] == "ServerDeadError", outcomes
        assert outcomes.get("AsyncClient", ("missing",))[0] == "ServerDeadError", outcomes
        assert max(elapsed for _, elapsed in outcomes.values()) < 15, outcomes
        assert server.wait(timeout=30) != 0
        assert not server.leftovers_after(10), "processes were left behind"
    finally:
        server.stop()
