"""``tilecast bench batching --peer diffusers``: diffusers alone on the bench's traffic, next to the servers."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tilecast.launcher import cli
from tilecast.launcher.bench.peer import measure_diffusers_peer
from tilecast.runtime.models.families.flux import TINY_FLUX

TINY_FIELDS = dict(width=32, height=32, num_inference_steps=1)


def _bench(*args: str):
    return CliRunner().invoke(cli.app, ["bench", "batching", "--model-path", "tiny/flux", "--device", "cpu", *args])


@pytest.mark.timeout(120)
def test_peer_times_one_at_a_time_and_offline_batch(tiny_cache):
    TINY_FLUX.ensure(tiny_cache)
    report = measure_diffusers_peer(
        "tiny/flux", num_clients=3, requests_per_client=2, fields=TINY_FIELDS, device="cpu", dtype="float32"
    )
    one, batch = report["one_at_a_time"], report["offline_batch"]
    assert (one["requests"], one["batch_size"]) == (6, 1)
    assert (batch["requests"], batch["batch_size"]) == (6, 3)
    for row in (one, batch):
        assert row["throughput_rps"] > 0 and row["p50_ms"] > 0 and row["wall_s"] > 0, row


def test_peer_refuses_a_model_that_is_not_a_diffusers_family():
    with pytest.raises(ValueError, match="--peer diffusers needs"):
        measure_diffusers_peer(
            "test/allreduce", num_clients=1, requests_per_client=1, fields=TINY_FIELDS, device="cpu", dtype="float32"
        )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--peer", "vllm"), "--peer must be one of diffusers or none, got 'vllm'"),
        (("--peer", "diffusers", "--num-gpus", "2"), "runs on one device; measure one rank only"),
        (("--dtype", "fp8"), "--dtype must be one of"),
    ],
    ids=["unknown-peer", "peer-on-two-gpus", "bad-dtype"],
)
def test_bad_bench_options_are_refused_before_anything_starts(args, message):
    result = _bench(*args)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_with_diffusers_peer_reports_every_row_and_ratio(tiny_cache, tmp_path):
    TINY_FLUX.ensure(tiny_cache)
    json_out = tmp_path / "bench.json"
    result = _bench(
        "--num-clients",
        "2",
        "--requests-per-client",
        "1",
        "--width",
        "64",
        "--height",
        "64",
        "--steps",
        "1",
        "--dtype",
        "float32",
        "--peer",
        "diffusers",
        "--json-out",
        str(json_out),
    )
    assert result.exit_code == 0, result.output
    for row in (
        "diffusers one at a time",
        "diffusers offline batch",
        "singleton",
        "dynamic",
        "ratio dynamic / diffusers offline batch",
        "ratio dynamic / diffusers one at a time",
        "ratio singleton / diffusers one at a time",
        "ratio dynamic / singleton",
    ):
        assert row in result.output, row
    report = json.loads(json_out.read_text())
    assert report["peer"] == "diffusers" and report["dtype"] == "float32"
    assert report["peer_one_at_a_time"]["requests"] == report["peer_offline_batch"]["requests"] == 2
    for mode in ("singleton", "dynamic"):
        assert report[mode]["requests"] == 2 and report[mode]["errors"] == 0, report[mode]
    for key in (
        "throughput_ratio",
        "dynamic_vs_peer_offline_batch",
        "dynamic_vs_peer_one_at_a_time",
        "singleton_vs_peer_one_at_a_time",
    ):
        assert report[key] > 0, (key, report[key])


def test_compile_is_passed_to_both_servers(monkeypatch):
    from tilecast.launcher.bench import batching as bench_batching

    seen = {}

    def fake(model_path, **kwargs):
        seen.update(kwargs)
        raise ValueError("stop here")

    monkeypatch.setattr(bench_batching, "run_batching_bench", fake)
    assert _bench("--compile", "--peer", "diffusers").exit_code == 2
    assert list(seen["extra_serve_args"]) == ["--compile"] and seen["peer"] == "diffusers"
    assert _bench().exit_code == 2 and list(seen["extra_serve_args"]) == []
