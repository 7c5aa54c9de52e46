"""Metrics of the HTTP front end, and the Prometheus text exposition of them and of the scheduler's ``stats``.

Honest about the source of each figure:

- ``tilecast_up``, ``tilecast_queue_depth``, ``tilecast_jobs{state}``, ``tilecast_batch_*``,
  ``tilecast_replica_*{group}`` (each data-parallel replica group's load): the scheduler's ``stats``
  snapshot at scrape time (all clients, ZeroMQ and HTTP alike).
- ``tilecast_http_requests_total``, ``tilecast_http_request_duration_seconds``: measured here.
- ``tilecast_job_duration_seconds`` (created -> finished), ``tilecast_job_queue_seconds`` (created ->
  started): scheduler timestamps of jobs submitted over HTTP, recorded when they end.
- ``tilecast_stage_seconds{stage}``: the per-stage timings a pipeline puts in ``Output.info["timings"]``
  (K6 SR: input, encode, denoise, decode, output, ...), summed over completed HTTP jobs.

Written by hand (no client library): the format is small and this keeps no global registry.
"""

from __future__ import annotations

import collections
import math
from typing import Any, Iterable

from tilecast.scheduler import protocol as P

LATENCY_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
"""Job latencies (seconds)."""
HTTP_BUCKETS = (0.005, 0.025, 0.1, 0.5, 2.5, 10.0, 60.0)
"""HTTP request durations (seconds; image requests wait for their jobs)."""
BATCH_SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for index, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[index] += 1

    def samples(self, name: str, labels: dict[str, str]) -> list[tuple[str, dict, float]]:
        out = [
            (f"{name}_bucket", {**labels, "le": _fmt(bound)}, count) for bound, count in zip(self.buckets, self.counts)
        ]
        out.append((f"{name}_bucket", {**labels, "le": "+Inf"}, self.count))
        out += [(f"{name}_sum", labels, self.sum), (f"{name}_count", labels, self.count)]
        return out


class FrontEndMetrics:
    """Counters of what passed through this front end (the scheduler's own figures come from ``stats``)."""

    def __init__(self) -> None:
        self.requests: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.durations: dict[str, Histogram] = {}
        self.jobs_seconds: dict[str, Histogram] = {}
        self.queue_seconds = Histogram(LATENCY_BUCKETS)
        self.stage_seconds: dict[str, list[float]] = {}  # stage -> [sum, count]
        self.unauthorized = 0
        """Requests refused for a missing or wrong API key (401)."""
        self.disconnected = 0
        """Requests whose client went away while they waited; their jobs were cancelled."""

    def http(self, method: str, route: str, status: int, seconds: float) -> None:
        self.requests[(method, route, str(status))] += 1
        self.durations.setdefault(route, Histogram(HTTP_BUCKETS)).observe(seconds)

    def job(self, info: P.JobInfo, result_info: dict) -> None:
        """A terminal job that was created over HTTP: its latencies as the scheduler timed them."""
        if info.finished_at is not None:
            self.jobs_seconds.setdefault(info.state, Histogram(LATENCY_BUCKETS)).observe(
                max(0.0, info.finished_at - info.created_at)
            )
        if info.started_at is not None:
            self.queue_seconds.observe(max(0.0, info.started_at - info.created_at))
        timings = result_info.get("timings") if isinstance(result_info, dict) else None
        if isinstance(timings, dict):
            for stage, seconds in timings.items():
                if isinstance(seconds, (int, float)) and not isinstance(seconds, bool):
                    entry = self.stage_seconds.setdefault(str(stage), [0.0, 0])
                    entry[0] += float(seconds)
                    entry[1] += 1


