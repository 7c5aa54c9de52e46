"""Data-parallel replica groups (``--dp-degree``): rank 0 dispatches different batches to different
groups at once, each group's plan reaches only its ranks, results come back to rank 0.

Unit tests (no ranks) for the layout, the scheduler's multi-group dispatch, the per-group stuck
rule and the metrics; then real ``tilecast serve`` runs on gloo CPU ranks. The per-rank execution
record (``TILECAST_PLAN_LOG_DIR``: one JSON line per plan with group, job ids and wall-clock
window) is what shows which group ran what, and when.

Tolerance against one rank (tiny/flux, ``return_tensor``): max abs difference 1e-4 on the float
image (the ranks run with ``OMP_NUM_THREADS=1``, the in-process reference with torch's default
thread count, so fp32 sums may be reordered; the arithmetic is otherwise the same).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.harness import ServerProcess, outcomes_after_kill_9, serve_args, wait_until
from tilecast.client import Client
from tilecast.runtime.replicas import ServingShape
from tilecast.runtime.watchdog import ProgressBeat, Watchdog, WatchdogConfig
from tilecast.scheduler import protocol as P
from tilecast.scheduler.batching import BatchingConfig
from tilecast.scheduler.http_metrics import Exposition, scheduler_metrics
from tilecast.scheduler.scheduler import Scheduler

FLUX_TOL = 1e-4
SMALL = dict(width=32, height=32)


# ------------------------------------------------------------------------------------ units
def test_layout_explicit_derived_and_refused():
    assert ServingShape(num_gpus=2, dp_degree=2).layout().groups == ((0,), (1,))
    assert ServingShape(num_gpus=4, ulysses_degree=2, dp_degree=2).layout().groups == ((0, 1), (2, 3))
    assert ServingShape(num_gpus=4, ulysses_degree=2).layout().groups == ((0, 1), (2, 3))  # derived replicas
    assert ServingShape(num_gpus=4, ulysses_degree=2, tile_parallel=True).layout().groups == ((0, 1, 2, 3),)
    assert ServingShape(num_gpus=2, ulysses_degree=2).layout().groups == ((0, 1),)
    with pytest.raises(ValueError, match="num_gpus=2 is not DP 3"):
        ServingShape(num_gpus=2, dp_degree=3).layout()
    (error,) = ServingShape(num_gpus=4, ulysses_degree=2, dp_degree=2, tile_parallel=True).errors()
    assert "--tile-parallel" in error and "--dp-degree 2" in error
    (error,) = ServingShape(num_gpus=2, dp_degree=2, fsdp=True).errors()
    assert "--use-fsdp-inference" in error and "2 groups of 1 rank" in error
    assert ServingShape(num_gpus=4, ulysses_degree=2, dp_degree=2, fsdp=True).errors() == []


def test_preflight_names_a_dp_degree_that_does_not_fill_the_gpus():
    from tilecast.launcher.options import build_config
    from tilecast.launcher.preflight import topology_errors

    config = build_config({"model_path": "test/allreduce", "device": "cpu", "num_gpus": 4, "dp_degree": 2})
    assert (config.dp_degree, config.ulysses_degree) == (2, 2)  # the picker lays out one replica
    assert topology_errors(config) == []
    bad = build_config(
        {"model_path": "test/allreduce", "device": "cpu", "num_gpus": 2, "dp_degree": 3, "ulysses_degree": 1}
    )
    (error,) = topology_errors(bad)
    assert "DP 3" in error and "num_gpus=2" in error


class _Peer:
    authenticated, local = False, True


def _scheduler(groups, sent):
    sched = Scheduler(
        pipeline=_FakePipeline(),
        send=lambda peer, frames: None,
        batching=BatchingConfig(),
        max_queued=16,
        world_size=sum(len(g) for g in groups),
        groups=groups,
        dispatch=lambda group, plan: sent.append((group, plan)),
        cancel_plan=lambda group, seq: sent.append((group, ("cancel", seq))),
    )
    return sched


class _FakePipeline:
    model_name, family, task, upload_fields, max_batch_size = "fake", "fake", "probe", (), 1
    from tilecast.runtime.probe import ProbeParams as params_type

    def prepare(self, params, uploads):
        return params

    def batch_key(self, params):
        return {"size": params.size}


def _submit(sched, **params):
    sched._handle(("msg", _Peer(), P.encode(P.SubmitRequest(req_id=1, params=params))))
    sched._dispatch()


def test_scheduler_runs_different_batches_on_different_groups_and_reports_their_load():
    sent: list = []
    sched = _scheduler(((0,), (1,)), sent)
    _submit(sched, seed=1)
    assert sched.work.qsize() == 1 and sent == []  # group 0 first; group 1 not ready yet
    _submit(sched, seed=2)
    assert sent == [] and len(sched.table.queue) == 1
    sched._handle(("replica_ready", 1))
    sched._dispatch()
    ((group, plan),) = sent
    local = sched.work.get_nowait()
    assert group == 1 and plan.kind == "run" and plan.items[0].job_id != local.items[0].job_id
    stats = sched.stats()["groups"]
    assert [g["busy"] for g in stats] == [True, True] and [g["ranks"] for g in stats] == [[0], [1]]
    # cancelling the job of group 1 reaches group 1's leader
    sched._cancel(sched.table.get(plan.items[0].job_id), "test")
    assert sent[-1] == (1, ("cancel", plan.seq)) and sched.plan_cancelled(plan.seq)
    # a finished plan frees its group only; the next job goes there
    sched._handle(("done", local.seq, [_output()]))
    _submit(sched, seed=3)
    assert sched.work.qsize() == 1
    stats = sched.stats()["groups"]
    assert stats[0]["jobs_completed"] == 1 and stats[0]["plans_done"] == 1 and stats[1]["plans_done"] == 0
    # shutdown waits for both groups, then stops both
    sched.begin_shutdown("test")
    sched._dispatch()
    assert not sched.stopped.is_set()
    sched._handle(("done", sched.work.get_nowait().seq, [_output()]))
    sched._handle(("done", plan.seq, "cancelled"))
    sched._dispatch()
    assert sched.stopped.is_set() and sched.work.get_nowait().kind == "stop" and sent[-1][1].kind == "stop"
    text = _metrics(sched.stats())
    assert 'tilecast_replica_busy{group="0"} 0' in text and 'tilecast_replica_jobs_done_total{group="1"} 1' in text


def test_a_released_batch_is_shared_by_the_idle_groups():
    """Five compatible requests released as one full batch while three groups idle: three plans
    (2 + 2 + 1, in queue order), not one plan of five while two replicas wait."""

    class Batchable(_FakePipeline):
        max_batch_size = 8

    sent: list = []
    sched = Scheduler(
        pipeline=Batchable(),
        send=lambda peer, frames: None,
        batching=BatchingConfig(mode="dynamic", max_size=5, delay_ms=60_000.0),
        max_queued=16,
        world_size=3,
        groups=((0,), (1,), (2,)),
        dispatch=lambda group, plan: sent.append((group, plan)),
        cancel_plan=lambda group, seq: None,
    )
    for group in (1, 2):
        sched._handle(("replica_ready", group))
    for seed in range(5):
        _submit(sched, seed=seed)
    local = sched.work.get_nowait()
    shares = [local.items] + [plan.items for _, plan in sent]
    assert [len(items) for items in shares] == [2, 2, 1]
    assert sorted(g for g, _ in sent) == [1, 2]
    order = [item.job_id for items in shares for item in items]
    assert order == list(sched.table.jobs)  # submission order, each job once
    assert sched.stats()["batching"]["cumulative"]["requests"] == 5


def _output():
    from tilecast.runtime.pipeline import Output

    return Output()


def _metrics(stats) -> str:
    out = Exposition()
    scheduler_metrics(out, stats)
    return out.text()


def test_watchdog_stuck_rule_applies_per_group():
    now = [0.0]
    dog = Watchdog(
        world_size=4,
        beat=ProgressBeat(),
        config=WatchdogConfig(stuck_timeout_s=5.0),
        on_fatal=lambda reason: None,
        clock=lambda: now[0],
        groups=((0, 1), (2, 3)),
    )
    try:
        for rank in range(4):
            dog._observe(rank, 1, True)
        now[0] = 6.0
        for rank in (1, 2, 3):
            dog.last_seen[rank] = now[0]
        dog._observe(0, 2, True)  # group 0 moves, group 1 is still: stuck all the same
        dog._observe(1, 2, True)
        assert "rank 2 made no progress" in dog.check() or "rank 3 made no progress" in dog.check()
    finally:
        dog._sock.close()


# ------------------------------------------------------------------------------------ real ranks
def _plans(log_dir: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(log_dir.glob("rank*.jsonl")) for line in path.read_text().splitlines()]


def _plans_of_every_rank(log_dir: Path, num_ranks: int, timeout: float = 30.0) -> list[dict]:
    """``_plans`` once each of ``num_ranks`` ranks has recorded every plan its group ran. Every rank
    writes its record after its group agrees on the outcome, and the leader answers the client right
    after its own, so another rank of the group may still be writing when the results arrive (and a
    server stopped then kills it before it has: a rank exits at once on SIGTERM)."""

    def settled() -> list[dict] | None:
        try:
            records = _plans(log_dir)
        except json.JSONDecodeError:  # a line being written
            return None
        seqs: dict[int, dict[int, set]] = {}
        for record in records:
            seqs.setdefault(record["group"], {}).setdefault(record["rank"], set()).add(record["seq"])
        if sum(len(ranks) for ranks in seqs.values()) < num_ranks:
            return None
        return records if all(len({frozenset(s) for s in ranks.values()}) == 1 for ranks in seqs.values()) else None

    return wait_until(settled, timeout, f"plan records of all {num_ranks} ranks")


def _flux_server(tiny_cache, tmp_path, plans: Path, *, num_gpus: int, ready_timeout: float, **layout) -> ServerProcess:
    """tiny/flux on ``num_gpus`` CPU ranks of one thread each, laid out by ``layout``
    (``dp_degree=2``, ...), each rank recording its plans in ``plans``."""
    return ServerProcess(
        *serve_args("tiny/flux", tmp_path / "out", num_gpus=num_gpus, **layout),
        env={"TILECAST_CACHE": str(tiny_cache), "OMP_NUM_THREADS": "1", "TILECAST_PLAN_LOG_DIR": str(plans)},
        ready_timeout=ready_timeout,
    )


def _generate_at_once(server: ServerProcess, requests: list[dict], timeout: float) -> list:
    """Every request from a thread of its own, all at once; their results, in order."""
    with server.client(timeout=timeout) as client:
        with ThreadPoolExecutor(max_workers=len(requests)) as pool:
            return list(pool.map(lambda fields: client.generate(timeout=timeout, **fields), requests))


def _assert_flux_matches_one_rank(requests: list[dict], results: list, output_dir: Path) -> None:
    """Each result's image equals, within FLUX_TOL, the one a one-rank in-process server makes of its
    request."""
    from tilecast.runtime.config import ServeConfig
    from tilecast.runtime.inproc import InProcessServer

    config = ServeConfig(model_path="tiny/flux", device="cpu", port=0, output_dir=output_dir)
    with InProcessServer(config) as one, Client(one.endpoint, timeout=120.0) as client:
        for fields, result in zip(requests, results):
            alone = client.generate(timeout=120.0, **fields)
            diff = (result.tensor("image") - alone.tensor("image")).abs().max().item()
            assert diff <= FLUX_TOL, (fields["seed"], diff)


@pytest.mark.timeout(300)
def test_two_replica_groups_serve_disjoint_requests_concurrently_and_match_one_rank(tiny_cache, tmp_path):
    from tilecast.runtime.models.families.flux import TINY_FLUX

    TINY_FLUX.ensure(tiny_cache)  # built once here, not raced by the ranks
    plans = tmp_path / "plans"
    plans.mkdir()
    requests = [
        dict(prompt=f"replica {i}", seed=i, num_inference_steps=24, return_tensor=True, **SMALL) for i in range(8)
    ]
    server = _flux_server(tiny_cache, tmp_path, plans, num_gpus=2, dp_degree=2, ready_timeout=150.0)
    try:
        results = _generate_at_once(server, requests, timeout=120.0)
        with server.client() as client:
            groups = client.stats()["groups"]
    finally:
        server.stop()
    assert not server.left_behind
    assert all(r.job.state == "completed" for r in results)
    records = _plans(plans)
    by_group = {g: [r for r in records if r["group"] == g] for g in (0, 1)}
    assert all(r["rank"] == r["group"] for r in records)  # a plan reached only its group's rank
    jobs = {g: {j for r in rs for j in r["job_ids"]} for g, rs in by_group.items()}
    assert jobs[0] and jobs[1] and not jobs[0] & jobs[1], jobs  # disjoint requests
    assert jobs[0] | jobs[1] == {r.job.job_id for r in results}
    overlap = any(a["start"] < b["end"] and b["start"] < a["end"] for a in by_group[0] for b in by_group[1])
    assert overlap, records  # the two groups computed at the same time
    assert [g["jobs_completed"] for g in groups] == [len(jobs[0]), len(jobs[1])], groups
    _assert_flux_matches_one_rank(requests, results, tmp_path / "one")


def _probe_server(tmp_path, plans: Path | None = None) -> ServerProcess:
    """The probe on two replica groups of one CPU rank each, declared dead after 5 s without a
    heartbeat; with ``plans``, each rank records its plans there."""
    env = {"TILECAST_PLAN_LOG_DIR": str(plans)} if plans is not None else {}
    args = serve_args("test/allreduce", tmp_path / "out", num_gpus=2, dp_degree=2, heartbeat_timeout_s=5)
    return ServerProcess(*args, env=env)


@pytest.mark.timeout(150)
def test_progress_and_cancel_in_each_group(tmp_path):
    """Both groups run a long job at once; progress moves in both; cancelling stops each at a cancel
    point of its own group (nothing written), and both groups serve the next request."""
    plans = tmp_path / "plans"
    plans.mkdir()
    server = _probe_server(tmp_path, plans=plans)
    try:
        with server.client() as client:
            jobs = [client.submit(size=2, steps=200, sleep_s=0.05, seed=i) for i in range(2)]
            wait_until(lambda: all(0 < client.status(j).progress < 1 for j in jobs), 30, "progress in both groups")
            assert [g["busy"] for g in client.stats()["groups"]] == [True, True]
            for job in jobs:
                client.cancel(job)
            wait_until(lambda: all(client.status(j).state == "cancelled" for j in jobs), 10, "both cancels")
            assert all(client.status(j).progress < 1 for j in jobs)
            assert not list((tmp_path / "out").glob("*.json"))
            after = [client.generate(size=2, seed=7 + i, timeout=30) for i in range(2)]
            assert all(r.job.state == "completed" for r in after)
    finally:
        server.stop()
    records = _plans(plans)
    assert sorted(r["outcome"] for r in records) == ["cancelled", "cancelled", "ok", "ok"], records
    assert {r["group"] for r in records if r["outcome"] == "cancelled"} == {0, 1}
    assert not server.left_behind


@pytest.mark.timeout(150)
def test_kill_9_in_one_group_fails_every_job_in_every_group(tmp_path):
    server = _probe_server(tmp_path)
    try:
        with server.client() as client:
            jobs = [client.submit(size=2, steps=60, sleep_s=0.25, seed=i) for i in range(4)]
            wait_until(lambda: [client.status(j).state for j in jobs[:2]] == ["running", "running"], 30, "two running")
        outcomes, elapsed = outcomes_after_kill_9(server, 1, jobs, timeout=40)
        assert set(outcomes) == set(jobs)
        for job_id, outcome in outcomes.items():
            assert outcome.startswith(("failed", "dead")), (job_id, outcome)
        assert elapsed < 30, f"jobs took {elapsed:.1f} s to fail"
        assert server.wait(timeout=30) != 0, server.log()
        assert not server.leftovers_after(10), "rank processes were left behind"
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_dp2_by_ulysses2_k6sr_groups_run_their_own_plans(tmp_path):
    """4 ranks, 2 groups of Ulysses 2 on tiny/k6sr. The same request on both groups gives the same
    frames, and one rank's within tests/test_generate_topologies.py's tolerance (1 level on at most 0.1% of the values)."""
    from tilecast.runtime.config import ServeConfig
    from tilecast.runtime.inproc import InProcessServer
    from tilecast.runtime.synthetic import write_test_video

    video = write_test_video(tmp_path / "clip.mp4", 64, 64, 9, 24.0)
    plans = tmp_path / "plans"
    plans.mkdir()
    server = ServerProcess(
        *serve_args(
            "tiny/k6sr", tmp_path / "out", num_gpus=4, dp_degree=2, ulysses_degree=2, allowed_video_dir=tmp_path
        ),
        env={"TILECAST_PLAN_LOG_DIR": str(plans)},
        ready_timeout=240.0,
    )
    request = dict(video_path=str(video), sr_resolution_scale=2, num_inference_steps=2, seed=3, return_frames=True)
    try:
        first, second = _generate_at_once(server, [request, request], timeout=240.0)
        records = _plans_of_every_rank(plans, 4)
    finally:
        server.stop()
    assert not server.left_behind
    ran = {r["group"]: {tuple(r["job_ids"])} for r in records}
    assert set(ran) == {0, 1} and ran[0] != ran[1], records
    assert {(r["rank"], r["group"]) for r in records} == {(0, 0), (1, 0), (2, 1), (3, 1)}
    assert (first.tensor("frames") == second.tensor("frames")).all()
    config = ServeConfig(
        model_path="tiny/k6sr", device="cpu", port=0, output_dir=tmp_path / "one", allowed_video_dirs=(tmp_path,)
    )
    with InProcessServer(config) as one, Client(one.endpoint, timeout=240.0) as client:
        alone = client.generate(timeout=240.0, **request).tensor("frames")
    diff = (first.tensor("frames").int() - alone.int()).abs()
    assert diff.max().item() <= 1 and (diff > 0).float().mean().item() <= 1e-3


@pytest.mark.timeout(240)
def test_dp2_by_ulysses2_flux_matches_one_rank(tiny_cache, tmp_path):
    """4 ranks, 2 groups of Ulysses 2 on tiny/flux: each group splits the image tokens over its two
    ranks, the groups run different requests, and every output equals one rank's within FLUX_TOL."""
    from tilecast.runtime.models.families.flux import TINY_FLUX

    TINY_FLUX.ensure(tiny_cache)
    plans = tmp_path / "plans"
    plans.mkdir()
    requests = [
        dict(prompt=f"grid {i}", seed=10 + i, num_inference_steps=2, return_tensor=True, **SMALL) for i in range(4)
    ]
    server = _flux_server(tiny_cache, tmp_path, plans, num_gpus=4, dp_degree=2, ulysses_degree=2, ready_timeout=200.0)
    try:
        results = _generate_at_once(server, requests, timeout=200.0)
        records = _plans_of_every_rank(plans, 4)
    finally:
        server.stop()
    assert not server.left_behind
    assert {(r["rank"], r["group"]) for r in records} == {(0, 0), (1, 0), (2, 1), (3, 1)}, records
    _assert_flux_matches_one_rank(requests, results, tmp_path / "one")
