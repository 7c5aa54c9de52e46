"""``bench.timeline``: a profiled loop's GPU operations cut into steps (``bench step --profile``).

A synthetic Chrome trace of four steps, two attention kernels a step, with a memset and a GEMM
between them at known times: the middle step's span, busy time and gaps, its operations by kind and
by name (gaps before each), every step's length and busy time and what ran before the first attention are what
the trace says; the attention kernel is found as the one name that runs twice in each of the four
steps; CPU events are not GPU operations.
"""

from __future__ import annotations

import pytest

from tilecast.launcher.bench import timeline


def _trace(step_lengths_us: list[float]) -> dict:
    events, t = [{"ph": "X", "cat": "kernel", "name": "embed", "ts": 0.0, "dur": 5.0}], 10.0
    for length in step_lengths_us:  # per step: attention, memset, gemm, attention, then idle to the step's end
        start = t
        for name, cat, gap, dur in (
            ("sdpa_fprop", "kernel", 0.0, 30.0),
            ("Memset (Device)", "gpu_memset", 2.0, 1.0),
            ("nvjet_gemm", "kernel", 4.0, 50.0),
            ("sdpa_fprop", "kernel", 0.5, 30.0),
        ):
            t += gap
            events.append({"ph": "X", "cat": cat, "name": name, "ts": t, "dur": dur})
            t += dur
        t = start + length
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1.0, "dur": 999.0})
    return {"traceEvents": events}


def test_a_loop_is_cut_into_steps_with_their_gaps():
    ops = timeline.gpu_operations(_trace([200.0, 210.0, 220.0, 230.0]))
    assert len(ops) == 1 + 4 * 4  # the CPU event is not one
    marker = timeline.periodic_name(ops, per_period=2, periods=4)
    assert marker == "sdpa_fprop"
    lines = timeline.summarize(ops, marker=marker, marks_per_period=2)
    # the middle step is the second (210 µs): busy 30 + 1 + 50 + 30 = 111 µs, the rest gaps: 2 before
    # the memset, 4 before the GEMM, 0.5 before the second attention, 92.5 before the next step's first
    assert lines[0].startswith("period 2 of 4")
    assert "span 0.210 ms, busy 0.111 ms, gaps 0.099 ms; 4 operations 1 gpu_memset, 3 kernel" in lines[0]
    rows = {line.split()[-1]: line.split()[:3] for line in lines[2:5]}
    assert rows["nvjet_gemm"] == ["1", "50.0", "4.0"] and rows["sdpa_fprop"] == ["2", "60.0", "93.0"]
    assert rows["(Device)"] == ["1", "1.0", "2.0"]
    assert "period lengths (ms): 0.20 0.21 0.22" in lines
    assert "period busy (ms): 0.11 0.11 0.11" in lines  # the steps differ by their idle ends only
    assert "before the first mark: 0.01 ms, 1 operations" in lines


def test_too_few_marks_are_refused_naming_the_marker():
    ops = timeline.gpu_operations(_trace([200.0]))
    assert timeline.periodic_name(ops, per_period=2, periods=4) is None
    with pytest.raises(ValueError, match="found 2 operations named like 'sdpa': fewer than two periods of 2"):
        timeline.summarize(ops, marker="sdpa", marks_per_period=2)
