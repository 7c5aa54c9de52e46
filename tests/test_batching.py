"""Dynamic batching on rank 0: batch selection, stop reasons, rejects, deadlines and the metrics lines.

Pure unit tests on a fake clock; no torch, no ranks.
"""

from __future__ import annotations

import collections
import logging
import random
import subprocess
import sys

import pytest

from tilecast.runtime.config import ServeConfig
from tilecast.scheduler.batching import (
    Batcher,
    BatchingConfig,
    Dispatch,
    QueuedRequest,
    first_difference,
    gather,
    gather_by_scan,
    key_token,
)
from tilecast.scheduler.batching_metrics import (
    BatchMetrics,
    format_dispatch_line,
    format_top_rejects,
    percentile_nearest_rank,
)
from tilecast.scheduler.batching_rules import BatchingRules

FLUX = "black-forest-labs/FLUX.1-dev"
QWEN = "Qwen/Qwen-Image"


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def req(
    job_id: str,
    t: float,
    *,
    model: str = FLUX,
    task: str = "t2i",
    res: str | None = "1024x1024",
    family: int = 8,
    **key_overrides,
) -> QueuedRequest:
    width, height = (res or "0x0").split("x")
    key = {
        "width": int(width),
        "height": int(height),
        "num_inference_steps": 28,
        "guidance_scale": 3.5,
        "output_format": "png",
    }
    key.update(key_overrides)
    return QueuedRequest(
        job_id=job_id, model=model, task=task, key=key, resolution=res, enqueued_at=t, family_max=family
    )


def batcher(
    clock: FakeClock,
    *,
    mode: str = "dynamic",
    max_size: int = 8,
    delay_ms: float = 5.0,
    rules: list[dict] | None = None,
) -> Batcher:
    parsed = BatchingRules.from_dict({"schema_version": 1, "rules": rules}) if rules is not None else None
    return Batcher(BatchingConfig(mode=mode, max_size=max_size, delay_ms=delay_ms, rules=parsed), clock=clock)


def take(queue: list[QueuedRequest], dispatch: Dispatch) -> None:
    """What the scheduler loop does with a dispatch: drop its requests, keep the rest in order."""
    chosen = set(dispatch.job_ids)
    queue[:] = [r for r in queue if r.job_id not in chosen]


# ---- stop reasons ------------------------------------------------------------------------


def test_full_batch_dispatches_at_once_with_max_size():
    clock = FakeClock(10.0)
    queue = [req(f"j{i}", 10.0) for i in range(5)]
    d = batcher(clock, max_size=3).select(queue)
    assert d.job_ids == ["j0", "j1", "j2"]
    assert (d.size, d.cap, d.size_limit, d.stop_reason, d.full) == (3, 3, 3, "max_size", True)
    assert d.queue_wait_ms == 0.0


def test_partial_batch_waits_for_the_delay_then_dispatches_with_delay():
    clock = FakeClock(0.0)
    b = batcher(clock, delay_ms=5.0)
    queue = [req("a", 0.0), req("b", 0.001)]
    clock.now = 0.0049
    assert b.select(queue) is None
    clock.now = 0.00512
    d = b.select(queue)
    assert d.job_ids == ["a", "b"] and d.stop_reason == "delay" and not d.full
    assert d.queue_wait_ms == pytest.approx(5.12)
    assert format_dispatch_line(d, 8) == (
        "Dynamic batch dispatch: size=2/8, user_max=8, queue_wait=5.12ms, stop_reason=delay"
    )


def test_rule_cap_one_dispatches_at_once_with_config_cap_1():
    clock = FakeClock(1.00004)
    b = batcher(clock, rules=[{"model_contains": "Qwen-Image", "resolution": "1024x1024", "max_batch_size": 1}])
    queue = [req("q1", 1.0, model=QWEN), req("q2", 1.0, model=QWEN)]
    d = b.select(queue)
    assert d.job_ids == ["q1"] and d.stop_reason == "config_cap:1" and d.cap == 1 and d.rejects == {}
    assert format_dispatch_line(d, 8) == (
        "Dynamic batch dispatch: size=1/8, user_max=8, queue_wait=0.04ms, stop_reason=config_cap:1"
    )


