"""``tilecast bench fp8-conv``: the K-VAE decoder's wide 3x3x3 convolutions, cuDNN in bf16 against
``kernels/fp8_conv.py``'s FP8 kernel, in the same run.

One convolution per decoder level of a large tile (2048 channels on the 32 x 48 latent grid, 1024 /
512 / 256 on 2x / 4x / 8x), ``frames`` output frames with two causal frames in front, channels-last
bf16 as ``ChannelsLastDecoder`` runs them. Each row: GPU milliseconds (median of CUDA-event
timings; the FP8 rows include quantizing the input, whose own time is ``quantize_ms``), TFLOP/s
(2 per multiply-add), speed against cuDNN and PSNR against the float32 convolution without TF32.

``decode=True`` adds one large tile's whole decode (64 x 31 x 32 x 48 latents, the released K-VAE
with seeded random weights), bf16, with ``ChannelsLastDecoder``'s defaults and with ``fp8_convs``;
their PSNR is the first segment's against diffusers' float32 decode (``narrow_conv.decode_rows``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tilecast.launcher.bench.narrow_conv import cudnn_case, decode_rows, layer_row, time_ms

LEVELS = {"2048 @ 32x48": (2048, 32, 48), "1024 @ 64x96": (1024, 64, 96), "512 @ 128x192": (512, 128, 192)}
LEVELS["256 @ 256x384"] = (256, 256, 384)
"""Each level's resnet convolution: channels in and out, height, width."""


def bench_fp8_conv(
    tilings: list[str] | None = None,
    *,
    frames: int = 8,
    iters: int = 10,
    decode: bool = False,
    profile_dir: Path | None = None,
) -> list[dict]:
    """One row per (level, implementation): cuDNN bf16, then the FP8 kernel at its default tiling and
    at each of ``tilings`` (``Tiling.parse`` form; a bad one is named before any GPU is needed)."""
    from tilecast.kernels import fp8_conv

    parsed = [fp8_conv.Tiling.parse(text) for text in tilings or ()]
    if profile_dir is not None and not decode:
        raise ValueError("--profile profiles the whole-tile decodes: pass --decode with it")
    if not torch.cuda.is_available():
        raise ValueError("tilecast bench fp8-conv needs a CUDA GPU")
    fp8_conv.check_supported(torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for level, (channels, height, width) in LEVELS.items():
        rows += _level_rows(level, channels, (frames, height, width), [fp8_conv.Tiling(), *parsed], iters, gen)
        torch.cuda.empty_cache()
    variants = {"bf16": {}, "fp8_convs": dict(fp8_convs=True)}
    return rows + (decode_rows(variants, max(1, iters // 5), profile_dir) if decode else [])


def _level_rows(level, channels, size, tilings, iters, gen) -> list[dict]:
    from tilecast.kernels import fp8_conv

    x, weight, flops, expected, cudnn_row = cudnn_case(level, channels, channels, size, iters, gen)
    cudnn_ms, rows = cudnn_row["ms"], [{**cudnn_row, "kernel": "cudnn bf16"}]
    packed = fp8_conv.pack_weight(weight)
    quantize_ms = time_ms(lambda: fp8_conv.quantize_padded(x, (1, 1)), iters)
    for tiling in tilings:

        def call(tiling=tiling):
            return fp8_conv.fp8_conv(x, packed, (1, 1), tiling)

        try:
            ms = time_ms(call, iters)
        except Exception as exc:  # noqa: BLE001 - a tiling that cannot compile (shared memory) is reported
            rows.append({"layer": level, "kernel": f"fp8:{tiling}", "error": str(exc)[:120]})
            continue
        row = layer_row(level, f"fp8:{tiling}", ms, cudnn_ms, flops, call(), expected)
        rows.append({**row, "quantize_ms": quantize_ms})
    return rows
