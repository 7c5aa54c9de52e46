"""``tilecast bench scheduler``: what rank 0's control path costs, on the CPU (no model, no GPU).

Three measurements, each repeated (``repeats``) so a shared machine's noise shows as a spread:

- **dispatch**: a real ``Scheduler`` (not started as a thread; a stub pipeline, one serving group,
  a fake clock past every head's delay) holds ``num_queued`` queued jobs of mixed text-to-image
  requests; each decision is one ``Scheduler._dispatch()`` that releases a batch. The workload
  draws from the registry's text-to-image families, each request's batch key made by its family's
  own ``params_type`` and ``batch_key`` (as the server makes it after ``prepare``): mixed
  resolutions (mostly common ones, some one-off sizes), steps, guidance, output formats and, for
  FLUX.2, reference-image digests; each family's ``max_batch_size``; ``--batching-max-size 8``
  and ``configs/batching/example.json``'s rules. After every decision the batch is booked as done
  and the queue refilled to ``num_queued``, so every decision sees the same depth. Reported per
  decision: ``decision`` (building the batcher's view of the queue and ``Batcher.select``: choosing
  the batch) and ``dispatch`` (the whole ``_dispatch``: the decision, taking the jobs off the
  queue, the plan, the metrics), p50/p95/max in microseconds, over all repeats, and the spread of
  the per-repeat p50. Scenarios (``SCENARIOS``): ``mixed`` (every text-to-image family in one
  queue), ``one-model`` (FLUX.1-dev only) and ``one-size`` (FLUX.1-dev at 1024x1024 only). Each
  runs twice on the same requests, with the batcher's ``gather`` and with ``gather_by_scan`` (the
  per-request scan it replaced), repeats interleaved; ``same_batches`` says both chose the same
  batches.
- **round trip**: ``Client.health()`` and ``Client.status(job_id)`` against an in-process server
  (``runtime/inproc.py``, ``test/allreduce``) on loopback TCP, p50/p95 in microseconds.
- **wire**: a ``SubmitRequest`` with one ``upload_mb`` payload frame: ``protocol.encode`` and
  ``protocol.decode`` (the payload travels as its own frame, so both are per-message costs, not
  per-byte: the GB/s is the upload's size over that time), one ``bytes`` copy of the payload for
  scale, and the full path ``Client.submit(video=...)`` -> the scheduler has received and decoded
  it (the ``test/allreduce`` server takes no uploads, so it refuses the request right after
  decoding; the reply is small), interleaved with its floor: the same frames through a bare
  ZeroMQ DEALER -> ROUTER pair on loopback TCP, answered with one small frame (``vs floor``: the
  submit's p50 over the floor's).

Imports no torch at module import time; the families (for their batch keys) and the in-process
server are imported when their measurement runs.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from tilecast.scheduler.batching_metrics import percentile_nearest_rank

SCENARIOS = ("mixed", "one-model", "one-size")
"""``mixed``: every text-to-image family in one queue; ``one-model``: FLUX.1-dev only; ``one-size``:
FLUX.1-dev at 1024x1024 only (requests differ only late in the batch key: the costliest to tell apart)."""
ONE_MODEL = "tiny/flux"
"""The family of the ``one-model`` scenario (FLUX.1-dev's declaration)."""
MAX_SIZE = 8
"""``--batching-max-size`` of the dispatch measurement."""
RULES_FILE = Path(__file__).resolve().parents[2] / "configs" / "batching" / "example.json"
"""Batching rules of the dispatch measurement: its Qwen-Image rule runs ``tiny/qwen-image*`` at 1024²
alone (its FLUX.1-dev rule matches none of the built-in names the requests carry)."""
TARGET_DECISION_US = 1000.0
"""The decision-time target at 1,000 queued requests (issue 24): 1 ms."""

COMMON_SIZES = ((1024, 1024), (512, 512), (768, 1344), (1344, 768), (1536, 640))
"""Resolutions most requests ask for (the first most often)."""
SIZE_WEIGHTS = (50, 15, 8, 8, 4)
"""Weights of ``COMMON_SIZES``; the rest of 100 (15) are one-off sizes in 256..2048."""


@dataclasses.dataclass(frozen=True)
class _Family:
    """What the workload needs of a family's declaration."""

    name: str
    params_type: type
    batch_key: Callable[[Any], dict[str, Any]]
    max_batch_size: int
    size_multiple: int
    default_steps: int
    default_guidance: float
    takes_images: bool


def t2i_families() -> list[_Family]:
    """The registry's text-to-image families (each released checkpoint once), with their own batch keys."""
    from tilecast.runtime import registry
    from tilecast.runtime.models.families.common import DiffusersBatchPipeline

    families = []
    for cls in registry.pipelines():
        if not issubclass(cls, DiffusersBatchPipeline) or cls.task != "t2i":
            continue
        if cls.builtin_name.startswith("random/"):  # FLUX.1-dev at its released size: tiny/flux's declaration
            continue
        bare = cls.__new__(cls)  # batch_key reads class declarations only: no model is loaded
        families.append(
            _Family(
                name=cls.builtin_name,
                params_type=cls.params_type,
                batch_key=bare.batch_key,
                max_batch_size=cls.max_batch_size,
                size_multiple=cls.size_multiple,
                default_steps=cls.default_steps,
                default_guidance=float(cls.default_guidance),
                takes_images=bool(cls.max_images),
            )
        )
    return families


def request_stream(families: Sequence[_Family], seed: int = 0, *, one_size: bool = False):
    """Endless ``(family, batch key, resolution)`` of text-to-image requests, as ``prepare`` leaves
    them (steps and guidance resolved), drawn with a seeded generator."""
    import msgspec

    rng = random.Random(seed)
    digests = [f"{index:064x}" for index in range(4)]  # a few reference images shared by many requests
    for index in itertools.count():
        family = rng.choice(families)
        if one_size:
            width, height = COMMON_SIZES[0]
        elif rng.randrange(100) < sum(SIZE_WEIGHTS):
            width, height = rng.choices(COMMON_SIZES, weights=SIZE_WEIGHTS)[0]
        else:
            step = family.size_multiple
            width, height = (rng.randrange(256 // step, 2048 // step + 1) * step for _ in range(2))
        width -= width % family.size_multiple
        height -= height % family.size_multiple
        roll = rng.randrange(100)
        steps = family.default_steps if roll < 70 else 20 if roll < 80 else 50 if roll < 90 else rng.randint(1, 60)
        guidance = family.default_guidance if rng.randrange(100) < 85 else rng.choice((2.5, 5.0, 7.5))
        fields = dict(
            prompt=f"bench request {index}",
            seed=index,
            width=width,
            height=height,
            num_inference_steps=steps,
            guidance_scale=guidance,
            output_format=rng.choices(("png", "jpeg", "webp"), weights=(80, 15, 5))[0],
        )
        if family.takes_images and rng.randrange(100) < 20:
            fields.update(image_sizes=[[width, height]], image_digests=[rng.choice(digests)])
        params = msgspec.convert(fields, family.params_type)
        yield family, family.batch_key(params), f"{width}x{height}"


class _StubPipeline:
    """What ``Scheduler`` reads of a pipeline outside ``_build_job`` (the bench queues jobs itself)."""

    model_name = "bench"
    family = "bench"
    task = "t2i"
    params_type = object
    upload_fields: tuple[str, ...] = ()
    max_batch_size = MAX_SIZE


def _percentiles(values_s: Sequence[float]) -> dict[str, float]:
    values = sorted(value * 1e6 for value in values_s)
    return {
        "p50_us": percentile_nearest_rank(values, 50),
        "p95_us": percentile_nearest_rank(values, 95),
        "max_us": values[-1],
    }


def _spread(per_repeat_p50_us: Sequence[float]) -> str:
    """The lowest and highest per-repeat p50, as ``low-high``."""
    return f"{min(per_repeat_p50_us):.3g}-{max(per_repeat_p50_us):.3g}"


def _check_counts(**counts: int) -> None:
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


GATHERS = ("gather", "scan")
"""``gather``: the batcher as it runs (``batching.gather``); ``scan``: ``batching.gather_by_scan``,
one ``first_difference`` per queued request looked at (the batcher before ``key_token``)."""


def _dispatch_repeat(
    families: Sequence[_Family], config, *, gather: str, scenario: str, num_queued: int, decisions: int, seed: int
) -> dict[str, Any]:
    """One repeat: a fresh ``Scheduler`` and queue, ``decisions`` timed ``_dispatch`` calls."""
    from tilecast.scheduler import batching
    from tilecast.scheduler.jobs import Job
    from tilecast.scheduler.scheduler import Scheduler

    now = [0.0]
    scheduler = Scheduler(
        pipeline=_StubPipeline(),
        send=lambda identity, frames: None,
        batching=config,
        max_queued=num_queued + MAX_SIZE,
        world_size=1,
        clock=lambda: now[0],
    )
    scheduler.batcher.gather_members = batching.gather if gather == "gather" else batching.gather_by_scan
    spent = [0.0]

    def timed(call):
        def wrapper(*args):
            began = time.perf_counter()
            try:
                return call(*args)
            finally:
                spent[0] += time.perf_counter() - began

        return wrapper

    # the decision: the batcher's view of the queue, then the batch chosen from it
    scheduler.batcher.select = timed(scheduler.batcher.select)
    scheduler._queued_requests = timed(scheduler._queued_requests)
    stream = request_stream(families, seed=seed, one_size=scenario == "one-size")
    counter = itertools.count()
    keys: set[tuple[str, bytes | str]] = set()

    def refill() -> None:
        while len(scheduler.table.queue) < num_queued:
            family, key, resolution = next(stream)
            job_id = f"job_{next(counter):08d}"
            view = batching.QueuedRequest(
                job_id=job_id,
                model=family.name,
                task="t2i",
                key=key,
                resolution=resolution,
                enqueued_at=now[0],
                family_max=family.max_batch_size,
            )
            keys.add((family.name, view.key_token if isinstance(view.key_token, bytes) else repr(key)))
            scheduler.table.add(Job(id=job_id, params=None, wire_params={}, uploads={}, batching_view=view))

    refill()
    decision_s, dispatch_s, depths, batches = [], [], set(), []
    for _ in range(decisions):
        now[0] += 1.0  # past every head's delay: each decision releases a batch
        depths.add(len(scheduler.table.queue))
        spent[0] = 0.0
        began = time.perf_counter()
        scheduler._dispatch()
        dispatch_s.append(time.perf_counter() - began)
        decision_s.append(spent[0])
        plan = scheduler.work.get_nowait()
        batches.append(tuple(item.job_id for item in plan.items))
        scheduler._on_done(plan.seq, "not run: scheduler bench")
        refill()
    return dict(decision_s=decision_s, dispatch_s=dispatch_s, depths=depths, batches=batches, keys=len(keys))


def bench_dispatch(
    scenario: str, *, num_queued: int, decisions: int, repeats: int, seed: int = 0
) -> list[dict[str, Any]]:
    """One row per ``GATHERS`` entry: ``decisions`` dispatches of a ``Scheduler`` holding ``num_queued``
    jobs, ``repeats`` times (the two interleaved, on the same requests: ``same_batches`` checks that
    both chose the same batches)."""
    from tilecast.scheduler.batching import BatchingConfig
    from tilecast.scheduler.batching_rules import BatchingRules

    if scenario not in SCENARIOS:
        raise ValueError(f"--scenario must be one of {', '.join(SCENARIOS)}, got {scenario!r}")
    _check_counts(num_queued=num_queued, decisions=decisions, repeats=repeats)
    families = t2i_families()
    if scenario != "mixed":
        families = [family for family in families if family.name == ONE_MODEL]
    config = BatchingConfig(mode="dynamic", max_size=MAX_SIZE, delay_ms=5.0, rules=BatchingRules.load(RULES_FILE))
    runs: dict[str, list[dict[str, Any]]] = {gather: [] for gather in GATHERS}
    for repeat in range(repeats):
        for gather in GATHERS if repeat % 2 == 0 else GATHERS[::-1]:
            runs[gather].append(
                _dispatch_repeat(
                    families,
                    config,
                    gather=gather,
                    scenario=scenario,
                    num_queued=num_queued,
                    decisions=decisions,
                    seed=seed + repeat,
                )
            )
    same = all(a["batches"] == b["batches"] for a, b in zip(*runs.values()))
    rows = []
    for gather, repeat_runs in runs.items():
        decision = _percentiles([t for run in repeat_runs for t in run["decision_s"]])
        dispatch = _percentiles([t for run in repeat_runs for t in run["dispatch_s"]])
        sizes = [len(batch) for run in repeat_runs for batch in run["batches"]]
        rows.append(
            {
                "scenario": scenario,
                "gather": gather,
                "queue_depth": "/".join(
                    str(depth) for depth in sorted(set().union(*(r["depths"] for r in repeat_runs)))
                ),
                "families": len(families),
                "batch_keys": max(run["keys"] for run in repeat_runs),
                "decisions": len(sizes),
                "avg_batch": statistics.fmean(sizes),
                **{f"decision_{name}": value for name, value in decision.items()},
                "decision_p50_spread_us": _spread([_percentiles(run["decision_s"])["p50_us"] for run in repeat_runs]),
                **{f"dispatch_{name}": value for name, value in dispatch.items()},
                "dispatch_p50_spread_us": _spread([_percentiles(run["dispatch_s"])["p50_us"] for run in repeat_runs]),
                "within_target": decision["p95_us"] <= TARGET_DECISION_US,
                "same_batches": same,
            }
        )
    return rows


def _time_each(call: Callable[[], Any], count: int) -> list[float]:
    seconds = []
    for _ in range(count):
        began = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - began)
    return seconds


FLOOR = "ZeroMQ alone: the same frames, DEALER -> ROUTER -> reply (floor)"
"""The row of ``_ZeroMQFloor``."""


def bench_server(*, round_trips: int, upload_mb: float, uploads: int, repeats: int) -> list[dict[str, Any]]:
    """Round trips of ``health`` and ``status`` and a ``Client.submit`` of ``upload_mb`` to the scheduler,
    against one in-process ``test/allreduce`` server, ``repeats`` times each."""
    from tilecast.client import Client, ServerError
    from tilecast.runtime.config import ServeConfig
    from tilecast.runtime.inproc import InProcessServer

    payload = _payload(upload_mb)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tilecast-bench-") as tmp:
        config = ServeConfig(model_path="test/allreduce", device="cpu", port=0, output_dir=Path(tmp))
        with InProcessServer(config) as server, Client(server.endpoint, timeout=60.0) as client:
            client.wait_ready(60.0)
            job_id = client.generate(size=4).job.job_id

            def submit() -> None:
                try:
                    client.submit(video=payload)
                except ServerError as exc:  # refused after the scheduler decoded it: the expected reply
                    if exc.code != "bad_request":
                        raise
                else:
                    raise AssertionError("test/allreduce accepted an upload")

            floor = _ZeroMQFloor(payload)
            try:
                quick = {"health": client.health, "status": lambda: client.status(job_id)}
                slow = {f"submit {len(payload) / 2**20:g} MiB upload": submit, FLOOR: floor.round_trip}
                for call in (*quick.values(), *slow.values()):
                    call()  # warm-up (a first large upload also asks the server's message limit)
                seconds: dict[str, list[float]] = {key: [] for key in (*quick, *slow)}
                p50s: dict[str, list[float]] = {key: [] for key in seconds}
                for _ in range(repeats):
                    times: dict[str, list[float]] = {key: [] for key in seconds}
                    for calls, count in ((quick, round_trips), (slow, uploads)):
                        for _ in range(count):  # interleaved, so each sees the same load on the machine
                            for key, call in calls.items():
                                times[key] += _time_each(call, 1)
                    for key, values in times.items():
                        seconds[key] += values
                        p50s[key].append(_percentiles(values)["p50_us"])
            finally:
                floor.close()
            for key, values in seconds.items():
                stats = _percentiles(values)
                row = {
                    "measure": key if key == FLOOR else f"client {key}",
                    "calls": len(values),
                    **stats,
                    "p50_spread_us": _spread(p50s[key]),
                }
                if key in slow:
                    row["gb_per_s"] = len(payload) / (stats["p50_us"] * 1e-6) / 1e9
                rows.append(row)
            rows[-2]["ratio_to_floor"] = rows[-2]["p50_us"] / rows[-1]["p50_us"]
    return rows


class _ZeroMQFloor:
    """The transport alone, the peer of the client submit: a DEALER sends the same three frames
    (``copy=False``, as the client does) to a ROUTER on loopback TCP, whose thread receives them
    (``copy=False``, as the server's socket thread does) and answers one small frame."""

    def __init__(self, payload: bytes) -> None:
        import threading

        import zmq

        self.frames = [b"S", b"\x93\x01\x80\x91\xa5video", payload]
        self.context = zmq.Context()
        self.router, self.dealer = self.context.socket(zmq.ROUTER), self.context.socket(zmq.DEALER)
        for sock in (self.router, self.dealer):
            sock.setsockopt(zmq.LINGER, 0)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.dealer.connect(f"tcp://127.0.0.1:{port}")
        self.thread = threading.Thread(target=self._serve, name="bench-zeromq-router", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            identity, *received = self.router.recv_multipart(copy=False)
            if len(received) == 1:  # the stop message
                return
            self.router.send_multipart([identity, b"e"])

    def round_trip(self) -> None:
        self.dealer.send_multipart(self.frames, copy=False)
        self.dealer.recv_multipart()

    def close(self) -> None:
        self.dealer.send(b"stop")
        self.thread.join(30.0)
        self.dealer.close()
        self.router.close()
        self.context.term()


def _payload(upload_mb: float) -> bytes:
    if not upload_mb > 0:
        raise ValueError(f"upload size must be > 0 MB, got {upload_mb!r}")
    return random.Random(0).randbytes(int(upload_mb * 2**20))


def bench_wire(*, upload_mb: float, iterations: int, repeats: int) -> list[dict[str, Any]]:
    """``protocol.encode`` / ``decode`` of a ``SubmitRequest`` with one ``upload_mb`` payload frame, and one copy of it."""
    from tilecast.scheduler import protocol as P

    payload = _payload(upload_mb)
    message = P.SubmitRequest(
        req_id=1, params={"prompt": "bench", "width": 1024, "height": 1024, "seed": 7}, uploads=["video"]
    )
    frames = P.encode(message, payload)
    wire = [bytes(frames[0]), bytes(frames[1]), memoryview(payload)]  # as the socket thread hands them on

    def decode() -> None:
        decoded, payloads = P.decode(wire, allowed=P.REQUEST_TYPES)
        assert decoded.uploads == ["video"] and len(payloads[0]) == len(payload)

    rows = []
    for name, call, count in (
        ("protocol.encode", lambda: P.encode(message, payload), iterations),
        ("protocol.decode", decode, iterations),
        ("bytes copy of the payload", lambda: bytes(memoryview(payload)), max(1, iterations // 100)),
    ):
        call()
        seconds, p50s = [], []
        for _ in range(repeats):
            times = _time_each(call, count)
            seconds += times
            p50s.append(_percentiles(times)["p50_us"])
        stats = _percentiles(seconds)
        rows.append(
            {
                "measure": f"{name}, {len(payload) / 2**20:g} MiB upload",
                "calls": len(seconds),
                **stats,
                "p50_spread_us": _spread(p50s),
                "gb_per_s": len(payload) / (stats["p50_us"] * 1e-6) / 1e9,
            }
        )
    return rows


def run_scheduler_bench(
    *,
    scenarios: Sequence[str] = SCENARIOS,
    num_queued: int = 1000,
    decisions: int = 500,
    round_trips: int = 500,
    upload_mb: float = 64.0,
    uploads: int = 5,
    wire_iterations: int = 1000,
    repeats: int = 5,
    server: bool = True,
) -> dict[str, Any]:
    """Every measurement; ``{"dispatch": rows, "wire": rows}`` (``server=False`` skips the in-process server).
    A ``ValueError`` names a bad argument before anything runs."""
    for name in scenarios:
        if name not in SCENARIOS:
            raise ValueError(f"--scenario must be one of {', '.join(SCENARIOS)}, got {name!r}")
    _check_counts(
        num_queued=num_queued,
        decisions=decisions,
        round_trips=round_trips,
        uploads=uploads,
        wire_iterations=wire_iterations,
        repeats=repeats,
    )
    if not upload_mb > 0:
        raise ValueError(f"upload size must be > 0 MB, got {upload_mb!r}")
    dispatch = [
        row
        for scenario in scenarios
        for row in bench_dispatch(scenario, num_queued=num_queued, decisions=decisions, repeats=repeats)
    ]
    wire = bench_wire(upload_mb=upload_mb, iterations=wire_iterations, repeats=repeats)
    if server:
        wire += bench_server(round_trips=round_trips, upload_mb=upload_mb, uploads=uploads, repeats=repeats)
    return {"dispatch": dispatch, "wire": wire}


DISPATCH_COLUMNS = {
    "scenario": "scenario",
    "gather": "gather",
    "queue_depth": "queued",
    "batch_keys": "keys",
    "avg_batch": "avg batch",
    "decision_p50_us": "decision p50",
    "decision_p95_us": "p95",
    "decision_max_us": "max",
    "decision_p50_spread_us": "p50 per repeat",
    "dispatch_p50_us": "dispatch p50",
    "dispatch_p95_us": "p95",
    "dispatch_max_us": "max",
    "within_target": "p95 <= 1 ms",
    "same_batches": "same batches",
}
"""Table columns of the decision rows (key: header); the JSON has every key."""
WIRE_COLUMNS = {
    "measure": "measure",
    "calls": "calls",
    "p50_us": "p50",
    "p95_us": "p95",
    "max_us": "max",
    "p50_spread_us": "p50 per repeat",
    "gb_per_s": "GB/s at p50",
    "ratio_to_floor": "vs floor",
}
"""Table columns of the round-trip and wire rows (key: header)."""
