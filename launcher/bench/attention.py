"""``tilecast bench attention``: forward TFLOP/s of every available attention backend.

Sequence lengths are those of real Kandinsky 6 SR tiles (13,824 tokens for the small workload,
47,616 for the large); head dim 64 (the model's) and 128 at the same model width (1792). Every
backend returns the log-sum-exp that Ring needs. FLOPs: 4 * S^2 * D per head (QK^T and PV).
With NVML (the ``bench`` extra) each row also carries the GPU's mean SM clock and power while its
backend was timed (``sm_mhz``, ``sm_mhz_min``, ``power_w``; ``gpu_clock``).
"""

from __future__ import annotations

import torch

from tilecast.kernels.attention import attention
from tilecast.kernels.backends import available_backends, resolve_backend
from tilecast.launcher.bench import gpu_clock
from tilecast.launcher.bench.report import psnr_db, time_repeated

H200_DENSE_BF16_TFLOPS = 989.0
"""The H200's dense bf16 peak, TFLOP/s (the "of peak" column)."""
MODEL_DIM = 1792
"""Kandinsky 6 SR's model width: heads = MODEL_DIM // head_dim."""


def _inputs(seq_len: int, head_dim: int, dtype=torch.bfloat16) -> tuple[torch.Tensor, ...]:
    heads = MODEL_DIM // head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    return tuple(torch.randn(1, seq_len, heads, head_dim, device="cuda", dtype=dtype, generator=gen) for _ in range(3))


FP8_TILING_PREFIX = "fp8:"
"""A backend name ``fp8:<tiling>`` runs the fp8 kernel with that ``KernelConfig`` (e.g. ``fp8:128x64w4s3``)."""


def runner(backend: str):
    """``fn(q, k, v) -> (out, lse)`` for ``backend``, or for the fp8 kernel at a tiling
    (``fp8:<tiling>``, parsed here once: ``ValueError`` naming the form)."""
    if backend.startswith(FP8_TILING_PREFIX):
        from tilecast.kernels.fp8_attention import KernelConfig, run_kernels

        config = KernelConfig.parse(backend.removeprefix(FP8_TILING_PREFIX))
        return lambda q, k, v: run_kernels(q, k, v, scale=q.shape[-1] ** -0.5, config=config)
    return lambda q, k, v: attention(q, k, v, backend=backend)


def time_call(fn, q, k, v, *, iters: int = 10, clock: gpu_clock.ClockSampler | None = None) -> float:
    """Median seconds of one forward call (two warm-up calls; GPU time between CUDA events);
    ``clock`` samples the GPU's clock and power during the timed calls."""
    timing = time_repeated(lambda: fn(q, k, v), repeats=iters, warmup=2, device="cuda", cuda_events=True, during=clock)
    return timing.median_s


def bench_attention(seq_lens=(13_824, 47_616), head_dims=(64, 128), backends=None, iters: int = 10) -> list[dict]:
    """One row per (head dim, sequence length, backend): ms, TFLOP/s, the fraction of the H200's
    peak, the speed and the PSNR against the default backend on the same inputs (``fp8`` departs
    from bf16 there), or the error of a backend that cannot run the shape."""
    runners = {name: runner(name) for name in backends or ()}  # a bad tiling is named before any GPU is needed
    if not torch.cuda.is_available():
        raise ValueError("tilecast bench attention needs a CUDA GPU")
    device = torch.device("cuda")
    default = resolve_backend(None, device, torch.bfloat16).name
    if not runners:
        available = available_backends(device, torch.bfloat16)
        runners = {name: runner(name) for name in available if name != "sdpa_math"}
    default_fn = runners.get(default) or runner(default)
    reader = gpu_clock.nvml_reader(device)
    rows = []
    for head_dim in head_dims:
        for seq_len in seq_lens:
            q, k, v = _inputs(seq_len, head_dim)
            flops = 4 * seq_len * seq_len * head_dim * q.shape[2]
            reference = default_fn(q, k, v)[0]
            default_clock = gpu_clock.ClockSampler(reader)
            default_s = time_call(default_fn, q, k, v, iters=iters, clock=default_clock)
            for name, fn in runners.items():
                clock = default_clock if name == default else gpu_clock.ClockSampler(reader)
                try:
                    seconds = default_s if name == default else time_call(fn, q, k, v, iters=iters, clock=clock)
                    out = reference if name == default else fn(q, k, v)[0]
                except Exception as exc:  # noqa: BLE001 - a backend that cannot run this shape is reported
                    rows.append({"backend": name, "head_dim": head_dim, "seq_len": seq_len, "error": str(exc)[:120]})
                    continue
                tflops = flops / seconds / 1e12
                rows.append(
                    {
                        "backend": name,
                        "head_dim": head_dim,
                        "seq_len": seq_len,
                        "ms": seconds * 1e3,
                        "tflops": tflops,
                        "of_peak": tflops / H200_DENSE_BF16_TFLOPS,
                        "x_default": default_s / seconds,
                        "psnr_vs_default": psnr_db(out, reference),
                        **clock.summary(""),
                    }
                )
            del q, k, v, reference
    return rows