def test_rule_cap_reached_reports_config_cap_n():
    clock = FakeClock(0.0)
    b = batcher(clock, rules=[{"model_contains": "FLUX", "max_batch_size": 2}])
    queue = [req("a", 0.0), req("b", 0.0), req("c", 0.0)]
    d = b.select(queue)
    assert d.job_ids == ["a", "b"] and d.stop_reason == "config_cap:2" and (d.cap, d.size_limit) == (2, 8)
    assert not d.full


def test_rule_cap_not_below_the_size_limit_reports_max_size():
    clock = FakeClock(0.0)
    b = batcher(clock, max_size=2, rules=[{"model_contains": "FLUX", "max_batch_size": 4}])
    d = b.select([req("a", 0.0), req("b", 0.0), req("c", 0.0)])
    assert d.job_ids == ["a", "b"] and d.stop_reason == "max_size"


def test_family_max_limits_the_batch():
    clock = FakeClock(0.0)
    b = batcher(clock, max_size=8)
    d = b.select([req(f"j{i}", 0.0, family=4) for i in range(6)])
    assert (d.size, d.size_limit, d.stop_reason) == (4, 4, "max_size")
    # A family that does not batch: every request alone, at once.
    d = b.select([req("sr1", 0.0, task="sr", family=1), req("sr2", 0.0, task="sr", family=1)])
    assert (d.job_ids, d.size_limit, d.stop_reason) == (["sr1"], 1, "max_size")


@pytest.mark.parametrize(("mode", "max_size"), [("off", 8), ("off", 1), ("dynamic", 1)])
def test_off_or_max_size_1_gives_singletons_at_once(mode, max_size):
    clock = FakeClock(0.0)
    b = batcher(clock, mode=mode, max_size=max_size)
    queue = [req(f"j{i}", 0.0) for i in range(3)]
    seen = []
    while queue:
        d = b.select(queue)
        assert d is not None and d.size == 1 and d.size_limit == 1 and d.stop_reason == "max_size"
        seen += d.job_ids
        take(queue, d)
    assert seen == ["j0", "j1", "j2"]


def test_zero_delay_dispatches_whatever_is_there():
    clock = FakeClock(0.0)
    d = batcher(clock, delay_ms=0).select([req("a", 0.0), req("b", 0.0, num_inference_steps=4), req("c", 0.0)])
    assert d.job_ids == ["a", "c"] and d.stop_reason == "delay"


def test_empty_queue():
    b = batcher(FakeClock())
    assert b.select([]) is None and b.next_deadline([]) is None


# ---- compatibility, rejects and queue order ----------------------------------------------


def test_rejects_count_the_first_differing_field():
    clock = FakeClock(1.0)
    queue = [
        req("head", 0.0),
        req("m", 0.0, model="other/model"),
        req("t", 0.0, task="t2v"),
        req("r1", 0.0, res="512x512"),
        req("r2", 0.0, res="768x768", num_inference_steps=4),  # resolution comes first
        req("s", 0.0, num_inference_steps=4, guidance_scale=1.0),  # key order: steps before guidance
        req("g", 0.0, guidance_scale=1.0),
        req("ok", 0.0),
    ]
    d = batcher(clock).select(queue)
    assert d.job_ids == ["head", "ok"]
    assert d.rejects == {"model": 1, "task": 1, "resolution": 2, "num_inference_steps": 1, "guidance_scale": 1}


def test_first_difference_on_keys_of_different_shape():
    a = req("a", 0.0)
    b = QueuedRequest(
        job_id="b",
        model=FLUX,
        task="t2i",
        key={**a.key, "true_cfg": 4.0},
        resolution="1024x1024",
        enqueued_at=0.0,
        family_max=8,
    )
    assert first_difference(a, b) == "true_cfg"
    assert first_difference(b, a) == "true_cfg"
    assert first_difference(a, req("c", 1.0)) is None


