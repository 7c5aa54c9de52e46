"""A profiled call's GPU timeline, read from PyTorch's Chrome trace (``bench step --profile``).

The profiler's table sums each kernel's time; what a CUDA-graphed step loses between its kernels
only shows on the timeline. ``gpu_operations`` takes the kernels, memsets and copies of a trace in
the order the GPU ran them; ``summarize`` cuts them into periods at a marker kernel (FLUX: the
attention kernel, ``marks_per_period`` of them a step; ``periodic_name`` finds it) and reports, as text lines: one middle
period's span, busy time and gaps, its operations by kind, its heaviest operations (count, busy
µs, µs of gaps before them, which add up to the period's gaps), every period's length and busy
time (a period longer by its busy time ran slower kernels: a GPU whose clock drops under sustained
load; longer by its gaps: the GPU waited on the host), and what ran before the first marker.

Times in the trace are microseconds. Imports no torch.
"""

from __future__ import annotations

import collections
from typing import Any

GPU_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")


def gpu_operations(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """The trace's GPU operations (complete events of the kernel, memset and copy categories), by start."""
    events = trace.get("traceEvents", [])
    return sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])


def periodic_name(ops: list[dict[str, Any]], *, per_period: int, periods: int) -> str | None:
    """The name of the first operation that runs exactly ``per_period`` times in each of ``periods``
    periods (FLUX's attention kernel: once a block, 57 times a step), or ``None``."""
    counts = collections.Counter(op["name"] for op in ops)
    return next((op["name"] for op in ops if counts[op["name"]] == per_period * periods), None)


def _gap(ops: list[dict[str, Any]], i: int) -> float:
    """Idle µs between operation ``i - 1``'s end and operation ``i``'s start (0 for the first)."""
    return max(0.0, ops[i]["ts"] - (ops[i - 1]["ts"] + ops[i - 1]["dur"])) if i else 0.0


def summarize(ops: list[dict[str, Any]], *, marker: str, marks_per_period: int, top: int = 25) -> list[str]:
    """Report lines for ``ops`` cut into periods at every ``marks_per_period``-th operation whose
    name holds ``marker``; ``ValueError`` when fewer than two periods' marks are there."""
    marks = [i for i, op in enumerate(ops) if marker in op["name"]]
    periods = len(marks) // marks_per_period
    if marks_per_period < 1 or periods < 2:
        raise ValueError(
            f"found {len(marks)} operations named like {marker!r}: fewer than two periods of {marks_per_period}"
        )
    starts = [marks[p * marks_per_period] for p in range(periods)]
    middle = periods // 2 - 1
    first, last = starts[middle], starts[middle + 1]
    span = ops[last]["ts"] - ops[first]["ts"]
    busy = sum(ops[i]["dur"] for i in range(first, last))
    kinds = collections.Counter(ops[i]["cat"] for i in range(first, last))
    lines = [
        f"period {middle + 1} of {periods} ({marker!r} x {marks_per_period} to the next): span {span / 1e3:.3f} ms, "
        f"busy {busy / 1e3:.3f} ms, gaps {(span - busy) / 1e3:.3f} ms; {last - first} operations "
        + ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()))
    ]
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for i in range(first, last):
        row = by_name[ops[i]["name"][:90]]
        row[0] += 1
        row[1] += ops[i]["dur"]
        row[2] += _gap(ops, last if i == first else i)  # the marker's gap inside the span: the next one's
    lines.append("heaviest operations of that period (count, busy µs, gaps before them µs):")
    for name, (count, busy_us, gap_us) in sorted(by_name.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))[:top]:
        lines.append(f"  {count:5d} {busy_us:10.1f} {gap_us:9.1f}  {name}")
    lengths = [(ops[b]["ts"] - ops[a]["ts"]) / 1e3 for a, b in zip(starts, starts[1:])]
    busy_ms = [sum(op["dur"] for op in ops[a:b]) / 1e3 for a, b in zip(starts, starts[1:])]
    lines.append("period lengths (ms): " + " ".join(f"{length:.2f}" for length in lengths))
    lines.append("period busy (ms): " + " ".join(f"{busy:.2f}" for busy in busy_ms))
    lines.append(f"before the first mark: {(ops[marks[0]]['ts'] - ops[0]['ts']) / 1e3:.2f} ms, {marks[0]} operations")
    return lines
