"""``bench.gpu_clock``: the GPU's clock and power sampled while one side of ``bench step`` is timed.

A stand-in reader counts its calls and answers a known sequence: the sampler reads only between
``start`` and ``stop``, and its summary is the mean and least clock and the mean power of exactly
what was read. Without a reader (a CPU, no ``pynvml``, NVML not answering) nothing is read and the
summary is empty. ``bench step`` puts each side's summary in its row, sampled after the side's
warm-up (the stand-in sees no call during it) and stopped when its timing ends; ``bench k6sr``'s
measurement of a side does the same over its timed requests, the convolution benches' whole-tile
decodes over theirs, and ``bench attention``'s rows over each backend's timed calls (on a GPU).
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from tilecast.launcher.bench import gpu_clock


class CountingReader:
    def __init__(self) -> None:
        self.samples: list[gpu_clock.Sample] = []
        self.read_once = threading.Event()

    def __call__(self) -> gpu_clock.Sample:
        sample = gpu_clock.Sample(sm_mhz=1980 - 15 * len(self.samples), power_w=650 + len(self.samples))
        self.samples.append(sample)
        if len(self.samples) >= 3:
            self.read_once.set()
        return sample


def test_the_sampler_summarizes_what_it_read_between_start_and_stop():
    read = CountingReader()
    sampler = gpu_clock.ClockSampler(read, interval_s=0.001)
    assert read.samples == [] and sampler.summary("x_") == {}  # nothing read before start
    sampler.start()
    assert read.read_once.wait(timeout=10)
    sampler.stop()
    taken = len(read.samples)  # stopped: the thread has ended
    clocks = [sample.sm_mhz for sample in read.samples]
    summary = sampler.summary("tilecast_")
    assert summary == {
        "tilecast_sm_mhz": pytest.approx(sum(clocks) / taken),
        "tilecast_sm_mhz_min": min(clocks),
        "tilecast_power_w": pytest.approx(sum(sample.power_w for sample in read.samples) / taken),
    }


def test_without_a_reader_nothing_is_sampled(monkeypatch):
    sampler = gpu_clock.ClockSampler(None)
    sampler.start()
    sampler.stop()
    assert sampler.summary("diffusers_") == {}
    assert gpu_clock.nvml_reader("cpu") is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: import fails
    assert gpu_clock.nvml_reader("cuda") is None


def test_bench_step_rows_carry_each_sides_clock_sampled_after_its_warmup(tiny_cache, monkeypatch):
    from tilecast.launcher.bench import step
    from tilecast.runtime.models.families.flux import FluxT2IPipeline

    reader, seen = CountingReader(), []  # seen: the reads made before each call of either side
    timed = step.time_repeated

    def watched(call, **kwargs):
        def counted():
            seen.append(len(reader.samples))
            return call()

        return timed(counted, **kwargs)

    monkeypatch.setattr(step, "time_repeated", watched)
    monkeypatch.setattr(step.gpu_clock, "nvml_reader", lambda device: reader)
    (row,) = step.run_step_bench(
        FluxT2IPipeline.builtin_name,
        width=32,
        height=32,
        batch_sizes=[1],
        device="cpu",
        dtype="float32",
        compile_blocks=False,
        attention_backend="sdpa_math",
        warmup=2,
        iters=2,
    )
    for side in ("diffusers_", "tilecast_"):
        assert row[f"{side}sm_mhz"] > 0 and row[f"{side}power_w"] >= 650
        assert row[f"{side}sm_mhz_min"] <= row[f"{side}sm_mhz"]
    # calls 0-1: diffusers' warm-up, 2-3 its timed loop, 4-5 tilecast's warm-up, 6-7 its timed loop
    assert seen[:2] == [0, 0]  # nothing read during diffusers' warm-up
    assert seen[4] == seen[5] >= 1  # diffusers' sampler read and stopped; nothing read in tilecast's warm-up
    assert len(reader.samples) > seen[5]  # tilecast's sampler read during its timing


def test_bench_k6sr_rows_carry_the_clock_of_their_timed_requests(monkeypatch):
    """``bench k6sr``'s measurement of one side (GPU-only; its CUDA calls stood in for here): the
    sampler starts after the warm-up request and its summary goes into the measurement."""
    import types

    from tilecast.launcher.bench import k6sr, report

    reader, seen = CountingReader(), []
    monkeypatch.setattr(k6sr.gpu_clock, "nvml_reader", lambda device: reader)
    monkeypatch.setattr(report, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *args: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *args: 0)
    timer = types.SimpleNamespace(times={"dit": 0.0}, decoded=[], reset=lambda: None)

    def request() -> torch.Tensor:
        seen.append(len(reader.samples))
        assert len(seen) == 1 or reader.read_once.wait(timeout=10)  # a timed request: the sampler reads
        return torch.zeros(2)

    measured = k6sr._measure("tilecast", "small", request, timer, repeats=2)
    assert seen[0] == 0  # the warm-up request ran before the sampler started
    assert set(measured.clock) == {"sm_mhz", "sm_mhz_min", "power_w"}
    assert measured.clock["sm_mhz"] == pytest.approx(sum(s.sm_mhz for s in reader.samples) / len(reader.samples))


def test_bench_conv_decode_rows_carry_the_clock_of_their_timed_decodes(monkeypatch):
    """``bench fp8-conv --decode`` / ``narrow-conv --decode`` time each whole-tile decode with
    ``time_decode`` (GPU-only; its CUDA calls stood in for here): the sampler starts after the
    warm-up decode and its summary comes back with the time."""
    from tilecast.launcher.bench import narrow_conv, report

    reader, seen = CountingReader(), []
    monkeypatch.setattr(narrow_conv.gpu_clock, "nvml_reader", lambda device: reader)
    monkeypatch.setattr(report, "synchronize", lambda device=None: None)

    def decode() -> None:
        seen.append(len(reader.samples))
        assert len(seen) == 1 or reader.read_once.wait(timeout=10)  # a timed decode: the sampler reads

    ms, clock = narrow_conv.time_decode(decode, iters=2)
    assert seen[0] == 0 and len(seen) == 3 and ms > 0  # the warm-up decode ran before the sampler started
    taken = len(reader.samples)
    assert clock == {
        "sm_mhz": pytest.approx(sum(s.sm_mhz for s in reader.samples) / taken),
        "sm_mhz_min": min(s.sm_mhz for s in reader.samples),
        "power_w": pytest.approx(sum(s.power_w for s in reader.samples) / taken),
    }


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bench_attention_rows_carry_the_clock_of_their_timed_calls(monkeypatch):
    from tilecast.launcher.bench import attention

    reader = CountingReader()
    monkeypatch.setattr(attention.gpu_clock, "nvml_reader", lambda device: reader)
    rows = attention.bench_attention(seq_lens=(1024,), head_dims=(64,), iters=3)
    timed = [row for row in rows if "ms" in row]
    assert timed and all(row["sm_mhz"] > 0 and row["power_w"] >= 650 for row in timed)
    assert len(reader.samples) >= len(timed)  # a sampler per backend's timing, each reading at least once
