"""The spine end to end: client library -> rank-0 scheduler -> broadcast plan -> every rank.

Runs against both server kinds: one rank in-process, and two torchrun ranks over gloo.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import torch

from tests.harness import ServerProcess, serve_args
from tilecast.client import AsyncClient, Client, JobFailedError, ServerError
from tilecast.runtime.config import ServeConfig
from tilecast.runtime.inproc import InProcessServer
from tilecast.runtime.probe import AllReducePipeline, ProbeParams


@pytest.fixture(scope="module")
def probe_log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("probe-log")


@pytest.fixture(scope="module")
def torchrun_server(tmp_path_factory, probe_log_dir):
    out = tmp_path_factory.mktemp("out")
    server = ServerProcess(
        *serve_args("test/allreduce", out, num_gpus=2, max_queued_requests=64),
        env={"TILECAST_PROBE_LOG_DIR": str(probe_log_dir)},
    )
    try:
        yield server
    finally:
        server.stop()
        assert not server.left_behind


@pytest.fixture(params=["inproc", "torchrun"])
def server(request, tmp_path):
    if request.param == "inproc":
        config = ServeConfig(model_path="test/allreduce", device="cpu", port=0, output_dir=tmp_path)
        with InProcessServer(config) as srv:
            yield srv, 1
    else:
        yield request.getfixturevalue("torchrun_server"), 2


@pytest.mark.timeout(180)
def test_client_api(server):
    srv, world = server
    with Client(srv.endpoint) as client:
        health = client.health()
        assert health.status == "serving" and health.world_size == world and health.model == "test/allreduce"

        result = client.generate(size=5, seed=11, timeout=60)
        expected = AllReducePipeline.expected_sum(ProbeParams(size=5, seed=11), world)
        assert torch.allclose(result.tensor("sum"), expected)
        (file_item,) = result.files
        assert torch.allclose(torch.tensor(json.loads(file_item.data), dtype=torch.float64), expected)

        as_paths = client.result(result.job.job_id, as_paths=True)
        assert as_paths.files[0].data is None and as_paths.files[0].path.endswith(".json")

        status = client.status(result.job.job_id)
        assert status.state == "completed" and status.progress == 1.0

        with pytest.raises(ServerError, match="not_found"):
            client.status("job_does_not_exist")
        with pytest.raises(ServerError, match="bad_request.*size"):
            client.submit(size="five")
        with pytest.raises(ServerError, match="bad_request.*unknown field `colour`"):
            client.submit(colour="red")
        with pytest.raises(ServerError, match="bad_request.*steps must be"):
            client.submit(steps=0)

        with pytest.raises(JobFailedError, match="failed: ValueError: boom"):
            client.generate(fail="boom", timeout=60)
        assert client.generate(size=1, timeout=60).job.state == "completed"  # still serving

        stats = client.stats()
        assert stats["jobs"]["failed"] >= 1 and stats["jobs"]["completed"] >= 2


@pytest.mark.timeout(120)
def test_async_client(server):
    srv, world = server

    async def main():
        async with AsyncClient(srv.endpoint) as client:
            assert (await client.health()).status == "serving"
            results = await asyncio.gather(*(client.generate(size=3, seed=s, timeout=60) for s in range(6)))
            for seed, result in enumerate(results):
                expected = AllReducePipeline.expected_sum(ProbeParams(size=3, seed=seed), world)
                assert torch.allclose(result.tensor("sum"), expected)
            job_id = await client.submit(size=2)
            info = await client.status(job_id)
            assert info.state in {"queued", "running", "completed"}
            return (await client.result(job_id, timeout=60)).job.state

    assert asyncio.run(main()) == "completed"


def _read_rank_logs(log_dir, world):
    return [
        [json.loads(line) for line in (log_dir / f"rank{rank}.log").read_text().splitlines()] for rank in range(world)
    ]


@pytest.mark.timeout(180)
def test_concurrent_submits_run_in_the_same_order_on_every_rank(torchrun_server, probe_log_dir):
    job_ids: list[str] = []
    lock = threading.Lock()
    errors = []

    def client_thread(thread_index: int) -> None:
        try:
            with torchrun_server.client() as client:
                ids = [client.submit(size=4, seed=thread_index * 10 + i, steps=2) for i in range(5)]
                with lock:
                    job_ids.extend(ids)
                for job_id in ids:
                    assert client.result(job_id, timeout=120).job.state == "completed"
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=client_thread, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(150)
    assert not errors, errors
    assert len(job_ids) == 20
    logs = _read_rank_logs(probe_log_dir, 2)
    assert logs[0] == logs[1], "ranks executed different units of work"
    executed = [job for batch in logs[0] for job in batch]
    assert set(job_ids) <= set(executed)


@pytest.mark.timeout(120)
def test_cancelled_queued_job_never_runs(torchrun_server, probe_log_dir):
    with torchrun_server.client() as client:
        blocker = client.submit(size=2, steps=4, sleep_s=0.5)
        victim = client.submit(size=2, seed=99)
        info = client.cancel(victim)
        assert info.state == "cancelled"
        assert client.result(victim, timeout=10).job.state == "cancelled"
        assert client.result(blocker, timeout=60).job.state == "completed"
        # cancelling a terminal job changes nothing
        assert client.cancel(victim).state == "cancelled"
    logs = _read_rank_logs(probe_log_dir, 2)
    for rank_log in logs:
        assert victim not in {job for batch in rank_log for job in batch}
        assert blocker in {job for batch in rank_log for job in batch}


@pytest.mark.timeout(60)
def test_queue_overflow_is_rejected_at_once(tmp_path):
    config = ServeConfig(model_path="test/allreduce", device="cpu", port=0, output_dir=tmp_path, max_queued_requests=2)
    with InProcessServer(config) as srv, Client(srv.endpoint) as client:
        running = client.submit(size=1, steps=10, sleep_s=0.2)
        deadline = time.monotonic() + 10
        while client.status(running).state != "running" and time.monotonic() < deadline:
            time.sleep(0.01)
        queued = [client.submit(size=1), client.submit(size=1)]
        started = time.perf_counter()
        with pytest.raises(ServerError) as err:
            client.submit(size=1)
        elapsed = time.perf_counter() - started
        assert err.value.code == "overloaded" and "--max-queued-requests" in err.value.message
        assert elapsed < 0.1, f"overflow took {elapsed * 1000:.1f} ms to reject"
        client.cancel(running)
        for job_id in queued:
            assert client.result(job_id, timeout=30).job.state == "completed"
        assert client.result(running, timeout=30).job.state == "cancelled"


@pytest.mark.timeout(60)
def test_shutdown_request_cancels_queued_and_stops(tmp_path):
    config = ServeConfig(model_path="test/allreduce", device="cpu", port=0, output_dir=tmp_path)
    srv = InProcessServer(config).start()
    try:
        with Client(srv.endpoint) as client:
            first = client.submit(size=1, steps=3, sleep_s=0.2)
            second = client.submit(size=1)
            assert client.shutdown().status == "stopping"
            assert client.result(first, timeout=30).job.state == "completed"
            assert client.result(second, timeout=30).job.state == "cancelled"
            with pytest.raises(ServerError, match="stopping"):
                client.submit(size=1)
    finally:
        srv.stop()
