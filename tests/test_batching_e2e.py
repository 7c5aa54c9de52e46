"""Dynamic batching end to end: real ``Client`` over a real socket, the scheduler, the tiny families.

In-process servers (one rank, threads) for most tests; one test through a real 2-rank torchrun
``tilecast serve``. Outputs inside merged batches are compared with singleton outputs within
``BATCH_TOL`` (batch shape may change kernels; see ``tests/test_families.py``).
"""

from __future__ import annotations

import logging
import re
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

from tests.harness import skip_without_required_modules
from tilecast.client import Client, JobFailedError
from tilecast.runtime.config import ServeConfig
from tilecast.runtime.inproc import InProcessServer
from tilecast.runtime.models.families.flux import TINY_FLUX
from tilecast.runtime.models.families.images import example_image
from tilecast.runtime.registry import resolve_pipeline

BATCH_TOL = 1e-4
DISPATCH = re.compile(r"Dynamic batch dispatch: size=(\d+)/(\d+), user_max=8")
SMALL = dict(width=32, height=32)


@pytest.fixture
def serve(tiny_cache, tmp_path):
    """``with serve(model) as (server, client)``: a dynamic-batching in-process server, stopped after."""

    @contextmanager
    def start(model_path: str, *, delay_ms: float = 300.0, max_size: int = 8):
        config = ServeConfig(
            model_path=model_path,
            device="cpu",
            port=0,
            batching_mode="dynamic",
            batching_max_size=max_size,
            batching_delay_ms=delay_ms,
            enable_batching_metrics=True,
            output_dir=tmp_path / "out",
        )
        server = InProcessServer(config).start()
        try:
            with Client(server.endpoint, timeout=60.0) as client:
                client.wait_ready(30.0)
                yield server, client
        finally:
            server.stop()
            assert server.error is None, server.error

    return start


def generate_all(client: Client, requests: list[dict], timeout: float = 120.0) -> list:
    """Fire ``requests`` concurrently (one thread each, as separate users would) and wait for all."""
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        futures = [pool.submit(client.generate, timeout=timeout, **fields) for fields in requests]
        return [future.result() for future in futures]


def dispatch_sizes(caplog) -> list[int]:
    return [int(m.group(1)) for m in DISPATCH.finditer(caplog.text)]


def test_eight_concurrent_compatible_requests_merge_and_match_singletons(serve, caplog):
    caplog.set_level(logging.INFO, logger="tilecast.scheduler.scheduler")
    requests = [dict(prompt=f"prompt number {i}", seed=100 + i, return_tensor=True, **SMALL) for i in range(8)]
    with serve("tiny/flux") as (_server, client):
        results = generate_all(client, requests)
        batching = client.stats()["batching"]["cumulative"]
        assert batching["requests"] == 8 and batching["dispatches"] < 8, batching
        assert batching["merged_rate"] > 0
        assert max(dispatch_sizes(caplog)) > 1, caplog.text
        assert all(r.info["batch_size"] > 1 for r in results)
        # each request's merged output equals its own singleton output (two of them, sent alone)
        for index in (0, 5):
            alone = client.generate(timeout=60.0, **requests[index])
            assert alone.info["batch_size"] == 1
            diff = (results[index].tensor("image") - alone.tensor("image")).abs().max().item()
            assert diff <= BATCH_TOL, f"request {index}: merged vs singleton differ by {diff:.3g}"
        assert (results[0].tensor("image") - results[1].tensor("image")).abs().max() > 0.01
        png = results[3].files[0]
        assert png.mime == "image/png" and png.data[:8] == b"\x89PNG\r\n\x1a\n"


def test_mixed_resolutions_do_not_merge(serve):
    with serve("tiny/flux") as (_server, client):
        sizes = [(32, 32), (48, 32), (32, 32), (48, 32)]
        job_ids = [client.submit(prompt=f"p{i}", width=w, height=h, seed=i) for i, (w, h) in enumerate(sizes)]
        results = [client.result(job_id, timeout=60.0) for job_id in job_ids]
        assert all(r.job.state == "completed" for r in results)
        assert [r.info["shape"][1:] for r in results] == [[h, w] for w, h in sizes]
        assert [r.info["batch_size"] for r in results] == [2, 2, 2, 2]
        batching = client.stats()["batching"]["cumulative"]
        assert batching["dispatches"] == 2 and batching["rejects"].get("resolution", 0) >= 1, batching


