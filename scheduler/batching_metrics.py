"""Counters for dynamic batching and the ``--enable-batching-metrics`` log lines.

Every dispatch gives one line, and every ``stats_every`` dispatches a summary of exactly those::

    Dynamic batch dispatch: size=2/8, user_max=8, queue_wait=5.12ms, stop_reason=delay
    Dynamic batch stats (last 5 dispatches): avg_size=2.80, merged_rate=60.0%, full_rate=20.0%, utilization=35.0%, wait_avg=3.21ms, wait_p95=5.12ms, top_rejects=none

Figures, over a set of dispatches:

- ``size=n/N``: ``n`` requests in the batch, ``N`` its size limit
  ``min(--batching-max-size, the pipeline's max_batch_size)``; ``user_max`` is
  ``--batching-max-size``. A rule cap shows in the stop reason (``size=1/8 ... config_cap:1``).
- ``avg_size``: mean batch size (requests / dispatches).
- ``merged_rate``: share of dispatches that ran more than one request.
- ``full_rate``: share of dispatches that filled their size limit (``n == N``, stop reason
  ``max_size``); a batch stopped by a rule cap or the delay is not full. A high full rate says
  ``--batching-max-size`` is what limits batching.
- ``utilization``: ``sum(n) / sum(user_max)``, the used share of the configured batch slots.
- ``wait_avg`` / ``wait_p95``: mean and 95th percentile of the head's queue wait; the
  percentile is nearest-rank (the ``ceil(0.95 * count)``-th smallest wait, so the largest
  wait of any set of up to 20 dispatches).
- ``top_rejects``: incompatible requests the heads looked at, as ``field:count`` for the
  three most frequent first differing fields (ties by name), or ``none``.

For example, with ``--batching-max-size 8 --batching-delay-ms 5`` the dispatches
``2/8 delay 5.12ms``, ``1/8 config_cap:1 0.04ms``, ``8/8 max_size 0.80ms``,
``2/8 delay 5.05ms`` and ``1/8 delay 5.04ms`` give the stats line above.
"""

from __future__ import annotations

import collections
import logging
import math
from typing import Any, Iterable

from .batching import Dispatch

logger = logging.getLogger(__name__)

TOP_REJECTS = 3
"""How many reject reasons ``top_rejects`` names."""
P95_HISTORY = 4096
"""The cumulative ``wait_p95_ms`` covers at most this many recent dispatches (bounded memory)."""


def format_dispatch_line(dispatch: Dispatch, user_max: int) -> str:
    """The per-dispatch log line."""
    return (
        f"Dynamic batch dispatch: size={dispatch.size}/{dispatch.size_limit}, user_max={user_max}, "
        f"queue_wait={dispatch.queue_wait_ms:.2f}ms, stop_reason={dispatch.stop_reason}"
    )


def top_rejects(rejects: dict[str, int], limit: int = TOP_REJECTS) -> list[tuple[str, int]]:
    """The ``limit`` most frequent reject reasons, most frequent first, ties by name."""
    ranked = sorted(((reason, count) for reason, count in rejects.items() if count > 0), key=lambda rc: (-rc[1], rc[0]))
    return ranked[:limit]


def format_top_rejects(rejects: dict[str, int]) -> str:
    """``resolution:3,num_inference_steps:1`` or ``none``."""
    return _format_ranked(top_rejects(rejects))


def _format_ranked(ranked: Iterable[tuple[str, int] | list]) -> str:
    text = ",".join(f"{reason}:{count}" for reason, count in ranked)
    return text or "none"


