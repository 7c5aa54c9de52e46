"""A dead or stuck rank, or a signal, never hangs anyone: every job reaches a terminal state with
a clear error, clients hear about it, the launcher exits, and no rank process is left."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tests.harness import ServerProcess, rank_pid
from tilecast.client import Client, JobFailedError, ServerDeadError


def _wait_for_state(client: Client, job_id: str, state: str, timeout: float = 20.0) -> None:
    """Wait until ``job_id`` is in ``state``; fail the test if it is not within ``timeout``."""
    deadline = time.monotonic() + timeout
    while (current := client.status(job_id).state) != state:
        assert time.monotonic() < deadline, f"job {job_id} still {current} after {timeout} s (waited for {state})"
        time.sleep(0.05)


def _collect_outcomes(
    server: ServerProcess, job_ids: list[str], timeout: float, connected: threading.Barrier | None = None
) -> dict[str, str]:
    """Wait for every job from its own thread; map job id -> terminal outcome text. With
    ``connected``, every thread first hears the server answer ``health``, then waits on it."""
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


def _start(tmp_path, *extra: str) -> ServerProcess:
    return ServerProcess(
        "--model-path",
        "test/allreduce",
        "--num-gpus",
        "2",
        "--device",
        "cpu",
        "--output-dir",
        str(tmp_path),
        "--heartbeat-timeout-s",
        "5",
        *extra,
    )


@pytest.mark.timeout(150)
def test_kill_9_of_a_worker_fails_every_job_quickly(tmp_path):
    server = _start(tmp_path)
    try:
        with server.client() as client:
            jobs = [client.submit(size=2, steps=40, sleep_s=0.25, seed=i) for i in range(4)]
            _wait_for_state(client, jobs[0], "running")
        worker = rank_pid(server.marker, 1)
        assert worker is not None, server.log()
        killed_at = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        outcomes = _collect_outcomes(server, jobs, timeout=40)
        elapsed = time.monotonic() - killed_at
        assert set(outcomes) == set(jobs)
        for job_id, outcome in outcomes.items():
            assert outcome.startswith(("failed", "dead")), (job_id, outcome)
        assert elapsed < 30, f"jobs took {elapsed:.1f} s to fail"
        code = server.wait(timeout=30)
        assert code != 0, server.log()
        assert "died" in server.log() or "collective failed" in server.log()
        assert not server.leftovers_after(10), "rank processes were left behind"
        with Client(server.endpoint, dead_after_s=2.0) as client:
            with pytest.raises((ServerDeadError, TimeoutError)):
                client.submit(size=1)
    finally:
        server.stop()


@pytest.mark.timeout(150)
def test_stuck_rank_is_detected_and_every_job_fails(tmp_path):
    server = _start(tmp_path, "--stuck-timeout-s", "4")
    try:
        with server.client() as client:
            stuck = client.submit(size=2, hang_rank=1)
            queued = [client.submit(size=2, seed=i) for i in range(3)]
        started = time.monotonic()
        outcomes = _collect_outcomes(server, [stuck, *queued], timeout=40)
        assert time.monotonic() - started < 30
        for job_id, outcome in outcomes.items():
            assert outcome.startswith(("failed", "dead")), (job_id, outcome)
        assert any("stuck" in outcome or "no progress" in outcome for outcome in outcomes.values()), outcomes
        assert server.wait(timeout=30) != 0
        assert not server.leftovers_after(10)
    finally:
        server.stop()


@pytest.mark.timeout(120)
def test_sigterm_stops_everything_cleanly(tmp_path):
    server = _start(tmp_path)
    try:
        with server.client() as client:
            running = client.submit(size=2, steps=40, sleep_s=0.25)
            queued = client.submit(size=2)
            _wait_for_state(client, running, "running")
        results: dict[str, str] = {}
        connected = threading.Barrier(3, timeout=20)
        waiter = threading.Thread(
            target=lambda: results.update(_collect_outcomes(server, [running, queued], 30, connected))
        )
        waiter.start()
        connected.wait()  # both waiters reached the server (BrokenBarrierError fails the test)
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait(timeout=40) == 0, server.log()
        waiter.join(40)
        assert set(results) == {running, queued}, results
        for job_id, outcome in results.items():
            assert outcome.startswith(("failed", "dead", "cancelled")), (job_id, outcome)
        assert not server.leftovers_after(10)
    finally:
        server.stop()
