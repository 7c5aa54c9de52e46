"""``tilecast bench narrow-conv``: the K-VAE decoder's full-resolution convolutions (few output
channels), cuDNN against ``kernels/narrow_conv.py``'s Triton kernel, in the same run.

One decoder segment of a large tile: ``SEGMENT_FRAMES`` output frames (two causal frames in front)
of 512 x 768 pixels, bf16, channels-last input and weights as ``ChannelsLastDecoder`` runs them.
Each row: GPU milliseconds (median of CUDA-event timings), TFLOP/s (2 per multiply-add of the
real channels), the speed against cuDNN and the PSNR of each side against a float32 cuDNN
convolution without TF32 (so rounding differences show as they are).

``decode=True`` adds the decision itself: one large tile's whole decode (64 x 31 x 32 x 48 latents,
the released K-VAE with seeded random weights) with ``ChannelsLastDecoder`` on cuDNN alone
(``narrow_convs=False``) and with the Triton kernels (``narrow_convs=True``, its default on CUDA),
each in bf16; their PSNR is the first decoder segment's against diffusers' float32 decode (cuDNN
without TF32), and each row carries the GPU's clock and power while it was timed (``sm_mhz``,
``sm_mhz_min``, ``power_w``: a decode runs at the card's power limit). ``profile_dir`` adds each
decode's profile, per decoder level.

A third candidate, ``cudnn-s2d``: the same convolution on the level computed space-to-depth, every
2x2 block of pixels one pixel with four times the channels (``space_to_depth``). A 3x3 kernel on the
fine grid is a 3x3 kernel on the coarse one (``space_to_depth_weight``; three quarters of its taps
zero), so cuDNN runs 64 -> 64 channels instead of 16 -> 16 at four times the multiply-adds. Its row
times the coarse convolution alone: a level kept in that layout would rearrange the pixels in passes
it makes anyway (the upsampler's phase interleave in, the output's permute out).
"""

from __future__ import annotations

import functools
import itertools
from pathlib import Path
from typing import Any, Callable

import torch

from tilecast.launcher.bench import gpu_clock
from tilecast.launcher.bench.report import profile_call, psnr_db, time_repeated

LAYERS = {"256->16": (256, 16), "16->16": (16, 16), "16->3": (16, 3)}
"""The level's convolutions (all 3x3x3): its first block's ``conv1``, the other convolutions, ``conv_out``."""


def time_ms(call, iters: int) -> float:
    """Median GPU milliseconds of ``call`` over ``iters`` CUDA-event timings (after two warm-ups)."""
    return time_repeated(call, repeats=iters, warmup=2, device="cuda", cuda_events=True).median_s * 1e3


