"""What every ``tilecast bench`` shares: synchronized timing, the peer comparison, the report.

- Timing: ``time_calls`` times a list of calls one by one (device synchronized around each, or
  timed by CUDA events), ``time_repeated`` warms up and then times one call ``repeats`` times
  (each call on its own, or the whole loop with one synchronization at its end). Both return a
  ``Timing``: the warm-up's seconds, the timed calls' wall seconds, each call's seconds, the last
  result.
- Peer comparison: ``ratio`` (tilecast / peer, NaN when the peer took no time) and ``psnr_db`` /
  ``max_rel_diff`` of tilecast's output against the peer's.
- Report: ``print_table`` prints rows as one table (cells formatted by ``fmt``) and ``save_json``
  writes the rows when ``--json-out`` asks; ``profile_call`` writes one call's profiler table
  (``--profile``).

Imports no torch at module import time (``tilecast --help`` mounts the bench commands); the
timing functions import it when they run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence

if TYPE_CHECKING:
    import torch

TABLE_WIDTH = 160
"""Smallest console width of a report table (wider terminals get their own width)."""


def synchronize(device: "torch.device | str | None" = None) -> None:
    """Wait for ``device``'s queued work; ``None``: the current CUDA device when CUDA is there.
    A CPU device returns at once."""
    import torch

    if device is None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Timing:
    """Seconds measured by ``time_calls`` / ``time_repeated``."""

    warmup_s: float
    """Wall seconds of the warm-up calls (0 when there were none)."""
    total_s: float
    """Wall seconds of all timed calls together, synchronized at the end."""
    calls_s: tuple[float, ...]
    """Seconds of each timed call (empty when the calls were timed as one loop)."""
    num_calls: int
    """How many calls were timed."""
    result: Any = None
    """What the last timed call returned."""

    @property
    def mean_s(self) -> float:
        """Seconds per timed call, from the total."""
        return self.total_s / self.num_calls

    @property
    def median_s(self) -> float:
        """Median seconds of one call (the mean when calls were timed as one loop)."""
        return statistics.median(self.calls_s) if self.calls_s else self.mean_s

    @property
    def median_low_index(self) -> int:
        """Index of the timed call whose time is the low median (a call that really happened)."""
        if not self.calls_s:
            raise ValueError("calls timed as one loop have no per-call times")
        return self.calls_s.index(statistics.median_low(self.calls_s))


def time_calls(
    calls: Iterable[Callable[[], Any]], *, device: "torch.device | str | None" = None, cuda_events: bool = False
) -> Timing:
    """Run each call once, in order, and time each: synchronized wall time around each call, or
    with ``cuda_events`` the GPU time between CUDA events recorded around it (no host overhead)."""
    import torch

    if cuda_events and not torch.cuda.is_available():
        raise ValueError("cuda_events=True needs a CUDA GPU")
    synchronize(device)
    calls_s, result = [], None
    started = time.perf_counter()
    for call in calls:
        if cuda_events:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            result = call()
            end.record()
            end.synchronize()
            calls_s.append(begin.elapsed_time(end) / 1000)
        else:
            began = time.perf_counter()
            result = call()
            synchronize(device)
            calls_s.append(time.perf_counter() - began)
    total_s = time.perf_counter() - started
    if not calls_s:
        raise ValueError("time_calls needs at least one call")
    return Timing(warmup_s=0.0, total_s=total_s, calls_s=tuple(calls_s), num_calls=len(calls_s), result=result)


def time_repeated(
    call: Callable[[], Any],
    *,
    repeats: int,
    warmup: int = 1,
    device: "torch.device | str | None" = None,
    each: bool = True,
    cuda_events: bool = False,
    after_warmup: Optional[Callable[[], None]] = None,
    during: Any = None,
) -> Timing:
    """``warmup`` untimed calls, then ``repeats`` timed ones. ``each``: each call timed on its own
    (``Timing.calls_s``); otherwise the loop runs unsynchronized and is timed as a whole (what a
    host-bound step measures best). ``after_warmup`` runs between the two (e.g. resetting peak
    memory counters). ``during`` (``start()`` / ``stop()``, e.g. ``gpu_clock.ClockSampler``) is
    started after the warm-up and stopped when the timed calls end, whether or not they raise."""
    for name, value, least in (("repeats", repeats, 1), ("warmup", warmup, 0)):
        if not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    synchronize(device)
    began = time.perf_counter()
    for _ in range(warmup):
        call()
    synchronize(device)
    warmup_s = time.perf_counter() - began
    if after_warmup is not None:
        after_warmup()
    if during is not None:
        during.start()
    try:
        if each:
            timing = time_calls([call] * repeats, device=device, cuda_events=cuda_events)
            return dataclasses.replace(timing, warmup_s=warmup_s)
        result = None
        began = time.perf_counter()
        for _ in range(repeats):
            result = call()
        synchronize(device)
        total_s = time.perf_counter() - began
    finally:
        if during is not None:
            during.stop()
    return Timing(warmup_s=warmup_s, total_s=total_s, calls_s=(), num_calls=repeats, result=result)


def profile_call(
    call: Callable[[], Any],
    path: Path,
    *,
    device: "torch.device | str",
    row_limit: int = 60,
    trace_path: Path | None = None,
) -> Path:
    """Run ``call`` once under ``torch.profiler`` and write its operators, kernels and named ranges
    (``record_function``, e.g. the K-VAE decoder's levels) to ``path`` as a table, sorted by total
    device time on a CUDA device, by CPU time elsewhere; with ``trace_path``, the Chrome trace
    there too (``bench.timeline`` reads it). Returns ``path``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    on_cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_cuda else [])]
    synchronize(device)
    with profile(activities=activities) as prof:
        call()
        synchronize(device)
    sort_by = "device_time_total" if on_cuda else "cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.key_averages().table(sort_by=sort_by, row_limit=row_limit, max_name_column_width=90))
    if trace_path is not None:
        prof.export_chrome_trace(str(trace_path))
    return path


def ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator`` (e.g. tilecast's time over its peer's); NaN when the peer is 0."""
    return numerator / denominator if denominator else float("nan")


def psnr_db(out: "torch.Tensor", reference: "torch.Tensor", peak: float | None = None) -> float:
    """PSNR of ``out`` against ``reference`` in dB (inf when equal); ``peak`` defaults to the
    reference's largest magnitude (pass 1.0 for images in [0, 1])."""
    out, reference = out.float(), reference.float()
    if out.shape != reference.shape:
        raise ValueError(f"cannot compare outputs of shapes {tuple(out.shape)} and {tuple(reference.shape)}")
    mse = (out - reference).square().mean().item()
    if mse == 0:
        return float("inf")
    if peak is None:
        peak = reference.abs().max().item()
    return 10 * math.log10(peak**2 / mse)


def max_rel_diff(out: "torch.Tensor", reference: "torch.Tensor") -> float:
    """Largest absolute difference relative to the reference's largest magnitude."""
    out, reference = out.float(), reference.float()
    return ((out - reference).abs().max() / reference.abs().max()).item()


def fmt(value: Any) -> str:
    """One table cell: floats with 3 decimals (tiny ones in e-notation), None empty, else ``str``."""
    if isinstance(value, float):
        return f"{value:.2e}" if 0 < abs(value) < 0.01 else f"{value:.3f}"
    return "" if value is None else str(value)


def print_table(
    rows: Sequence[dict], columns: Sequence[str], title: str, *, headers: Sequence[str] | None = None
) -> None:
    """Print ``rows`` as one table of ``columns`` (``headers`` names them, default the keys): the
    first column left-aligned and never wrapped, the others right-aligned; a missing cell is empty.
    Cells are plain text: an error's brackets (``tilecast[flash]``) are printed, not read as markup."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    headers = list(headers or columns)
    if len(headers) != len(columns):
        raise ValueError(f"{len(headers)} headers for {len(columns)} columns")
    table = Table(title=title)
    for i, header in enumerate(headers):
        table.add_column(header, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for row in rows:
        table.add_row(*(Text(fmt(row.get(column))) for column in columns))
    console = Console()
    Console(width=max(TABLE_WIDTH, console.width)).print(table)


def save_json(data: Any, path: Optional[Path]) -> None:
    """Write ``data`` as indented JSON to ``path`` (values JSON cannot hold as text); nothing when None."""
    if path is None:
        return
    Path(path).write_text(json.dumps(data, indent=2, default=str))
    print(f"saved {path}")
