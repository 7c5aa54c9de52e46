"""The GPU's SM clock and power draw while one side of a bench is timed (``bench step``, ``k6sr``, ``attention``,
the whole-tile decodes of ``fp8-conv`` / ``narrow-conv``).

A card held at its power limit lowers its clock, so the two sides of one run can be timed at
different clocks: on an H100 (2026-12-07) diffusers' eager FLUX loop ran at 1935-1980 MHz and
tilecast's graphed loop at 1395-1650 MHz, both near the card's 700 W. ``ClockSampler`` calls a
reader every ``interval_s`` on a thread between ``start`` and ``stop`` and summarizes what it read.
``nvml_reader`` reads ``torch.cuda.clock_rate`` and ``torch.cuda.power_draw`` (NVML through
``pynvml``, the ``bench`` extra); without ``pynvml``, on a CPU, or where NVML does not answer there
is no reader and the sampler reads nothing (``summary()`` is empty). NVML averages each reading over
1/6 s to 1 s, so ten readings a second lose nothing; one reading took 24-26 µs of a host thread on
an H100 machine, 0.03% of the host's time at that rate, which a host-bound side (diffusers' eager
loop) does not feel.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
from typing import Callable, Optional

import torch


@dataclasses.dataclass(frozen=True)
class Sample:
    sm_mhz: float
    power_w: float


def nvml_reader(device: "torch.device | str") -> Optional[Callable[[], Sample]]:
    """A reader of ``device``'s SM clock and power draw, or ``None`` where NVML cannot give them."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    try:
        import pynvml
    except ImportError:
        return None

    def read() -> Sample:
        return Sample(sm_mhz=torch.cuda.clock_rate(device), power_w=torch.cuda.power_draw(device) / 1e3)

    try:
        read()
    except pynvml.NVMLError:
        return None
    return read


class ClockSampler:
    """Samples of ``read`` taken every ``interval_s`` from ``start`` to ``stop`` (no reader: none)."""

    def __init__(self, read: Optional[Callable[[], Sample]], *, interval_s: float = 0.1) -> None:
        self._read, self._interval_s = read, interval_s
        self._samples: list[Sample] = []
        self._stopping = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        if self._read is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="clock-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stopping.set()
            self._thread.join()

    def _run(self) -> None:
        while True:
            self._samples.append(self._read())
            if self._stopping.wait(self._interval_s):
                return

    def summary(self, prefix: str) -> dict[str, float]:
        """``{prefix}sm_mhz`` (mean), ``{prefix}sm_mhz_min`` and ``{prefix}power_w`` (mean) of the
        samples taken; empty when none were."""
        if not self._samples:
            return {}
        clocks = [sample.sm_mhz for sample in self._samples]
        return {
            f"{prefix}sm_mhz": statistics.fmean(clocks),
            f"{prefix}sm_mhz_min": min(clocks),
            f"{prefix}power_w": statistics.fmean(sample.power_w for sample in self._samples),
        }