def test_head_gathers_from_anywhere_and_the_rest_keeps_fifo_order():
    clock = FakeClock(0.0)
    b = batcher(clock, max_size=8)
    queue = [
        req("a1", 0.0),
        req("b1", 0.001, res="512x512"),
        req("a2", 0.002),
        req("b2", 0.003, res="512x512"),
        req("a3", 0.004),
        req("c1", 0.005, res="768x768"),
    ]
    clock.now = 0.006
    d = b.select(queue)
    assert d.job_ids == ["a1", "a2", "a3"] and d.rejects == {"resolution": 3}
    take(queue, d)
    assert [r.job_id for r in queue] == ["b1", "b2", "c1"]
    d = b.select(queue)
    assert d is not None and d.job_ids == ["b1", "b2"]  # b1 has waited past the delay already


def test_head_is_always_the_oldest_even_when_a_later_group_is_full():
    clock = FakeClock(0.0)
    b = batcher(clock, max_size=2)
    queue = [req("a", 0.0), req("b1", 0.0, res="512x512"), req("b2", 0.0, res="512x512")]
    clock.now = 0.001
    assert b.select(queue) is None  # a waits for company; b1+b2 do not jump the queue
    clock.now = 0.005
    assert b.select(queue).job_ids == ["a"]


def test_gathering_stops_at_the_cap_and_later_requests_keep_their_place():
    clock = FakeClock(0.0)
    queue = [req("a", 0.0), req("x", 0.0, res="512x512"), req("b", 0.0), req("c", 0.0), req("y", 0.0, res="512x512")]
    d = batcher(clock, max_size=2).select(queue)
    assert d.job_ids == ["a", "b"] and d.rejects == {"resolution": 1}


# ---- deadlines -------------------------------------------------------------------------


_NAN = float("nan")
KEY_POOLS = {
    "width": lambda: [1024, 1024, 1024.0, True, 512],
    "num_inference_steps": lambda: [28, 28, 28.0, 2**70, None],
    "guidance_scale": lambda: [0.0, 0.0, -0.0, False, 3.5],
    "image_sizes": lambda: [[1, 2], [1, 2], (1, 2), [1.0, 2], [[1, 2]]],
    "odd": lambda: ["a", [_NAN], [_NAN], [float("nan")], _NAN, {"x": 1}, {"x": 1.0}, {1: 1}, "\ud800"],
}
"""Each field's values: mostly the first, then values Python compares in its own way (1024 ==
1024.0; -0.0 == 0.0 == False; a list never equals a tuple; NaN equals nothing, yet a list holding
the same NaN object equals itself) and values msgpack cannot encode (an int over 64 bits, a lone
surrogate). A pool is a fresh list per draw, so ``float("nan")`` is a new NaN each time."""


def random_request(rng: random.Random, index: int, t: float) -> QueuedRequest:
    """A request drawn from few values per field, so many requests are compatible and many differ
    from the head only deep in the key."""
    key = {field: rng.choice(pool()) if rng.random() < 0.5 else pool()[0] for field, pool in KEY_POOLS.items()}
    if rng.random() < 0.05:
        del key[rng.choice(list(key))]
    if rng.random() < 0.05:
        key["extra"] = 1
    if rng.random() < 0.1:  # the same fields in another order
        key = dict(rng.sample(list(key.items()), len(key)))
    return QueuedRequest(
        job_id=f"j{index}",
        model=rng.choice((FLUX, FLUX, FLUX, FLUX, QWEN)),
        task=rng.choice(("t2i",) * 9 + ("t2v",)),
        key=key,
        resolution=rng.choice(("1024x1024",) * 4 + ("512x512", None)),
        enqueued_at=t,
        family_max=rng.choice((8, 8, 4, 1)),
    )


