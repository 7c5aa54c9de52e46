"""``tilecast bench attention``: forward TFLOP/s of every available attention backend.

Sequence lengths are those of real Kandinsky 6 SR tiles (13,824 tokens for the small workload,
47,616 for the large); head dim 64 (the model's) and 128 at the same model width (1792). Every
backend returns the log-sum-exp that Ring needs. FLOPs: 4 * S^2 * D per head (QK^T and PV).
"""

from __future__ import annotations

import statistics

import torch

from tilecast.kernels.attention import attention
from tilecast.kernels.backends import available_backends

H200_DENSE_BF16_TFLOPS = 989.0
MODEL_DIM = 1792


def time_backend(backend: str, seq_len: int, head_dim: int, *, iters: int = 10, dtype=torch.bfloat16) -> float:
    """Median seconds of one forward call."""
    heads = MODEL_DIM // head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, seq_len, heads, head_dim, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
    for _ in range(2):
        attention(q, k, v, backend=backend)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        attention(q, k, v, backend=backend)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def bench_attention(seq_lens=(13_824, 47_616), head_dims=(64, 128), backends=None, iters: int = 10) -> list[dict]:
    if not torch.cuda.is_available():
        raise ValueError("tilecast bench attention needs a CUDA GPU")
    device = torch.device("cuda")
    names = backends or [name for name in available_backends(device, torch.bfloat16) if name != "sdpa_math"]
    rows = []
    for head_dim in head_dims:
        for seq_len in seq_lens:
            heads = MODEL_DIM // head_dim
            flops = 4 * seq_len * seq_len * head_dim * heads
            for name in names:
                try:
                    seconds = time_backend(name, seq_len, head_dim, iters=iters)
                except Exception as exc:  # noqa: BLE001 - a backend that cannot run this shape is reported
                    rows.append({"backend": name, "head_dim": head_dim, "seq_len": seq_len, "error": str(exc)[:120]})
                    continue
                tflops = flops / seconds / 1e12
                rows.append({"backend": name, "head_dim": head_dim, "seq_len": seq_len, "ms": seconds * 1e3,
                             "tflops": tflops, "of_peak": tflops / H200_DENSE_BF16_TFLOPS})
    return rows
