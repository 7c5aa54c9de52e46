"""A served job's progress moves while it runs, and a running job can be cancelled.

Real servers (one rank in-process, two torchrun ranks over gloo) run the ``test/allreduce`` probe,
whose every step reports progress and ends at a cancel point; the tiny K6 SR and FLUX checkpoints
run in-process. Cancelling stops a running batch at its next step or tile boundary once every job
of it is cancelled (nothing is written); a cancelled job inside a batch that goes on has its
output discarded. Either way the server then serves the next request.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tests.harness import ServerProcess, serve_args
from tests.media import write_test_video
from tilecast.client import Client
from tilecast.runtime.config import ServeConfig
from tilecast.runtime.inproc import InProcessServer
from tilecast.runtime.probe import AllReducePipeline, ProbeParams

BATCHING = dict(batching_mode="dynamic", batching_max_size=4, batching_delay_ms=400.0)


@pytest.fixture(scope="module")
def torchrun_probe(tmp_path_factory):
    out = tmp_path_factory.mktemp("out2")
    server = ServerProcess(*serve_args("test/allreduce", out, num_gpus=2, **BATCHING))
    try:
        yield server, out
    finally:
        server.stop()


@pytest.fixture(params=["inproc", "torchrun"])
def probe(request, tmp_path):
    """``(endpoint, output dir, world size)`` of a probe server."""
    if request.param == "inproc":
        config = ServeConfig(model_path="test/allreduce", device="cpu", port=0, output_dir=tmp_path, **BATCHING)
        with InProcessServer(config) as srv:
            yield srv.endpoint, tmp_path, 1
    else:
        server, out = request.getfixturevalue("torchrun_probe")
        yield server.endpoint, out, 2


def watch(client: Client, job_id: str, timeout: float) -> list[tuple[str, float]]:
    """``(state, progress)`` every 20 ms until the job is terminal."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = client.status(job_id)
        seen.append((info.state, info.progress))
        if info.state in ("completed", "failed", "cancelled"):
            return seen
        time.sleep(0.02)
    raise AssertionError(f"job {job_id} still {seen[-1]} after {timeout} s")


