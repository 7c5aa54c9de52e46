"""Finished jobs' files do not pile up: ``--max-stored-outputs``, ``--output-retention-s`` and DELETE.

``OutputStore`` on a fake clock, then real servers: the probe (files named by job id in the output
directory) and tiny FLUX (a folder per job) in-process, and the probe on two torchrun ranks with
the command-line flags. An evicted job keeps its record; asking for its result is a ``gone`` error
that says why.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.harness import ServerProcess, serve_args, wait_until
from tilecast.client import Client, ServerError
from tilecast.runtime.config import ServeConfig
from tilecast.runtime.inproc import InProcessServer
from tilecast.runtime.pipeline import Output, OutputFile
from tilecast.scheduler.outputs import OutputStore


def entries(out: Path) -> list[Path]:
    return sorted(path for path in out.iterdir() if path.name.startswith("job_"))


# ------------------------------------------------------------------------------------ unit
def fake_job(root: Path, job_id: str, finished_at: float, *, state: str = "completed", folder: bool = True):
    directory = root / job_id if folder else root
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / (f"{job_id}.json" if not folder else "out.png")
    path.write_text("x")
    output = Output(files=[OutputFile(name=path.name, path=path, mime="image/png")])
    return SimpleNamespace(id=job_id, state=state, output=output, finished_at=finished_at, expired=None)


def test_store_bounds_count_and_age_and_deletes_only_inside_its_root(tmp_path):
    now = [1000.0]
    store = OutputStore(tmp_path / "out", retention_s=60.0, max_stored=2, clock=lambda: now[0])
    jobs = [fake_job(tmp_path / "out", f"job_{i}", finished_at=now[0] + i, folder=i % 2 == 0) for i in range(4)]
    for job in jobs:
        store.add(job)
        store.sweep()
    assert len(store) == 2 and [p.name for p in entries(tmp_path / "out")] == ["job_2", "job_3.json"]
    assert jobs[0].output is None and "--max-stored-outputs" in jobs[0].expired
    now[0] += 64.0  # the newest finished at 1003
    store.sweep()
    assert len(store) == 0 and entries(tmp_path / "out") == []
    assert "older than 60 s (--output-retention-s)" in jobs[3].expired and store.deleted == 4

    cancelled = fake_job(tmp_path / "out", "job_c", now[0], state="cancelled")  # its batch ran on
    store.add(cancelled)
    assert len(store) == 0 and entries(tmp_path / "out") == []

    outside = tmp_path / "elsewhere.txt"
    outside.write_text("keep me")
    stray = SimpleNamespace(
        id="job_x",
        state="completed",
        finished_at=now[0],
        expired=None,
        output=Output(files=[OutputFile(name="e", path=outside, mime="text/plain")]),
    )
    store.add(stray)
    store.remove(stray, "deleted")
    assert outside.read_text() == "keep me" and stray.expired == "deleted"
    with pytest.raises(ValueError, match="max_stored_outputs must be >= 1, got 0"):
        OutputStore(tmp_path, retention_s=None, max_stored=0)


# ------------------------------------------------------------------------------------ served
@pytest.mark.timeout(120)
def test_thirty_jobs_keep_at_most_five_outputs_and_an_evicted_result_is_gone(tmp_path):
    config = ServeConfig(model_path="test/allreduce", device="cpu", port=0, output_dir=tmp_path, max_stored_outputs=5)
    with InProcessServer(config) as srv, Client(srv.endpoint) as client:
        jobs = []
        for seed in range(30):
            jobs.append(client.generate(size=2, seed=seed, timeout=30).job.job_id)
            assert len(entries(tmp_path)) <= 5
        assert [p.name for p in entries(tmp_path)] == sorted(f"{job}.json" for job in jobs[-5:])
        with pytest.raises(ServerError) as err:
            client.result(jobs[0], timeout=10)
        assert err.value.code == "gone" and "--max-stored-outputs" in err.value.message, err.value
        assert client.status(jobs[0]).state == "completed"  # the record stays
        assert client.result(jobs[-1], timeout=10).files[0].data
        stats = client.stats()
        assert stats["stored_outputs"] == 5 and stats["deleted_outputs"] == 25


@pytest.mark.timeout(120)
def test_outputs_expire_after_the_retention_time(tmp_path):
    config = ServeConfig(model_path="test/allreduce", device="cpu", port=0, output_dir=tmp_path, output_retention_s=1.0)
    with InProcessServer(config) as srv, Client(srv.endpoint) as client:
        job = client.generate(size=2, timeout=30).job.job_id
        assert len(entries(tmp_path)) == 1
        wait_until(lambda: entries(tmp_path) == [], 10, "the expired output's deletion", interval=0.1)
        with pytest.raises(ServerError) as err:
            client.result(job, timeout=10)
        assert err.value.code == "gone" and "--output-retention-s" in err.value.message, err.value


@pytest.fixture(scope="module")
def flux(tmp_path_factory, tiny_cache):
    out = tmp_path_factory.mktemp("flux-out")
    config = ServeConfig(model_path="tiny/flux", device="cpu", port=0, output_dir=out, max_stored_outputs=3)
    with InProcessServer(config) as srv:
        yield srv, out


@pytest.mark.timeout(180)
def test_family_job_folders_stay_bounded_and_delete_removes_them(flux):
    srv, out = flux
    with Client(srv.endpoint) as client:
        jobs = [
            client.generate(prompt=f"p{i}", width=32, height=32, num_inference_steps=1, timeout=60).job.job_id
            for i in range(8)
        ]
        folders = entries(out)
        assert [p.name for p in folders] == sorted(jobs[-3:]) and all(p.is_dir() for p in folders)

        deleted = client.delete(jobs[-1])
        assert deleted.state == "completed"
        assert not (out / jobs[-1]).exists()
        with pytest.raises(ServerError, match="not_found"):
            client.status(jobs[-1])

        running = client.submit(prompt="long", width=64, height=64, num_inference_steps=1000)
        deadline = time.monotonic() + 30
        while client.status(running).state != "running" and time.monotonic() < deadline:
            time.sleep(0.02)
        client.delete(running)  # a running job: cancelled at its next step, then forgotten
        wait_until(lambda: srv.zero.scheduler.table.jobs.get(running) is None, 10, "the deleted job's removal")
        assert not (out / running).exists()
        assert client.generate(prompt="after", width=32, height=32, num_inference_steps=1, timeout=60).files


@pytest.mark.timeout(120)
def test_two_ranks_cli_flags_bound_the_outputs(tmp_path):
    server = ServerProcess(
        *serve_args("test/allreduce", tmp_path, num_gpus=2, max_stored_outputs=3, output_retention_s=600)
    )
    try:
        with server.client() as client:
            jobs = [client.generate(size=2, seed=seed, timeout=30).job.job_id for seed in range(10)]
            assert [p.name for p in entries(tmp_path)] == sorted(f"{job}.json" for job in jobs[-3:])
            client.delete(jobs[-1])
            assert len(entries(tmp_path)) == 2
            with pytest.raises(ServerError) as err:
                client.result(jobs[0], timeout=10)
            assert err.value.code == "gone"
    finally:
        server.stop()
