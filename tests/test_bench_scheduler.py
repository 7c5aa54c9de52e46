"""``tilecast bench scheduler`` on tiny sizes (100 queued, a 1 MiB upload): every row and column it
reports, and its refusals. CPU only; one in-process ``test/allreduce`` server."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tilecast.launcher import cli
from tilecast.launcher.bench.scheduler import DISPATCH_COLUMNS, FLOOR, GATHERS, SCENARIOS, WIRE_COLUMNS


def _bench(*args: str):
    return CliRunner().invoke(cli.app, ["bench", "scheduler", *args])


@pytest.mark.timeout(180)
def test_bench_scheduler_reports_decisions_round_trips_and_the_wire(tmp_path):
    json_out = tmp_path / "scheduler.json"
    result = _bench(
        *("--num-queued", "100", "--decisions", "20", "--round-trips", "20"),
        *("--upload-mb", "1", "--uploads", "2", "--repeats", "2", "--json-out", str(json_out)),
    )
    assert result.exit_code == 0, result.output
    assert "rank 0's batch decision at 100 queued" in result.output and "round trips and the wire" in result.output
    report = json.loads(json_out.read_text())

    dispatch = report["dispatch"]
    assert [(row["scenario"], row["gather"]) for row in dispatch] == [(s, g) for s in SCENARIOS for g in GATHERS]
    for row in dispatch:
        assert set(DISPATCH_COLUMNS) <= set(row), row
        assert row["queue_depth"] == "100" and row["decisions"] == 40 and row["same_batches"] is True, row
        assert 1 <= row["avg_batch"] <= 8 and row["batch_keys"] > 1 and row["families"] >= 1, row
        for kind in ("decision", "dispatch"):
            assert 0 < row[f"{kind}_p50_us"] <= row[f"{kind}_p95_us"] <= row[f"{kind}_max_us"], row
            low, high = (float(x) for x in row[f"{kind}_p50_spread_us"].split("-"))
            assert low <= high, row
        assert row["decision_p50_us"] <= row["dispatch_p50_us"], row  # each decision is part of its dispatch
    mixed = next(row for row in dispatch if row["scenario"] == "mixed")
    assert mixed["families"] >= 10  # every text-to-image family of the registry
    assert {row["families"] for row in dispatch if row["scenario"] != "mixed"} == {1}

    wire = {row["measure"]: row for row in report["wire"]}
    assert list(wire) == [
        "protocol.encode, 1 MiB upload",
        "protocol.decode, 1 MiB upload",
        "bytes copy of the payload, 1 MiB upload",
        "client health",
        "client status",
        "client submit 1 MiB upload",
        FLOOR,
    ]
    for name, row in wire.items():
        assert set(WIRE_COLUMNS) - {"gb_per_s", "ratio_to_floor"} <= set(row), row
        assert 0 < row["p50_us"] <= row["p95_us"] <= row["max_us"], row
        assert ("gb_per_s" in row) == (name.endswith("upload") or name == FLOOR) and row.get("gb_per_s", 1) > 0, row
    assert wire["client submit 1 MiB upload"]["ratio_to_floor"] > 0
    assert wire["client health"]["calls"] == wire["client status"]["calls"] == 40
    assert wire["client submit 1 MiB upload"]["calls"] == wire[list(wire)[-1]]["calls"] == 4


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--scenario", "busy"), "--scenario 'busy': choose from mixed, one-model, one-size"),
        (("--decisions", "0", "--no-server"), "decisions must be an integer >= 1, got 0"),
        (("--upload-mb", "0", "--no-server", "--num-queued", "10", "--decisions", "1"), "upload size must be > 0"),
    ],
    ids=["unknown-scenario", "no-decisions", "empty-upload"],
)
def test_bad_options_are_refused(args, message):
    result = _bench(*args)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())


def test_queue_position_of_a_job_that_left_the_queue_formats_nothing(monkeypatch):
    """What the status round trip found: a failed ``list.index`` formatted the job's repr (its output
    tensors included) into the error it then discarded, 0.2 ms of every ``status`` of a finished job."""
    from tilecast.scheduler.jobs import COMPLETED, Job, JobTable

    table = JobTable(max_queued=4)
    jobs = [Job(id=f"job_{i}", params=None, wire_params={}, uploads={}) for i in range(3)]
    for job in jobs:
        assert table.add(job) is None
    assert [table.position(job) for job in jobs] == [0, 1, 2]
    table.start(jobs[:1])
    table.finish(jobs[1], COMPLETED)

    def no_repr(self):
        raise AssertionError("repr(job) was formatted")

    monkeypatch.setattr(Job, "__repr__", no_repr)
    assert [table.position(job) for job in jobs] == [None, None, 0]