@pytest.mark.parametrize("seed", range(6))
def test_gather_picks_the_same_batches_as_the_scan_on_a_random_queue(seed):
    rng = random.Random(seed)
    rules = [{"model_contains": "Qwen-Image", "resolution": "1024x1024", "max_batch_size": 1}]
    rules += [{"model_contains": "FLUX", "resolution": "512x512", "max_batch_size": 3}]
    fast_clock, scan_clock = FakeClock(), FakeClock()
    fast = batcher(fast_clock, max_size=rng.choice((4, 8)), rules=rules)
    scan = batcher(scan_clock, max_size=fast.config.max_size, rules=rules)
    scan.gather_members = gather_by_scan
    assert fast.gather_members is gather  # the batcher as it runs
    queue, arrived, dispatches, merged = [], 0, 0, 0
    while arrived < 400 or queue:
        for _ in range(rng.randrange(0, 12) if arrived < 400 else 0):
            queue.append(random_request(rng, arrived, fast_clock.now))
            arrived += 1
        fast_clock.now = scan_clock.now = fast_clock.now + rng.choice((0.001, 0.002, 0.01))
        assert fast.next_deadline(queue) == scan.next_deadline(queue)
        chosen, expected = fast.select(queue), scan.select(queue)
        assert chosen == expected, (seed, dispatches)
        if chosen is not None:
            take(queue, chosen)
            dispatches += 1
            merged += chosen.size > 1
    assert dispatches > 100 and merged > 20


def test_gather_counts_rejects_like_the_scan_however_deep_keys_differ():
    queue = [req("head", 0.0, output_format="jpeg")]
    queue += [req(f"r{i}", 0.0, num_inference_steps=28 if i % 3 == 0 else 20 + i % 2) for i in range(300)]
    queue += [req(f"c{i}", 0.0, output_format="jpeg") for i in range(10)]
    assert gather(queue[0], queue, 4) == gather_by_scan(queue[0], queue, 4)
    job_ids, rejects = gather(queue[0], queue, 4)
    assert job_ids == ["head", "c0", "c1", "c2"] and rejects == {"num_inference_steps": 200, "output_format": 100}


def test_key_tokens_are_shared_by_equal_plain_keys_only():
    key = {"width": 1024, "steps": 28, "scale": 3.5, "format": "png", "sizes": [[64, 64]], "lora": None}
    assert key_token(key) == key_token(dict(key)) and isinstance(key_token(key), bytes)
    for other in ({**key, "scale": 3.6}, {**key, "steps": 28.0}, {**key, "lora": False}, dict(reversed(key.items()))):
        assert key_token(other) != key_token(key)
    for odd in ({"a": (1, 2)}, {"a": float("nan")}, {"a": 2**70}, {"a": "\ud800"}, {"a": {1: 2}}, {"a": 2**62 + 0.5j}):
        assert key_token(odd) != key_token(dict(odd))  # each its own: compared field by field


def test_next_deadline_is_head_arrival_plus_delay():
    clock = FakeClock(0.0)
    b = batcher(clock, delay_ms=5.0)
    queue = [req("a", 1.001), req("b", 1.002)]
    clock.now = 1.002
    assert b.next_deadline(queue) == pytest.approx(1.006)
    assert b.select(queue) is None
    clock.now = b.next_deadline(queue)  # sleeping exactly until the deadline always dispatches
    assert b.select(queue).stop_reason == "delay"


def test_next_deadline_is_now_or_earlier_when_the_batch_is_due():
    clock = FakeClock(2.0)
    b = batcher(clock, max_size=2, rules=[{"model_contains": "Qwen", "max_batch_size": 1}])
    assert b.next_deadline([req("a", 1.5), req("b", 1.9)]) <= clock.now  # full
    assert b.next_deadline([req("q", 1.9, model=QWEN)]) <= clock.now  # cannot merge


