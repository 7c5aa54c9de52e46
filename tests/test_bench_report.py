"""The helper every ``tilecast bench`` shares: timing, peer comparison, the report (no ranks, no GPU)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest
import torch

from tilecast.launcher.bench import report
from tilecast.launcher.bench.batching import PEER_RATIOS, bench_table_rows


def test_time_repeated_warms_up_then_times_each_call():
    events = []

    def call():
        events.append("call")
        time.sleep(0.002)
        return len(events)

    timing = report.time_repeated(call, repeats=3, warmup=2, after_warmup=lambda: events.append("reset"))
    assert events == ["call", "call", "reset", "call", "call", "call"]
    assert timing.num_calls == 3 and len(timing.calls_s) == 3 and timing.result == 6
    assert all(t >= 0.002 for t in timing.calls_s) and timing.warmup_s >= 0.004
    assert timing.total_s >= sum(timing.calls_s) and timing.median_s == sorted(timing.calls_s)[1]
    assert timing.calls_s[timing.median_low_index] == timing.median_s


def test_time_repeated_as_one_loop_reports_the_mean():
    timing = report.time_repeated(lambda: time.sleep(0.001), repeats=4, warmup=0, device="cpu", each=False)
    assert timing.calls_s == () and timing.warmup_s < 0.001 and timing.num_calls == 4
    assert timing.mean_s == timing.median_s == pytest.approx(timing.total_s / 4) and timing.mean_s >= 0.001
    with pytest.raises(ValueError, match="no per-call times"):
        _ = timing.median_low_index


@pytest.mark.parametrize("each", [True, False])
def test_time_repeated_runs_during_only_around_the_timed_calls_even_when_one_raises(each):
    events = []

    class During:
        def start(self):
            events.append("start")

        def stop(self):
            events.append("stop")

    report.time_repeated(lambda: events.append("call"), repeats=2, warmup=1, each=each, during=During())
    assert events == ["call", "start", "call", "call", "stop"]
    events.clear()
    calls = iter([None, ValueError("the second timed call fails")])

    def failing():
        events.append("call")
        if isinstance(outcome := next(calls, None), Exception):
            raise outcome

    with pytest.raises(ValueError, match="second timed call"):
        report.time_repeated(failing, repeats=2, warmup=0, each=each, during=During())
    assert events == ["start", "call", "call", "stop"]


def test_time_calls_times_different_calls_in_order():
    seen = []
    timing = report.time_calls([lambda i=i: seen.append(i) or i for i in range(3)], device=torch.device("cpu"))
    assert seen == [0, 1, 2] and timing.result == 2 and len(timing.calls_s) == 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [(dict(repeats=0), "repeats must be an integer >= 1, got 0"), (dict(repeats=1, warmup=-1), "warmup must be")],
)
def test_bad_repeat_counts_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        report.time_repeated(lambda: None, **kwargs)


def test_no_calls_and_cuda_events_without_a_gpu_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="at least one call"):
        report.time_calls([])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        report.time_calls([lambda: None], cuda_events=True)


def test_peer_ratio_and_output_comparison():
    assert report.ratio(1.0, 4.0) == 0.25 and math.isnan(report.ratio(1.0, 0.0))
    reference = torch.tensor([0.0, 0.5, -2.0, 1.0])
    out = reference + torch.tensor([0.0, 0.0, 0.02, 0.0])
    mse = 0.02**2 / 4
    assert report.psnr_db(out, reference) == pytest.approx(10 * math.log10(4.0 / mse))
    assert report.psnr_db(out, reference, peak=1.0) == pytest.approx(10 * math.log10(1.0 / mse))
    assert report.psnr_db(reference.half(), reference) == float("inf")
    assert report.max_rel_diff(out, reference) == pytest.approx(0.01)
    with pytest.raises(ValueError, match=r"shapes \(4,\) and \(2, 2\)"):
        report.psnr_db(out, reference.view(2, 2))


def test_table_and_json(capsys, tmp_path):
    assert [report.fmt(v) for v in (1.23456, 0.001234, 0.0, None, 7, "x")] == [
        "1.235",
        "1.23e-03",
        "0.000",
        "",
        "7",
        "x",
    ]
    rows = [{"side": "diffusers", "e2e_s": 2.0}, {"side": "tilecast", "e2e_s": 1.0, "ratio": 0.5}]
    report.print_table(rows, ["side", "e2e_s", "ratio"], "a title")
    printed = capsys.readouterr().out
    assert "a title" in printed and "diffusers" in printed and "0.500" in printed and "2.000" in printed
    report.print_table([{"side": "fa", "error": "install tilecast[flash]"}], ["side", "error"], "errors")
    assert "tilecast[flash]" in capsys.readouterr().out  # a cell is text, not rich markup
    with pytest.raises(ValueError, match="2 headers for 3 columns"):
        report.print_table(rows, ["side", "e2e_s", "ratio"], "t", headers=["a", "b"])
    report.save_json(rows, None)
    report.save_json(rows, tmp_path / "rows.json")
    assert json.loads((tmp_path / "rows.json").read_text()) == rows


def test_batching_report_rows_name_every_mode_and_ratio():
    server = dict(
        requests=4, errors=0, throughput_rps=2.0, p50_ms=10.0, p95_ms=12.0, avg_batch_size=2.0, merged_rate=0.5
    )
    peer = dict(requests=4, throughput_rps=1.0, p50_ms=20.0, batch_size=1.0)
    results = dict(
        peer="diffusers",
        singleton=server,
        dynamic=server,
        peer_one_at_a_time=peer,
        peer_offline_batch=peer,
        throughput_ratio=1.0,
        p50_ratio=1.0,
        p95_ratio=1.0,
        **dict.fromkeys(PEER_RATIOS, 2.0),  # every ratio to the peer
    )
    rows = bench_table_rows(results)
    assert [row["mode"] for row in rows] == [
        "diffusers one at a time",
        "diffusers offline batch",
        "singleton",
        "dynamic",
        "ratio dynamic / singleton",
        "ratio dynamic / diffusers offline batch",
        "ratio dynamic / diffusers one at a time",
        "ratio singleton / diffusers one at a time",
    ]
    assert rows[3]["merged"] == "50%" and rows[-1]["throughput (req/s)"] == "2.00x"


def test_bench_topologies_parse_and_each_gets_its_ratios_to_one_rank():
    from tilecast.launcher.bench.batching import BenchTopology

    assert BenchTopology.parse("dp2") == BenchTopology(num_gpus=2, dp_degree=2)
    assert BenchTopology.parse("ulysses2") == BenchTopology(num_gpus=2, ulysses_degree=2)
    grid = BenchTopology.parse("DP2xUlysses2")
    assert (grid.num_gpus, grid.dp_degree, grid.ulysses_degree, grid.label) == (4, 2, 2, "4 ranks dp 2 x ulysses 2")
    for bad in ("dp", "ring2", "dp0", "dp2xdp2", ""):
        with pytest.raises(ValueError, match="expected dp<N>"):
            BenchTopology.parse(bad)

    def server(rps):
        return dict(
            requests=4, errors=0, throughput_rps=rps, p50_ms=10.0, p95_ms=12.0, avg_batch_size=1.0, merged_rate=0
        )

    ratios = dict(throughput_ratio=1.0, p50_ratio=1.0, p95_ratio=1.0)
    one = dict(topology="1 rank", singleton=server(1.0), dynamic=server(1.0), **ratios)
    dp = dict(
        topology="2 ranks dp 2",
        singleton=server(2.0),
        dynamic=server(2.0),
        **ratios,
        vs_one_rank={mode: dict(ratios, throughput_ratio=2.0) for mode in ("singleton", "dynamic")},
    )
    rows = bench_table_rows(dict(topologies=[one, dp], **ratios))
    assert [row["mode"] for row in rows] == [
        "1 rank: singleton",
        "1 rank: dynamic",
        "1 rank: ratio dynamic / singleton",
        "2 ranks dp 2: singleton",
        "2 ranks dp 2: dynamic",
        "2 ranks dp 2: ratio dynamic / singleton",
        "ratio 2 ranks dp 2 / 1 rank (singleton)",
        "ratio 2 ranks dp 2 / 1 rank (dynamic)",
    ]
    assert rows[-1]["throughput (req/s)"] == "2.00x"


@pytest.mark.timeout(60)
def test_mounting_bench_imports_no_torch():
    code = (
        "import sys, tilecast.launcher.bench, tilecast.launcher.bench.cli, tilecast.launcher.bench.placement; "
        "print(sorted(m for m in ('torch', 'diffusers', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert "torch" not in out.stdout and "diffusers" not in out.stdout, out.stdout
