"""CUDA fast paths against their reference paths (skipped without a GPU).

Tolerances, on the tiny checkpoint's float video in [-1, 1]:
- the default attention backend (cuDNN SDPA on Hopper) vs the math backend, fp32 model: max 5e-3
  (cuDNN kernels and TF32 convolutions reorder sums; measured on an H200: 1.16e-3);
- ``torch.compile`` of the DiT blocks vs eager, fp32: max 5e-3 (measured on an H200: 1.19e-3);
- the bf16 pipeline vs fp32: PSNR above 30 dB (bf16 rounding through 2 DiT steps and the VAE).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _parts(dtype, backend=None, compile_blocks=False):
    from tilecast.runtime.k6sr.attention import install_dense_attention
    from tilecast.runtime.k6sr.loading import load_components
    from tilecast.runtime.k6sr.tiny import ensure_tiny_k6sr

    parts = load_components(ensure_tiny_k6sr(), device=torch.device("cuda"), dtype=dtype)
    install_dense_attention(parts.transformer, backend=backend)
    if compile_blocks:
        parts.transformer.compile_repeated_blocks()
    return parts


def _upscale(parts):
    from tilecast.runtime.k6sr.bench import pattern_video
    from tilecast.runtime.k6sr.stages import SRSettings, frames_to_video, upscale_video

    video = frames_to_video(torch.from_numpy(pattern_video(128, 64, 9)), parts.device)
    with torch.no_grad():
        out, _ = upscale_video(parts, video, SRSettings(scale=2, seed=3))
    return out.float().cpu()


def test_default_attention_backend_matches_math():
    reference = _upscale(_parts(torch.float32, backend="sdpa_math"))
    assert (_upscale(_parts(torch.float32)) - reference).abs().max().item() <= 5e-3


def test_compiled_dit_matches_eager():
    eager = _upscale(_parts(torch.float32))
    assert (_upscale(_parts(torch.float32, compile_blocks=True)) - eager).abs().max().item() <= 5e-3


def test_bf16_pipeline_close_to_fp32():
    reference = _upscale(_parts(torch.float32))
    out = _upscale(_parts(torch.bfloat16))
    mse = ((out - reference) ** 2).mean().item() / 4  # [-1, 1] -> [0, 1]
    psnr = 10 * torch.log10(torch.tensor(1.0 / mse)).item()
    assert psnr > 30, psnr