def test_event_loop_simulation_merges_close_arrivals():
    """Three compatible requests 1 ms apart and one odd one: the loop sleeps until deadlines."""
    clock = FakeClock(0.0)
    b = batcher(clock, max_size=8, delay_ms=5.0)
    arrivals = collections.deque(
        [
            (0.000, req("a", 0.000)),
            (0.001, req("b", 0.001)),
            (0.002, req("odd", 0.002, num_inference_steps=4)),
            (0.003, req("c", 0.003)),
        ]
    )
    queue: list[QueuedRequest] = []
    dispatched = []
    while arrivals or queue:
        while arrivals and arrivals[0][0] <= clock.now:
            queue.append(arrivals.popleft()[1])
        d = b.select(queue)
        if d is not None:
            dispatched.append((d.job_ids, d.stop_reason, d.rejects))
            take(queue, d)
            continue
        wake = [t for t in (b.next_deadline(queue), arrivals[0][0] if arrivals else None) if t is not None]
        clock.now = max(clock.now, min(wake))
    assert dispatched == [
        (["a", "b", "c"], "delay", {"num_inference_steps": 1}),
        (["odd"], "delay", {}),
    ]


# ---- config ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "static"}, "batching mode must be one of off, dynamic, got 'static'"),
        ({"max_size": 0}, "batching max size must be an integer >= 1, got 0"),
        ({"max_size": 2.0}, "got 2.0"),
        ({"delay_ms": -1.0}, "batching delay must be a finite number of ms >= 0, got -1.0"),
        ({"delay_ms": float("inf")}, "got inf"),
        ({"stats_every": 0}, "batching stats interval must be an integer >= 1, got 0"),
        ({"rules": {"rules": []}}, "batching rules must be a BatchingRules value"),
    ],
)
def test_bad_config_names_the_value(kwargs, message):
    with pytest.raises(ValueError) as info:
        BatchingConfig(**kwargs)
    assert message in str(info.value)


def test_batching_settings_without_dynamic_mode_are_refused(tmp_path):
    with pytest.raises(ValueError, match="--batching-max-size 8 needs --batching-mode dynamic"):
        ServeConfig(device="cpu", batching_max_size=8)
    with pytest.raises(ValueError, match="--batching-config r.json needs --batching-mode dynamic"):
        ServeConfig(device="cpu", batching_config="r.json")
    assert ServeConfig(device="cpu", batching_mode="dynamic", batching_max_size=8).batching.user_max == 8
    assert BatchingConfig(mode="off", max_size=8).user_max == 1


def test_bad_request_resolution_is_refused():
    with pytest.raises(ValueError, match="1024by1024"):
        QueuedRequest(job_id="a", model=FLUX, task="t2i", key={}, resolution="1024by1024", enqueued_at=0.0)


# ---- metrics -----------------------------------------------------------------------------


def reference_dispatches() -> list[Dispatch]:
    """Five dispatches that give the reference's stats line (max size 8, delay 5 ms)."""
    clock = FakeClock()
    b = batcher(clock, rules=[{"model_contains": "Qwen-Image", "resolution": "1024x1024", "max_batch_size": 1}])
    steps = [
        ([req("a1", 0.0), req("a2", 0.001)], 0.00512),  # 2/8 delay 5.12ms
        ([req("q", 1.0, model=QWEN)], 1.00004),  # 1/8 config_cap:1 0.04ms
        ([req(f"c{i}", 2.0) for i in range(8)], 2.0008),  # 8/8 max_size 0.80ms
        ([req("d1", 3.0), req("d2", 3.002)], 3.00505),  # 2/8 delay 5.05ms
        ([req("e", 4.0)], 4.00504),  # 1/8 delay 5.04ms
    ]
    out = []
    for queue, now in steps:
        clock.now = now
        out.append(b.select(queue))
    return out


def test_reference_stats_line_is_reproduced():
    metrics = BatchMetrics(stats_every=5)
    lines = [metrics.record(d, 8) for d in reference_dispatches()]
    assert [len(x) for x in lines] == [1, 1, 1, 1, 2]
    assert [x[0] for x in lines] == [
        "Dynamic batch dispatch: size=2/8, user_max=8, queue_wait=5.12ms, stop_reason=delay",
        "Dynamic batch dispatch: size=1/8, user_max=8, queue_wait=0.04ms, stop_reason=config_cap:1",
        "Dynamic batch dispatch: size=8/8, user_max=8, queue_wait=0.80ms, stop_reason=max_size",
        "Dynamic batch dispatch: size=2/8, user_max=8, queue_wait=5.05ms, stop_reason=delay",
        "Dynamic batch dispatch: size=1/8, user_max=8, queue_wait=5.04ms, stop_reason=delay",
    ]
    assert lines[-1][1] == (
        "Dynamic batch stats (last 5 dispatches): avg_size=2.80, merged_rate=60.0%, full_rate=20.0%, "
        "utilization=35.0%, wait_avg=3.21ms, wait_p95=5.12ms, top_rejects=none"
    )