def bench_narrow_conv(
    tilings: list[str] | None = None,
    *,
    frames: int | None = None,
    height: int = 512,
    width: int = 768,
    iters: int = 10,
    decode: bool = False,
    profile_dir: Path | None = None,
) -> list[dict]:
    """One row per (layer, implementation): cuDNN, cuDNN space-to-depth, then the Triton kernels at
    their default tilings (plain and reuse) and at each of ``tilings`` (``Tiling.parse`` form; a bad
    one is named before any GPU is needed)."""
    from diffusers.models.autoencoders.autoencoder_kandinsky6_sr import SEGMENT_FRAMES

    from tilecast.kernels.narrow_conv import Tiling

    parsed = [Tiling.parse(text) for text in tilings or ()]
    if profile_dir is not None and not decode:
        raise ValueError("--profile profiles the whole-tile decodes: pass --decode with it")
    if not torch.cuda.is_available():
        raise ValueError("tilecast bench narrow-conv needs a CUDA GPU")
    frames = SEGMENT_FRAMES if frames is None else frames
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for layer, channels in LAYERS.items():
        rows += _layer_rows(layer, *channels, parsed, (frames, height, width), iters, gen)
    variants = {"cudnn": dict(narrow_convs=False), "narrow_convs": dict(narrow_convs=True)}
    return rows + (decode_rows(variants, max(1, iters // 5), profile_dir) if decode else [])


def decode_rows(variants: dict[str, dict], iters: int, profile_dir: Path | None) -> list[dict]:
    """One large tile's decode by ``ChannelsLastDecoder(vae, **options)`` for each ``name: options``
    of ``variants`` (the first is the baseline of ``x_cudnn``), bf16, with each one's PSNR against
    diffusers' float32 decode of the first segment."""
    from diffusers import Kandinsky6SRVAE
    from diffusers.models.autoencoders.autoencoder_kandinsky6_sr import SEGMENT_FRAMES

    from tilecast.runtime.models.k6sr.vae_decode import ChannelsLastDecoder

    torch.manual_seed(0)
    with torch.device("cuda"):
        vae = Kandinsky6SRVAE().eval().requires_grad_(False)
        z = torch.randn(1, vae.config.latent_channels, 31, 32, 48)
    # The PSNR is the first segment's (decoded alone it is the whole decode's first frames: the
    # decode is causal), against diffusers' float32 decode, before ChannelsLastDecoder makes the
    # weights channels-last (cuDNN's exact float32 kernels are NCDHW; the whole tile would not fit).
    first_segment = SEGMENT_FRAMES // int(vae.temporal_compression_ratio) + 1
    with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        exact = vae.decode(z[:, :, :first_segment], return_dict=False)[0]
    vae, z = vae.to(torch.bfloat16), z.bfloat16()
    rows = []
    for name, options in variants.items():
        decoder = ChannelsLastDecoder(vae, **options)
        ms, clock = time_decode(functools.partial(decoder.decode, z), iters)
        cudnn_ms = rows[0]["ms"] if rows else ms
        out = decoder.decode(z[:, :, :first_segment])
        rows.append({**layer_row("large tile decode", name, ms, cudnn_ms, None, out, exact), **clock})
        if profile_dir is not None:
            profile_call(functools.partial(decoder.decode, z), profile_dir / f"decode-{name}.txt", device="cuda")
    return rows


def time_decode(decode: Callable[[], Any], iters: int) -> tuple[float, dict[str, float]]:
    """``(ms, clock)``: the median milliseconds of ``decode()`` over ``iters`` timed calls after one
    warm-up, and the GPU's SM clock and power while they ran (``gpu_clock``; empty where NVML does
    not answer). A whole-tile decode holds the card at its power limit: on an H100 (2026-12-07) two
    large tiles back to back ran at 1437 MHz mean and 696 W, where one convolution timed alone runs
    near 1980 MHz."""
    clock = gpu_clock.ClockSampler(gpu_clock.nvml_reader("cuda"))
    timing = time_repeated(decode, repeats=iters, warmup=1, device="cuda", during=clock)
    return timing.median_s * 1e3, clock.summary("")


def cudnn_case(layer: str, in_channels: int, out_channels: int, size, iters: int, gen):
    """A random 3x3x3 convolution padded by 1 as the decoder runs it (bf16, channels-last input of
    ``size`` output frames with two causal frames in front, channels-last weight) and its cuDNN row:
    ``(x, weight, flops, float32 result, row)``."""
    from tilecast.kernels.narrow_conv import exact, reference

    frames, height, width = size
    x = torch.randn(1, frames + 2, height, width, in_channels, device="cuda", generator=gen).bfloat16()
    weight = torch.randn(out_channels, in_channels, 3, 3, 3, device="cuda", generator=gen) / (27 * in_channels) ** 0.5
    weight = weight.bfloat16().contiguous(memory_format=torch.channels_last_3d)
    flops = 2 * frames * height * width * out_channels * in_channels * 27
    expected = exact(x, weight, (1, 1))
    cudnn_ms = time_ms(lambda: reference(x, weight, (1, 1)), iters)
    row = layer_row(layer, "cudnn", cudnn_ms, cudnn_ms, flops, reference(x, weight, (1, 1)), expected)
    return x, weight, flops, expected, row


def _layer_rows(layer, in_channels, out_channels, tilings, size, iters, gen) -> list[dict]:
    from tilecast.kernels.narrow_conv import default_tiling, pack_weight, reference, reuse_tiling, triton_conv

    x, weight, flops, expected, cudnn_row = cudnn_case(layer, in_channels, out_channels, size, iters, gen)
    cudnn_ms, rows = cudnn_row["ms"], [cudnn_row]
    if out_channels * 4 >= 16:  # cuDNN on the coarse grid (12 output channels would be no better than 3)
        coarse_x, coarse_weight = space_to_depth(x), space_to_depth_weight(weight)
        coarse_weight = coarse_weight.contiguous(memory_format=torch.channels_last_3d)
        ms = time_ms(lambda: reference(coarse_x, coarse_weight, (1, 1)), iters)
        out = depth_to_space(reference(coarse_x, coarse_weight, (1, 1)))
        rows.append(layer_row(layer, "cudnn-s2d", ms, cudnn_ms, flops, out, expected))
        del coarse_x
    for tiling in [default_tiling(in_channels), reuse_tiling(in_channels), *tilings]:
        packed = pack_weight(weight, tiling.bk)

        def call(packed=packed, tiling=tiling):
            return triton_conv(x, packed, (1, 1), tiling)

        try:
            ms = time_ms(call, iters)
        except Exception as exc:  # noqa: BLE001 - a tiling that cannot compile (shared memory) is reported
            rows.append({"layer": layer, "kernel": f"triton:{tiling}", "error": str(exc)[:120]})
            continue
        rows.append(layer_row(layer, f"triton:{tiling}", ms, cudnn_ms, flops, call(), expected))
    return rows


def layer_row(layer: str, kernel: str, ms: float, cudnn_ms: float, flops: int | None, out, exact) -> dict:
    """A table row: time, TFLOP/s (when ``flops`` is known), speed against cuDNN, PSNR against ``exact``."""
    return {
        "layer": layer,
        "kernel": kernel,
        "ms": ms,
        "tflops": None if flops is None else flops / ms / 1e9,
        "x_cudnn": cudnn_ms / ms,
        "psnr_vs_fp32_db": psnr_db(out, exact),
    }


def space_to_depth(x_BTHWC: torch.Tensor) -> torch.Tensor:
    """``[B, T, H / 2, W / 2, 4 C]``: pixel ``(2 i + a, 2 j + b)``'s channels at ``(2 a + b) C`` of pixel ``(i, j)``."""
    batch, frames, height, width, channels = x_BTHWC.shape
    blocks = x_BTHWC.view(batch, frames, height // 2, 2, width // 2, 2, channels)
    return blocks.permute(0, 1, 2, 4, 3, 5, 6).reshape(batch, frames, height // 2, width // 2, 4 * channels)


def depth_to_space(x_BTHWC: torch.Tensor) -> torch.Tensor:
    """``space_to_depth`` undone."""
    batch, frames, height, width, channels = x_BTHWC.shape
    blocks = x_BTHWC.reshape(batch, frames, height, width, 2, 2, channels // 4)
    return blocks.permute(0, 1, 2, 4, 3, 5, 6).reshape(batch, frames, 2 * height, 2 * width, channels // 4)


def space_to_depth_weight(weight: torch.Tensor) -> torch.Tensor:
    """The coarse-grid kernel ``[4 C_out, 4 C_in, KT, 3, 3]`` of a 3x3 (padding 1) kernel: output phase
    ``a`` reads fine rows ``2 i + a - 1 .. 2 i + a + 1``; fine row ``2 (i + r - 1) + c`` (coarse tap ``r``,
    input phase ``c``) is fine tap ``2 (r - 1) + c - a + 1`` when that is 0..2 (columns alike)."""
    out_channels, in_channels, frames, kh, kw = weight.shape
    if (kh, kw) != (3, 3):
        raise ValueError(f"space_to_depth_weight: a 3x3 spatial kernel, got {kh}x{kw}")
    coarse = weight.new_zeros(2, 2, out_channels, 2, 2, in_channels, frames, 3, 3)
    for a, b, c, d, r, s in itertools.product(range(2), range(2), range(2), range(2), range(3), range(3)):
        fine_h, fine_w = 2 * (r - 1) + c - a + 1, 2 * (s - 1) + d - b + 1
        if 0 <= fine_h <= 2 and 0 <= fine_w <= 2:
            coarse[a, b, :, c, d, :, :, r, s] = weight[:, :, :, fine_h, fine_w]
    return coarse.reshape(4 * out_channels, 4 * in_channels, frames, 3, 3)