def test_a_failing_merged_batch_fails_every_member_and_the_server_goes_on(serve):
    with serve("tiny/flux") as (server, client):
        transformer = server.rt.pipeline.pipe.transformer

        def broken_forward(*args, **kwargs):
            raise RuntimeError("transformer exploded")

        transformer.forward = broken_forward
        try:
            job_ids = [client.submit(prompt=f"p{i}", seed=i, **SMALL) for i in range(3)]
            for job_id in job_ids:
                failed = client.result(job_id, timeout=60.0)
                assert failed.job.state == "failed" and "transformer exploded" in failed.job.error, failed.job
            with pytest.raises(JobFailedError, match="transformer exploded"):
                client.generate(prompt="alone, also failing", timeout=60.0, **SMALL)
        finally:
            del transformer.forward  # back to the class's forward
        batching = client.stats()["batching"]["cumulative"]
        assert batching["size_histogram"] in ({3: 1, 1: 1}, {"3": 1, "1": 1}), batching
        after = client.generate(prompt="still serving", timeout=60.0, **SMALL)
        assert after.job.state == "completed" and after.files


ROWS = [
    ("tiny/flux", {}, "image/png"),
    ("tiny/qwen-image", {}, "image/png"),
    ("tiny/qwen-image-2512", {}, "image/png"),
    ("tiny/z-image-turbo", {}, "image/png"),
    ("tiny/z-image", {}, "image/png"),
    ("tiny/sd3", {}, "image/png"),
    ("tiny/glm-image", {}, "image/png"),
    ("tiny/sana-1.5-1.6b", {}, "image/png"),
    ("tiny/flux.2-dev", {"num_inference_steps": 2}, "image/png"),
    ("tiny/flux.2-dev-nvfp4", {"num_inference_steps": 2}, "image/png"),  # its NVFP4 file by default
    ("tiny/flux.2-klein-4b", {}, "image/png"),
    ("tiny/ernie-image", {}, "image/png"),
    ("tiny/ernie-image-turbo", {}, "image/png"),
    ("tiny/wan2.1-t2v", {"num_frames": 5}, "video/mp4"),
    ("tiny/hunyuanvideo", {"num_frames": 5, "num_inference_steps": 2}, "video/mp4"),
    ("tiny/helios-base", {"num_frames": 33, "num_inference_steps": 2}, "video/mp4"),
    ("tiny/helios-distilled", {"num_frames": 33}, "video/mp4"),
    ("tiny/ltx-2", {"width": 64, "height": 64, "num_frames": 9, "num_inference_steps": 2}, "video/mp4"),
    ("tiny/wan2.1-i2v-14b-480p", {"num_frames": 5, "image": example_image()}, "video/mp4"),
    ("tiny/wan2.2-t2v-a14b", {"num_frames": 5}, "video/mp4"),
    ("tiny/wan2.2-i2v-a14b", {"num_frames": 5, "image": example_image()}, "video/mp4"),
    ("tiny/wan2.2-ti2v-5b", {"num_frames": 5}, "video/mp4"),
    ("tiny/wan2.2-ti2v-5b", {"num_frames": 5, "image": example_image()}, "video/mp4"),
    # image editing: an input image each (same size, so Edit requests merge); 2 steps (1 is refused under
    # Qwen-Image's shift_terminal schedule). Edit Plus serves one request per call.
    ("tiny/qwen-image-edit", {"image": example_image(), "num_inference_steps": 2}, "image/png"),
    ("tiny/qwen-image-edit-2511", {"image": example_image(), "num_inference_steps": 2}, "image/png"),
    # decomposition: no size (diffusers' 640 bucket at the image's aspect ratio), two RGBA layers each
    ("tiny/qwen-image-layered", {"image": example_image(), "num_inference_steps": 2, "layers": 2}, "image/png"),
]
"""The grid's rows as served: (built-in model, request fields beside ``SMALL``, output type)."""


def row_fields(cls, extra: dict) -> dict:
    """A row's request fields: ``SMALL`` (LTX-2's rows say 64 x 64, its smallest) unless the input
    image decides the size (Qwen-Image-Layered), then the row's own."""
    fields = {**SMALL, **extra}
    if cls.size_from_image:
        del fields["width"], fields["height"]
    return fields


@pytest.mark.parametrize(("model", "extra", "mime"), ROWS)
def test_family_row_serves_singleton_and_batched_requests(model, extra, mime, serve):
    """Each row through a served model: three concurrent requests merge into one batch (a family
    served one request at a time runs them alone), then a request alone."""
    skip_without_required_modules(resolve_pipeline(model))  # the Qwen image-edit rows need torchvision
    size = min(3, resolve_pipeline(model).max_batch_size)  # GLM-Image, Helios' pyramid, Edit Plus: one at a time
    with serve(model, delay_ms=500.0) as (_server, client):
        fields = row_fields(resolve_pipeline(model), extra)
        merged = generate_all(client, [dict(prompt=f"row {i}", seed=i, **fields) for i in range(3)])
        single = client.generate(prompt="alone", timeout=60.0, **fields)
        assert [r.info["batch_size"] for r in merged] == [size] * 3 and single.info["batch_size"] == 1
        for result in (*merged, single):
            assert result.job.state == "completed" and result.files[0].mime == mime
            assert len(result.files[0].data) > 100
            assert len(result.files) == result.info.get("layers", 1)  # a layered model: a file per layer
        histogram = {int(k): v for k, v in client.stats()["batching"]["cumulative"]["size_histogram"].items()}
        assert histogram == ({3: 1, 1: 1} if size == 3 else {1: 4})