def percentile_nearest_rank(values: Iterable[float], pct: float) -> float:
    """Nearest-rank percentile: the ``ceil(pct/100 * n)``-th smallest value (0.0 when empty)."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    rank = max(1, math.ceil(pct * len(ordered) / 100.0))  # pct * n first: exact for integral pct
    return ordered[rank - 1]


class _Totals:
    """Sums over a set of dispatches; ``summary`` turns them into the reported figures."""

    def __init__(self) -> None:
        self.dispatches = 0
        self.requests = 0
        self.merged = 0
        self.full = 0
        self.slots = 0  # sum of user_max
        self.wait_sum_ms = 0.0
        self.rejects: collections.Counter[str] = collections.Counter()
        self.stop_reasons: collections.Counter[str] = collections.Counter()
        self.sizes: collections.Counter[int] = collections.Counter()

    def add(self, entry: "_Entry") -> None:
        self.dispatches += 1
        self.requests += entry.size
        self.merged += entry.size > 1
        self.full += entry.full
        self.slots += entry.user_max
        self.wait_sum_ms += entry.wait_ms
        self.rejects.update(entry.rejects)
        self.stop_reasons[entry.stop_reason] += 1
        self.sizes[entry.size] += 1

    def summary(self, waits_ms: Iterable[float]) -> dict[str, Any]:
        n = self.dispatches
        return {
            "dispatches": n,
            "requests": self.requests,
            "avg_size": self.requests / n if n else 0.0,
            "merged_rate": self.merged / n if n else 0.0,
            "full_rate": self.full / n if n else 0.0,
            "utilization": self.requests / self.slots if self.slots else 0.0,
            "wait_avg_ms": self.wait_sum_ms / n if n else 0.0,
            "wait_p95_ms": percentile_nearest_rank(waits_ms, 95.0),
            "top_rejects": [list(rc) for rc in top_rejects(self.rejects)],
            "rejects": dict(sorted(self.rejects.items())),
            "stop_reasons": dict(sorted(self.stop_reasons.items())),
            "size_histogram": dict(sorted(self.sizes.items())),
        }


class _Entry:
    __slots__ = ("size", "full", "user_max", "wait_ms", "rejects", "stop_reason")

    def __init__(self, dispatch: Dispatch, user_max: int) -> None:
        self.size = dispatch.size
        self.full = dispatch.full
        self.user_max = user_max
        self.wait_ms = dispatch.queue_wait_ms
        self.rejects = dict(dispatch.rejects)
        self.stop_reason = dispatch.stop_reason


def format_stats_line(summary: dict[str, Any]) -> str:
    """The periodic stats line for a ``summary`` (rates as fractions, printed as percent)."""
    return (
        f"Dynamic batch stats (last {summary['dispatches']} dispatches): "
        f"avg_size={summary['avg_size']:.2f}, "
        f"merged_rate={summary['merged_rate'] * 100:.1f}%, "
        f"full_rate={summary['full_rate'] * 100:.1f}%, "
        f"utilization={summary['utilization'] * 100:.1f}%, "
        f"wait_avg={summary['wait_avg_ms']:.2f}ms, "
        f"wait_p95={summary['wait_p95_ms']:.2f}ms, "
        f"top_rejects={_format_ranked(summary['top_rejects'])}"
    )


class BatchMetrics:
    """Counts dispatches (always: the ``stats`` request reads them) and makes the log lines.

    ``record`` returns the lines for a dispatch; with ``log=True`` (``--enable-batching-metrics``)
    it also logs them at INFO on this module's logger.
    """

    def __init__(self, *, stats_every: int = 5, log: bool = False) -> None:
        if isinstance(stats_every, bool) or not isinstance(stats_every, int) or stats_every < 1:
            raise ValueError(f"stats_every must be an integer >= 1, got {stats_every!r}")
        self.stats_every = stats_every
        self.log = log
        self._window: collections.deque[_Entry] = collections.deque(maxlen=stats_every)
        self._totals = _Totals()
        self._recent_waits_ms: collections.deque[float] = collections.deque(maxlen=P95_HISTORY)

    def record(self, dispatch: Dispatch, user_max: int) -> list[str]:
        """Count a dispatch; return its dispatch line, plus the stats line every ``stats_every``."""
        entry = _Entry(dispatch, user_max)
        self._window.append(entry)
        self._totals.add(entry)
        self._recent_waits_ms.append(entry.wait_ms)
        lines = [format_dispatch_line(dispatch, user_max)]
        if self._totals.dispatches % self.stats_every == 0:
            lines.append(format_stats_line(self._window_summary()))
        if self.log:
            for line in lines:
                logger.info("%s", line)
        return lines

    def snapshot(self) -> dict[str, Any]:
        """Counters for the server's ``stats`` request.

        ``{"stats_every": K, "cumulative": {...}, "window": {...}}``; ``window`` covers the last
        ``K`` dispatches (fewer at start). Each has ``dispatches``, ``requests``, ``avg_size``,
        ``merged_rate``, ``full_rate``, ``utilization`` (fractions 0..1, not percent),
        ``wait_avg_ms``, ``wait_p95_ms`` (cumulative: over the last ``P95_HISTORY`` dispatches),
        ``top_rejects`` (``[[reason, count], ...]``), ``rejects``, ``stop_reasons`` and
        ``size_histogram`` (batch size -> dispatches).
        """
        return {
            "stats_every": self.stats_every,
            "cumulative": self._totals.summary(self._recent_waits_ms),
            "window": self._window_summary(),
        }

    def _window_summary(self) -> dict[str, Any]:
        totals = _Totals()
        for entry in self._window:
            totals.add(entry)
        return totals.summary(entry.wait_ms for entry in self._window)