def test_stats_line_every_k_covers_the_last_k_and_names_top_rejects(caplog):
    metrics = BatchMetrics(stats_every=2, log=True)

    def dispatch(size: int, wait: float, rejects: dict[str, int]) -> Dispatch:
        return Dispatch(
            job_ids=[str(i) for i in range(size)],
            cap=4,
            size_limit=4,
            stop_reason="delay",
            queue_wait_ms=wait,
            rejects=rejects,
        )

    with caplog.at_level(logging.INFO, logger="tilecast.scheduler.batching_metrics"):
        assert len(metrics.record(dispatch(4, 1.0, {"model": 5}), 4)) == 1
        assert len(metrics.record(dispatch(1, 3.0, {}), 4)) == 2
        metrics.record(dispatch(2, 2.0, {"resolution": 2, "task": 1, "num_inference_steps": 1}), 4)
        lines = metrics.record(dispatch(2, 4.0, {"resolution": 1, "guidance_scale": 1}), 4)
    assert lines[1] == (
        "Dynamic batch stats (last 2 dispatches): avg_size=2.00, merged_rate=100.0%, full_rate=0.0%, "
        "utilization=50.0%, wait_avg=3.00ms, wait_p95=4.00ms, "
        "top_rejects=resolution:3,guidance_scale:1,num_inference_steps:1"
    )
    assert caplog.text.count("Dynamic batch dispatch:") == 4 and caplog.text.count("Dynamic batch stats") == 2


def test_snapshot_has_cumulative_and_window_figures():
    metrics = BatchMetrics(stats_every=5)
    for d in reference_dispatches():
        metrics.record(d, 8)
    metrics.record(
        Dispatch(job_ids=["x"], cap=8, size_limit=8, stop_reason="delay", queue_wait_ms=5.0, rejects={"resolution": 2}),
        8,
    )
    snap = metrics.snapshot()
    cum, win = snap["cumulative"], snap["window"]
    assert snap["stats_every"] == 5
    assert (cum["dispatches"], cum["requests"]) == (6, 15)
    assert cum["size_histogram"] == {1: 3, 2: 2, 8: 1}
    assert cum["stop_reasons"] == {"config_cap:1": 1, "delay": 4, "max_size": 1}
    assert cum["merged_rate"] == pytest.approx(0.5) and cum["full_rate"] == pytest.approx(1 / 6)
    assert cum["utilization"] == pytest.approx(15 / 48)
    assert cum["top_rejects"] == [["resolution", 2]]
    assert (win["dispatches"], win["requests"]) == (5, 13)  # the last five
    assert win["avg_size"] == pytest.approx(2.6) and win["wait_p95_ms"] == pytest.approx(5.05)
    empty = BatchMetrics().snapshot()["cumulative"]
    assert empty["dispatches"] == 0 and empty["avg_size"] == 0.0 and empty["top_rejects"] == []


def test_top_rejects_and_percentile_helpers():
    assert format_top_rejects({}) == "none"
    assert format_top_rejects({"b": 2, "a": 2, "c": 5, "d": 1}) == "c:5,a:2,b:2"
    assert percentile_nearest_rank([], 95) == 0.0
    assert percentile_nearest_rank([float(i) for i in range(1, 21)], 95) == 19.0
    assert percentile_nearest_rank([3.0, 1.0, 2.0], 95) == 3.0


def test_batching_modules_do_not_import_torch():
    code = (
        "import sys, tilecast.scheduler.batching, tilecast.scheduler.batching_metrics, "
        "tilecast.scheduler.batching_rules; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