@pytest.mark.grid
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("model", "extra", "mime"), ROWS)
def test_family_row_on_a_two_rank_torchrun_server(model, extra, mime, tiny_cache, tmp_path):
    """Each row through ``tilecast serve`` on 2 CPU ranks: Ulysses 2 where the family has a
    sequence-parallel plan (one group: three concurrent requests merge), else two replica groups
    (DP 2: a merged batch goes to one of them). A merged request equals the same request alone.
    ``make test-grid`` (about 15 s a row: three interpreters start per server), not ``make test``."""
    from tests.harness import ServerProcess, serve_args

    cls = resolve_pipeline(model)
    skip_without_required_modules(cls)
    topology = dict(ulysses_degree=2) if cls.cp_plan is not None else dict(dp_degree=2)
    fields = {**row_fields(cls, extra), "return_tensor": True}
    batching = dict(batching_mode="dynamic", batching_max_size=8, batching_delay_ms=500)
    server = ServerProcess(
        *serve_args(model, tmp_path / "out", num_gpus=2, **topology, **batching),
        env={"TILECAST_CACHE": str(tiny_cache), "OMP_NUM_THREADS": "1"},
        ready_timeout=200.0,
    )
    try:
        with server.client(timeout=120.0) as client:
            merged = generate_all(client, [dict(prompt=f"row {i}", seed=i, **fields) for i in range(3)])
            alone = client.generate(prompt="row 0", seed=0, timeout=120.0, **fields)
            assert client.health().world_size == 2
    finally:
        server.stop()
    size = min(3, cls.max_batch_size)
    sizes = [r.info["batch_size"] for r in merged]
    if "ulysses_degree" in topology:
        assert sizes == [size] * 3, sizes
    assert max(sizes) <= size and alone.info["batch_size"] == 1, sizes
    for result in (*merged, alone):
        assert result.job.state == "completed" and result.files[0].mime == mime
    diff = (merged[0].tensor(cls.output_kind) - alone.tensor(cls.output_kind)).abs().max().item()
    assert diff <= BATCH_TOL, f"{model}: merged differs from alone by {diff:.3g}"
    assert not server.left_behind


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_rank_torchrun_server_merges_and_matches_singletons(tiny_cache, tmp_path):
    from tests.harness import ServerProcess, serve_args

    TINY_FLUX.ensure(tiny_cache)  # built once here, not raced by the ranks
    batching = dict(batching_mode="dynamic", batching_max_size=8, batching_delay_ms=200, enable_batching_metrics=True)
    server = ServerProcess(
        *serve_args("tiny/flux", tmp_path / "out", num_gpus=2, **batching),
        env={"TILECAST_CACHE": str(tiny_cache), "OMP_NUM_THREADS": "1"},
        ready_timeout=150.0,
    )
    try:
        with server.client(timeout=60.0) as client:
            requests = [dict(prompt=f"two ranks {i}", seed=i, return_tensor=True, **SMALL) for i in range(8)]
            results = generate_all(client, requests)
            assert client.health().world_size == 2
            assert client.stats()["batching"]["cumulative"]["dispatches"] < 8
            alone = client.generate(timeout=60.0, **requests[2])
            assert alone.info["batch_size"] == 1
            diff = (results[2].tensor("image") - alone.tensor("image")).abs().max().item()
            assert diff <= BATCH_TOL
    finally:
        server.stop()
    sizes = [int(m.group(1)) for m in DISPATCH.finditer(server.log())]
    assert sizes and max(sizes) > 1, server.log()[-3000:]
    assert not server.left_behind


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_batching_bench_reports_both_servers(tiny_cache, capsys):
    from tilecast.launcher.bench.batching import run_batching_bench

    TINY_FLUX.ensure(tiny_cache)
    report = run_batching_bench(
        "tiny/flux",
        num_clients=4,
        requests_per_client=2,
        **SMALL,
        steps=1,
        device="cpu",
        batching_delay_ms=100.0,
    )
    for mode in ("singleton", "dynamic"):
        row = report[mode]
        assert row["requests"] == 8 and row["errors"] == 0, row
        assert row["throughput_rps"] > 0 and 0 < row["p50_ms"] <= row["p95_ms"]
    assert report["singleton"]["merged_rate"] == 0.0
    assert report["dynamic"]["merged_rate"] > 0.0, report["dynamic"]
    assert report["throughput_ratio"] > 0
    out = capsys.readouterr().out
    assert "singleton" in out and "dynamic" in out and "ratio" in out
