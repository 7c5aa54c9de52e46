"""A dead or stuck rank, or a signal, never hangs anyone: every job reaches a terminal state with
a clear error, clients hear about it, the launcher exits, and no rank process is left."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from tests.harness import ServerProcess, collect_outcomes, outcomes_after_kill_9, serve_args, wait_for_state
from tilecast.client import Client, ServerDeadError


def _start(tmp_path, **options) -> ServerProcess:
    """The probe on two CPU ranks, declared dead after 5 s without a heartbeat."""
    return ServerProcess(*serve_args("test/allreduce", tmp_path, num_gpus=2, heartbeat_timeout_s=5, **options))


@pytest.mark.timeout(150)
def test_kill_9_of_a_worker_fails_every_job_quickly(tmp_path):
    server = _start(tmp_path)
    try:
        with server.client() as client:
            jobs = [client.submit(size=2, steps=40, sleep_s=0.25, seed=i) for i in range(4)]
            wait_for_state(client, jobs[0], "running")
        outcomes, elapsed = outcomes_after_kill_9(server, 1, jobs, timeout=40)
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
    server = _start(tmp_path, stuck_timeout_s=4)
    try:
        with server.client() as client:
            stuck = client.submit(size=2, hang_rank=1)
            queued = [client.submit(size=2, seed=i) for i in range(3)]
        started = time.monotonic()
        outcomes = collect_outcomes(server, [stuck, *queued], timeout=40)
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
            wait_for_state(client, running, "running")
        results: dict[str, str] = {}
        connected = threading.Barrier(3, timeout=20)
        waiter = threading.Thread(
            target=lambda: results.update(collect_outcomes(server, [running, queued], 30, connected))
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