def wait_running(client: Client, job_id: str, timeout: float = 30.0) -> None:
    """Until the job runs and has made progress (so a cancel lands mid-run)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = client.status(job_id)
        if info.state == "running" and info.progress > 0:
            return
        assert info.state in ("queued", "running"), info
        time.sleep(0.02)
    raise AssertionError(f"job {job_id} did not start: {client.status(job_id)}")


def files_of(out: Path, job_id: str) -> list[Path]:
    """What the job left under the output directory (its folder or files named by its id)."""
    return sorted(path for path in out.rglob("*") if job_id in str(path.relative_to(out)))


def stopped_early(client: Client, job_id: str) -> None:
    """The job ended at a cancel point, before its last step (not run to the end and discarded)."""
    info = client.status(job_id)
    assert info.state == "cancelled" and "stopped before the end" in info.error, info
    assert info.progress < 1.0, info


def cancel_and_time(client: Client, *job_ids: str) -> float:
    started = time.monotonic()
    for job_id in job_ids:
        client.cancel(job_id)
    for job_id in job_ids:
        assert client.result(job_id, timeout=30).job.state == "cancelled"
    return time.monotonic() - started


# ------------------------------------------------------------------------------------ probe
@pytest.mark.timeout(120)
def test_progress_moves_while_a_job_runs(probe):
    endpoint, _out, _world = probe
    with Client(endpoint) as client:
        job = client.submit(size=2, steps=25, sleep_s=0.08)
        seen = watch(client, job, timeout=60)
    running = [progress for state, progress in seen if state == "running"]
    assert any(0 < progress < 1 for progress in running), seen
    assert len({progress for progress in running if 0 < progress < 1}) >= 3, seen  # it moves, step by step
    progresses = [progress for _, progress in seen]
    assert progresses == sorted(progresses) and seen[-1] == ("completed", 1.0)


@pytest.mark.timeout(120)
def test_cancelling_a_running_job_stops_it_at_the_next_step(probe):
    endpoint, out, world = probe
    with Client(endpoint) as client:
        job = client.submit(size=2, steps=400, sleep_s=0.05, seed=5)  # 20 s if nobody stops it
        wait_running(client, job)
        assert cancel_and_time(client, job) < 3.0
        stopped_early(client, job)
        assert files_of(out, job) == []
        result = client.generate(size=3, seed=6, timeout=60)  # the server goes on
        assert torch.allclose(result.tensor("sum"), AllReducePipeline.expected_sum(ProbeParams(size=3, seed=6), world))
        assert client.stats()["jobs"]["cancelled"] >= 1


@pytest.mark.timeout(120)
def test_cancel_inside_a_batch_discards_only_that_output_and_all_cancelled_stops_the_batch(probe):
    endpoint, out, _world = probe
    slow = dict(size=2, steps=50, sleep_s=0.06)  # 3 s per batch
    with Client(endpoint) as client:
        kept, dropped = client.submit(seed=1, **slow), client.submit(seed=2, **slow)
        wait_running(client, kept)
        assert client.status(dropped).state == "running"  # one batch
        client.cancel(dropped)
        assert client.result(kept, timeout=30).job.state == "completed"
        dropped_info = client.result(dropped, timeout=30).job
        assert dropped_info.state == "cancelled" and "stopped" not in dropped_info.error, dropped_info
        assert files_of(out, dropped) == [] and len(files_of(out, kept)) == 1

        first, second = (
            client.submit(seed=3, steps=400, size=2, sleep_s=0.05),
            client.submit(seed=4, steps=400, size=2, sleep_s=0.05),
        )
        wait_running(client, first)
        assert client.status(second).state == "running"
        client.cancel(first)
        time.sleep(0.5)
        assert client.status(first).state == "running"  # its companion still needs the batch
        assert cancel_and_time(client, second) < 3.0
        stopped_early(client, first)
        stopped_early(client, second)
        assert files_of(out, first) == files_of(out, second) == []
        assert client.generate(size=1, timeout=60).job.state == "completed"


# ------------------------------------------------------------------------------------ real pipelines
@pytest.fixture(scope="module")
def k6sr(tmp_path_factory):
    media = tmp_path_factory.mktemp("media")
    out = tmp_path_factory.mktemp("k6sr-out")
    video = write_test_video(media / "clip.mp4", 96, 96, 9, 24.0)  # four tiles at x2
    config = ServeConfig(model_path="tiny/k6sr", device="cpu", port=0, output_dir=out, allowed_video_dirs=(media,))
    with InProcessServer(config) as srv:
        yield srv, out, video


@pytest.mark.timeout(180)
def test_k6sr_progress_per_step_and_cancel_between_tiles(k6sr):
    srv, out, video = k6sr
    request = dict(video_path=str(video), sr_resolution_scale=2, num_inference_steps=12)
    with Client(srv.endpoint) as client:
        job = client.submit(**request)
        seen = watch(client, job, timeout=120)
        assert seen[-1][0] == "completed", seen
        assert any(state == "running" and 0 < progress < 1 for state, progress in seen), seen

        job = client.submit(**request)
        wait_running(client, job)
        assert cancel_and_time(client, job) < 5.0
        stopped_early(client, job)
        assert files_of(out, job) == []
        assert client.generate(video_path=str(video), sr_resolution_scale=2, timeout=120).job.state == "completed"


@pytest.fixture(scope="module")
def flux(tmp_path_factory, tiny_cache):
    out = tmp_path_factory.mktemp("flux-out")
    config = ServeConfig(model_path="tiny/flux", device="cpu", port=0, output_dir=out)
    with InProcessServer(config) as srv:
        yield srv, out


@pytest.mark.timeout(180)
def test_flux_progress_per_denoising_step_and_cancel_between_steps(flux):
    srv, out = flux
    request = dict(prompt="a red square", width=64, height=64, num_inference_steps=60)
    with Client(srv.endpoint) as client:
        job = client.submit(**request)
        seen = watch(client, job, timeout=120)
        assert seen[-1][0] == "completed", seen
        assert len({p for state, p in seen if state == "running" and 0 < p < 1}) >= 3, seen

        job = client.submit(**{**request, "num_inference_steps": 1000})
        wait_running(client, job)
        assert cancel_and_time(client, job) < 5.0
        stopped_early(client, job)
        assert files_of(out, job) == []
        assert client.generate(prompt="next", width=32, height=32, timeout=120).job.state == "completed"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("layout", [(), ("--tile-parallel",)])
def test_k6sr_two_ranks_progress_and_cancel(tmp_path, layout):
    """Two ranks, replicated (a cancel point per DiT step) or tile-parallel (four chunks dealt to two
    units, which do not step together: the cancel point sits between the two gathered rounds):
    progress moves, a cancel stops the job before its end with nothing written, and the next
    request is served."""
    video = write_test_video(tmp_path / "clip.mp4", 96, 96, 9, 24.0)  # four tiles at x2
    out = tmp_path / "out"
    server = ServerProcess(*serve_args("tiny/k6sr", out, *layout, num_gpus=2, allowed_video_dir=tmp_path))
    try:
        with server.client() as client:
            request = dict(video_path=str(video), sr_resolution_scale=2, num_inference_steps=40)
            job = client.submit(**request)
            wait_running(client, job, timeout=60)
            assert cancel_and_time(client, job) < 10.0
            stopped_early(client, job)
            assert files_of(out, job) == []
            job = client.submit(**{**request, "num_inference_steps": 4})
            seen = watch(client, job, timeout=90)
            assert seen[-1][0] == "completed", (seen[-1], server.log())
            assert any(state == "running" and 0 < progress < 1 for state, progress in seen), seen
    finally:
        server.stop()