def _fmt(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Exposition:
    """Prometheus text format 0.0.4: one ``# HELP``/``# TYPE`` block per metric family."""

    CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str, samples: list[tuple[str, dict, float]]) -> None:
        self.lines.append(f"# HELP {name} {_escape(help_text)}")
        self.lines.append(f"# TYPE {name} {kind}")
        for sample_name, labels, value in samples:
            label_text = ",".join(f'{key}="{_escape(val)}"' for key, val in labels.items())
            self.lines.append(
                f"{sample_name}{{{label_text}}} {_fmt(value)}" if label_text else f"{sample_name} {_fmt(value)}"
            )

    def simple(self, name: str, kind: str, help_text: str, value: float, labels: dict | None = None) -> None:
        self.family(name, kind, help_text, [(name, labels or {}, value)])

    def counter(self, name: str, help_text: str, value: float) -> None:
        """A counter without labels: its one sample is ``<name>_total``."""
        self.family(name, "counter", help_text, [(f"{name}_total", {}, value)])

    def by_label(self, name: str, kind: str, help_text: str, label: str, values: Iterable[tuple[str, float]]) -> None:
        """One sample per ``(label value, value)`` in ``values``, in that order (a counter's named ``<name>_total``)."""
        sample = f"{name}_total" if kind == "counter" else name
        self.family(name, kind, help_text, [(sample, {label: key}, value) for key, value in values])

    def histograms(self, name: str, help_text: str, label: str, histograms: dict[str, Histogram]) -> None:
        """One histogram per ``label`` value, in sorted order."""
        samples = []
        for key, hist in sorted(histograms.items()):
            samples += hist.samples(name, {label: key})
        self.family(name, "histogram", help_text, samples)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def scheduler_metrics(out: Exposition, stats: dict[str, Any]) -> None:
    """The scheduler's ``stats`` snapshot as gauges/counters (names ``tilecast_*``)."""
    out.simple("tilecast_world_size", "gauge", "Ranks serving the model.", stats.get("world_size", 0))
    out.simple(
        "tilecast_queue_depth", "gauge", "Requests waiting in the scheduler's queue.", stats.get("queue_depth", 0)
    )
    out.by_label(
        "tilecast_jobs",
        "gauge",
        "Jobs the scheduler tracks, by state (finished ones are kept up to a bound).",
        "state",
        sorted(stats.get("jobs", {}).items()),
    )
    batching = stats.get("batching", {})
    cumulative = batching.get("cumulative", {})
    out.simple("tilecast_batch_max_size", "gauge", "Configured --batching-max-size.", batching.get("max_size", 1))
    hist = Histogram(BATCH_SIZE_BUCKETS)
    for size, count in (cumulative.get("size_histogram") or {}).items():
        size, count = int(size), int(count)
        hist.sum += size * count
        hist.count += count
        hist.counts = [n + (count if size <= bound else 0) for n, bound in zip(hist.counts, hist.buckets)]
    out.family(
        "tilecast_batch_size",
        "histogram",
        "Requests per dispatched batch (scheduler batching metrics).",
        hist.samples("tilecast_batch_size", {}),
    )
    out.by_label(
        "tilecast_batch_stop_reason",
        "counter",
        "Dispatches by the reason the batch stopped growing.",
        "reason",
        sorted((cumulative.get("stop_reasons") or {}).items()),
    )
    out.by_label(
        "tilecast_batch_rejects",
        "counter",
        "Queued requests a batch head could not take, by first differing field.",
        "field",
        sorted((cumulative.get("rejects") or {}).items()),
    )
    out.simple(
        "tilecast_batch_queue_wait_avg_seconds",
        "gauge",
        "Mean queue wait of batch heads (all dispatches).",
        cumulative.get("wait_avg_ms", 0.0) / 1000.0,
    )
    out.simple(
        "tilecast_batch_queue_wait_p95_seconds",
        "gauge",
        "Nearest-rank p95 queue wait of batch heads (recent dispatches).",
        cumulative.get("wait_p95_ms", 0.0) / 1000.0,
    )
    out.by_label(
        "tilecast_refused",
        "counter",
        "What the scheduler refused: ZeroMQ handshakes without the API key, shutdowns from strangers,"
        " oversize messages, submits over the queued-upload cap.",
        "reason",
        sorted((stats.get("refused") or {}).items()),
    )
    out.counter(
        "tilecast_dropped_replies",
        "Replies that could not be delivered (client gone or saturated).",
        stats.get("dropped_replies", 0),
    )
    groups = stats.get("groups") or []
    out.by_label(
        "tilecast_replica_busy",
        "gauge",
        "Whether each data-parallel replica group is running a batch (1) or idle (0).",
        "group",
        [(str(g["group"]), 1 if g.get("busy") else 0) for g in groups],
    )
    for field, default, help_text in (
        ("jobs_done", 0, "Jobs whose batch ended on each replica group (any outcome)."),
        ("jobs_completed", 0, "Jobs each replica group completed."),
        ("busy_seconds", 0.0, "Time each replica group spent running batches."),
    ):
        values = [(str(g["group"]), g.get(field, default)) for g in groups]
        out.by_label(f"tilecast_replica_{field}", "counter", help_text, "group", values)

    out.simple(
        "tilecast_stored_outputs",
        "gauge",
        "Finished jobs whose output files are on disk.",
        stats.get("stored_outputs", 0),
    )
    out.counter(
        "tilecast_deleted_outputs",
        "Jobs whose output files were deleted (DELETE, --output-retention-s, --max-stored-outputs).",
        stats.get("deleted_outputs", 0),
    )


def front_end_metrics(out: Exposition, metrics: FrontEndMetrics) -> None:
    out.counter(
        "tilecast_http_unauthorized",
        "HTTP requests refused for a missing or wrong API key (401).",
        metrics.unauthorized,
    )
    out.counter(
        "tilecast_http_client_disconnects",
        "HTTP requests whose client disconnected while waiting; their jobs were cancelled.",
        metrics.disconnected,
    )
    out.family(
        "tilecast_http_requests",
        "counter",
        "HTTP requests by method, route and status.",
        [
            ("tilecast_http_requests_total", {"method": m, "route": r, "status": s}, n)
            for (m, r, s), n in sorted(metrics.requests.items())
        ],
    )
    out.histograms(
        "tilecast_http_request_duration_seconds",
        "Time from request start to the end of the response, by route.",
        "route",
        metrics.durations,
    )
    out.histograms(
        "tilecast_job_duration_seconds",
        "Created-to-finished time of jobs submitted over HTTP (scheduler timestamps), by final state.",
        "state",
        metrics.jobs_seconds,
    )
    out.family(
        "tilecast_job_queue_seconds",
        "histogram",
        "Created-to-started time of jobs submitted over HTTP (scheduler timestamps).",
        metrics.queue_seconds.samples("tilecast_job_queue_seconds", {}),
    )
    samples = []
    for stage, (total, count) in sorted(metrics.stage_seconds.items()):
        samples += [
            ("tilecast_stage_seconds_sum", {"stage": stage}, total),
            ("tilecast_stage_seconds_count", {"stage": stage}, count),
        ]
    out.family(
        "tilecast_stage_seconds",
        "summary",
        "Per-stage time reported by the pipeline (Output.info timings) for completed HTTP jobs.",
        samples,
    )
