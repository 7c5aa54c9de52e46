"""``tilecast bench k6sr``: tilecast against diffusers' own ``Kandinsky6SRPipeline`` in one run.

Both sides share the very same released-size networks (default diffusers configs, seeded
random weights, bf16 with diffusers' fp32 modules kept fp32), the same input frames and the same
noise. tilecast seeds each tile chunk's noise with ``seed + index of its first tile`` (the
reference's rule), while diffusers' pipeline draws every chunk from the one ``generator`` in
sequence; with several tiles the two would start from different noise (the large workload's 9 tiles
read 18 dB), so the peer runs under ``chunk_seeded_noise``: diffusers' own ``randn_tensor`` draw,
given a fresh generator seeded by that rule per chunk (the pipeline takes neither ``latents=`` nor
per-chunk generators, so the bench wraps its draw; nothing else of diffusers changes, and the draw
costs what diffusers' own does). The PSNR then says whether the outputs agree
(tests/test_k6sr_bench_parity.py checks the mechanism on the CPU with 4 tile chunks).

diffusers' attention is swapped for plain dense ``F.scaled_dot_product_attention`` (PyTorch picks
its kernel), so both compute the same dense attention; tilecast uses its own attention entry point, its channels-last VAE decode
(``vae_decode.py``) and, with ``--compile``, compiled DiT blocks.

``--attention-backend nabla`` runs tilecast's side on NABLA (diffusers' released block-sparse
attention with the config's ``nabla_threshold`` / ``nabla_window``; the peer stays dense SDPA, so the
ratio is NABLA against dense and the PSNR is NABLA's departure from dense). Each NABLA row carries
``nabla_density``, the kept fraction of attention blocks over the timed request: with random
weights the attention is near-uniform and NABLA keeps most blocks, more than a trained checkpoint
would (issue 24 records 84-93% on these workloads), so a NABLA time means little without its
density.

Stage times come from synchronized wrappers around the shared modules (VAE encode/decode,
latent upscaler, DiT), identical for both sides; "other" is the rest of the end-to-end time.
With NVML (the ``bench`` extra) each row also carries the GPU's mean SM clock and power over its
side's timed requests (``sm_mhz``, ``sm_mhz_min``, ``power_w``; ``gpu_clock``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from tilecast.launcher.bench import gpu_clock
from tilecast.launcher.bench.report import profile_call, psnr_db, ratio, synchronize, time_repeated

logger = logging.getLogger(__name__)

WORKLOADS = {
    # name: (width, height, frames), all upscaled x2
    "small": (384, 256, 33),
    "large": (768, 512, 121),
}
STAGES = ("encode", "latent_upscale", "dit", "decode")


def pattern_video(width: int, height: int, num_frames: int) -> np.ndarray:
    """Deterministic moving pattern, ``(F, H, W, 3)`` uint8."""
    from tilecast.runtime.synthetic import pattern_frames

    return pattern_frames(width, height, num_frames)


def build_released(device: torch.device, dtype: torch.dtype, seed: int = 0):
    """Released-size K6 SR networks with seeded random weights (diffusers' default configs)."""
    from diffusers import (
        Kandinsky6SRLatentUpscalerBank,
        Kandinsky6SRTransformer3DModel,
        Kandinsky6SRVAE,
        PiflowScheduler,
    )

    from tilecast.runtime.models.k6sr.loading import K6SRComponents

    def make(cls):
        torch.manual_seed(seed)
        with torch.device(device):
            model = cls().eval()
        model.to(dtype)
        for name, module in model.named_modules():
            if any(keep in name for keep in getattr(cls, "_keep_in_fp32_modules", None) or ()):
                module.float()
        return model.requires_grad_(False)

    return K6SRComponents(
        transformer=make(Kandinsky6SRTransformer3DModel),
        vae=make(Kandinsky6SRVAE),
        latent_upscaler=make(Kandinsky6SRLatentUpscalerBank),
        scheduler=PiflowScheduler(),
        device=device,
        dtype=dtype,
    )


class DenseSDPAProcessor:
    """diffusers' Kandinsky 6 SR attention with NABLA replaced by plain dense SDPA (the peer)."""

    def __call__(self, attn, hidden_states, rotary_emb, sparse_params):
        from diffusers.models.transformers.transformer_kandinsky6_sr import apply_rotary

        query = attn.to_query(hidden_states).unflatten(-1, (attn.num_heads, -1))
        key = attn.to_key(hidden_states).unflatten(-1, (attn.num_heads, -1))
        value = attn.to_value(hidden_states).unflatten(-1, (attn.num_heads, -1))
        query = attn.query_norm(query.float()).type_as(query)
        key = attn.key_norm(key.float()).type_as(key)
        query = apply_rotary(query, rotary_emb)
        key = apply_rotary(key, rotary_emb)
        out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
        return attn.out_layer(out.transpose(1, 2).flatten(2, 3))


def set_processors(transformer, make: Callable[[], Any]) -> None:
    """Give every visual block's self-attention a fresh processor from ``make``."""
    for block in transformer.visual_transformer_blocks:
        block.self_attention.set_processor(make())


class StageTimer:
    """Synchronized wall time per stage, accumulated by wrapping the shared modules' entry points."""

    def __init__(self, parts) -> None:
        self.times = {stage: 0.0 for stage in STAGES}
        self.decoded: list[tuple[int, ...]] = []
        """The latent shape of every decode call since the last ``reset``."""
        self._restore: list[tuple[Any, str, Any]] = []
        self.wrap(parts.vae, "encode", "encode")
        self.wrap(parts.vae, "decode", "decode")
        self.wrap(parts.latent_upscaler, "forward", "latent_upscale")
        self.wrap(parts.transformer, "forward", "dit")

    def wrap(self, module, method: str, stage: str) -> None:
        """Time ``module.method`` as ``stage``."""
        original = getattr(module, method)

        def timed(*args, **kwargs):
            if stage == "decode":
                self.decoded.append(tuple(args[0].shape))
            synchronize()
            started = time.perf_counter()
            result = original(*args, **kwargs)
            synchronize()
            self.times[stage] += time.perf_counter() - started
            return result

        setattr(module, method, timed)
        self._restore.append((module, method, original))

    def reset(self) -> None:
        self.times = {stage: 0.0 for stage in STAGES}
        self.decoded = []

    def close(self) -> None:
        for module, method, _ in self._restore:
            delattr(module, method)


@functools.cache
def _decode_flops_per_shape(config_json: str, latent_shape: tuple[int, ...]) -> int:
    import json

    from diffusers import Kandinsky6SRVAE
    from torch.utils.flop_counter import FlopCounterMode

    from tilecast.runtime.models.k6sr.vae_decode import ChannelsLastDecoder

    with torch.device("meta"):
        vae = Kandinsky6SRVAE.from_config(json.loads(config_json)).eval()
    decoder = ChannelsLastDecoder(vae)  # outside the count: it combines the upsamplers' weights once
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        decoder.decode(torch.empty(latent_shape, device="meta"))
    return counter.get_total_flops()


def decode_flops(vae, latent_shapes: list[tuple[int, ...]]) -> int:
    """Convolution and matmul FLOPs (2 per multiply-add) of tilecast's K-VAE decode of these latents,
    counted by PyTorch's ``FlopCounterMode`` on meta tensors (no memory, no GPU time)."""
    config_json = vae.to_json_string()
    return sum(_decode_flops_per_shape(config_json, shape) for shape in latent_shapes)


@dataclasses.dataclass
class Measurement:
    side: str
    workload: str
    e2e_s: float
    stages_s: dict[str, float]
    peak_reserved_gib: float
    peak_allocated_gib: float
    output: torch.Tensor
    nabla_density: float | None = None
    decoded: tuple[tuple[int, ...], ...] = ()
    """The latent shapes the row's request decoded."""
    clock: dict[str, float] = dataclasses.field(default_factory=dict)
    """The GPU's SM clock and power over the timed requests (``gpu_clock``; empty without NVML)."""


def _measure(
    side: str,
    workload: str,
    run: Callable[[], torch.Tensor],
    timer: StageTimer,
    repeats: int,
    transformer: Any = None,
) -> Measurement:
    """One warm-up request, then ``repeats`` timed ones; the row is the low-median request, its stage
    times and "other" (the rest of its end-to-end time). ``transformer``: tilecast's DiT, whose NABLA
    density over the row's request goes into the row (``None`` when it ran no NABLA call)."""
    from tilecast.runtime.models.k6sr.attention import nabla_density, reset_nabla_stats

    stage_runs: list[dict[str, float]] = []
    densities: list[float | None] = []
    decoded: list[tuple[tuple[int, ...], ...]] = []

    def request() -> torch.Tensor:
        timer.reset()
        if transformer is not None:
            reset_nabla_stats(transformer)
        output = run()
        stage_runs.append(dict(timer.times))
        decoded.append(tuple(timer.decoded))
        densities.append(nabla_density(transformer) if transformer is not None else None)
        return output

    clock = gpu_clock.ClockSampler(gpu_clock.nvml_reader("cuda"))
    timing = time_repeated(
        request,
        repeats=repeats,
        warmup=1,
        device="cuda",
        after_warmup=lambda: (
            stage_runs.clear(),
            densities.clear(),
            decoded.clear(),
            torch.cuda.reset_peak_memory_stats(),
        ),
        during=clock,
    )
    best = timing.median_low_index
    stages = dict(stage_runs[best])
    stages["other"] = timing.calls_s[best] - sum(stages.values())
    times = ", ".join(f"{name} {seconds:.2f}" for name, seconds in stages.items())
    print(f"k6sr {workload} {side}: {timing.calls_s[best]:.2f} s ({times})", file=sys.stderr, flush=True)  # as it goes
    return Measurement(
        side=side,
        workload=workload,
        e2e_s=timing.calls_s[best],
        stages_s=stages,
        peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
        peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
        output=timing.result.float().cpu(),
        nabla_density=densities[best],
        decoded=decoded[best],
        clock=clock.summary(""),
    )


@contextlib.contextmanager
def chunk_seeded_noise(seed: int) -> Iterator[list[int]]:
    """Inside, diffusers' ``Kandinsky6SRPipeline`` draws each tile chunk's noise like tilecast: its
    own ``randn_tensor`` call with a fresh CPU generator seeded ``seed + index of the chunk's first
    tile`` instead of the ``generator`` argument. For one call of a batch-1 pipeline (the chunks of
    one video, drawn in tile order). Yields the first tile index of every draw, in order."""
    from diffusers.pipelines.kandinsky6 import pipeline_kandinsky6_sr as module

    original = module.randn_tensor
    first_tiles: list[int] = []
    next_tile = 0

    def randn_tensor(shape, generator=None, device=None, dtype=None, layout=None):
        nonlocal next_tile
        if isinstance(generator, list) and len(generator) > 1:
            raise ValueError("chunk_seeded_noise: one video at a time (batch 1)")
        first_tiles.append(next_tile)
        chunk_generator = torch.Generator(device="cpu").manual_seed(seed + next_tile)
        next_tile += shape[0]  # the chunk's tiles
        return original(shape, generator=chunk_generator, device=device, dtype=dtype, layout=layout)

    module.randn_tensor = randn_tensor
    try:
        yield first_tiles
    finally:
        module.randn_tensor = original


def run_diffusers(parts, frames_FHWC: np.ndarray, seed: int, *, chunk_seeded: bool = True) -> torch.Tensor:
    """diffusers' pipeline on ``parts``, x2, 2 steps, one tile per chunk (as ``run_tilecast``).
    ``chunk_seeded``: noise as tilecast draws it (``chunk_seeded_noise``); False: diffusers' one
    generator seeded ``seed`` (agrees with tilecast only on a single tile)."""
    from diffusers import Kandinsky6SRPipeline
    from PIL import Image

    pipe = Kandinsky6SRPipeline(
        transformer=parts.transformer,
        vae=parts.vae,
        scheduler=parts.scheduler,
        latent_upscaler=parts.latent_upscaler,
    )
    pipe.set_progress_bar_config(disable=True)
    images = [Image.fromarray(frame) for frame in frames_FHWC]
    noise = chunk_seeded_noise(seed) if chunk_seeded else contextlib.nullcontext()
    with noise:
        out = pipe(
            video=images,
            resolution_scale=2,
            num_inference_steps=2,
            tiles_batch_size=1,
            generator=torch.Generator().manual_seed(seed),
            output_type="pt",
        ).frames
    return out[0]  # (F, C, H, W) in [0, 1]


def run_tilecast(parts, frames_FHWC: np.ndarray, seed: int) -> torch.Tensor:
    from tilecast.runtime.models.k6sr.stages import SRSettings, frames_to_video, upscale_video

    video = frames_to_video(torch.from_numpy(frames_FHWC), parts.device)
    settings = SRSettings(scale=2, num_inference_steps=2, seed=seed, tiles_batch_size=1)
    out_BCFHW, _ = upscale_video(parts, video, settings)
    return ((out_BCFHW[0].permute(1, 0, 2, 3).float() + 1) / 2).clamp(0, 1)  # (F, C, H, W) in [0, 1]


def bench_k6sr(
    workloads: list[str],
    *,
    peer: str | None = "diffusers",
    repeats: int = 1,
    seed: int = 42,
    compile_blocks: bool = False,
    attention_backend: str | None = None,
    vae_fp8_convs: bool = False,
    quantize: str | None = None,
    default_too: bool = False,
    profile_dir: Path | None = None,
) -> list[dict]:
    """Run each workload on both sides; returns one row per (workload, side).

    diffusers runs every workload first, then tilecast installs its fast paths (its attention on
    ``attention_backend``, ``None`` for the fastest dense kernel or ``"nabla"``; its channels-last VAE
    decode, which makes the decoder's weights channels-last in place, with ``vae_fp8_convs`` its wide
    convolutions in FP8; with ``quantize`` ``"fp8"`` FP8 linear layers in the DiT blocks; with ``compile_blocks`` the
    compiled DiT blocks) and runs them again. With ``profile_dir``, one more tilecast request per
    workload runs under the profiler after its timing (``k6sr_<workload>_<side>.txt``: kernels, and the
    K-VAE decoder's levels as named ranges). ``default_too`` (with an opt-in: ``attention_backend``,
    ``vae_fp8_convs``, ``quantize``) first runs tilecast with its defaults too, side
    ``tilecast-default``, and the opt-in rows add their PSNR against it."""
    from tilecast.runtime.config import check_quantize
    from tilecast.runtime.models.k6sr.attention import install_dense_attention
    from tilecast.runtime.models.k6sr.quantize import quantize_blocks
    from tilecast.runtime.models.k6sr.vae_decode import ChannelsLastDecoder

    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"--repeats must be a positive integer, got {repeats!r}")
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise ValueError(f"--workload {unknown[0]!r}: choose from {', '.join(WORKLOADS)}")
    opt_ins = attention_backend is not None or vae_fp8_convs or quantize is not None
    if default_too and not opt_ins:
        raise ValueError("--default-too compares tilecast's defaults with an opt-in: pass one (e.g. --quantize fp8)")
    check_quantize(quantize)
    if attention_backend is not None:
        from tilecast.kernels import capabilities

        capabilities.candidates(attention_backend)  # ValueError naming the valid ones
    if not torch.cuda.is_available():
        raise ValueError("tilecast bench k6sr needs a CUDA GPU (the released-size model is ~1.5B parameters)")
    device = torch.device("cuda")
    if vae_fp8_convs:
        from tilecast.kernels import fp8_conv

        fp8_conv.check_supported(device)
    if quantize is not None:
        from tilecast.kernels import fp8

        fp8.check_supported(device)
    parts = build_released(device, torch.bfloat16, seed=0)
    timer = StageTimer(parts)
    frames = {name: pattern_video(*WORKLOADS[name]) for name in workloads}
    measured: dict[tuple[str, str], Measurement] = {}
    try:
        if peer == "diffusers":
            set_processors(parts.transformer, DenseSDPAProcessor)
            for name in workloads:
                measured[name, "diffusers"] = _measure(
                    "diffusers", name, functools.partial(run_diffusers, parts, frames[name], seed), timer, repeats
                )
                torch.cuda.empty_cache()
        sides = {"tilecast-default": {}} if default_too else {}
        sides["tilecast"] = dict(backend=attention_backend, fp8_convs=vae_fp8_convs, quantize=quantize)
        for side, options in sides.items():  # the defaults first: quantizing is one-way
            install_dense_attention(parts.transformer, backend=options.get("backend"))
            if options.get("quantize") == "fp8":
                quantize_blocks(parts.transformer)
            parts.decoder = ChannelsLastDecoder(parts.vae, fp8_convs=options.get("fp8_convs", False))
            timer.wrap(parts.decoder, "decode", "decode")
            if compile_blocks:
                parts.transformer.compile_repeated_blocks()
            for name in workloads:
                measured[name, side] = _measure(
                    side,
                    name,
                    functools.partial(run_tilecast, parts, frames[name], seed),
                    timer,
                    repeats,
                    transformer=parts.transformer,
                )
                if profile_dir is not None:
                    request = functools.partial(run_tilecast, parts, frames[name], seed)
                    profile_call(request, Path(profile_dir) / f"k6sr_{name}_{side}.txt", device=device)
                torch.cuda.empty_cache()
    finally:
        timer.close()
    rows = []
    for name in workloads:
        reference = measured.get((name, "diffusers"))
        default = measured.get((name, "tilecast-default"))
        for side in ("diffusers", "tilecast-default", "tilecast"):
            m = measured.get((name, side))
            if m is None:
                continue
            opt_in = side == "tilecast"
            row = {
                "workload": name,
                "side": side,
                "e2e_s": m.e2e_s,
                **{f"{k}_s": v for k, v in m.stages_s.items()},
                "peak_reserved_gib": m.peak_reserved_gib,
                "peak_allocated_gib": m.peak_allocated_gib,
                "attention": "sdpa" if side == "diffusers" else (attention_backend if opt_in else None) or "auto",
                "vae_convs": "fp8" if opt_in and vae_fp8_convs else "bf16",
                "dit_linears": (quantize if opt_in else None) or "bf16",
            }
            row.update(m.clock)
            if m.nabla_density is not None:
                row["nabla_density"] = m.nabla_density
            if side != "diffusers" and m.decoded and m.stages_s.get("decode"):
                flops = decode_flops(parts.vae, list(m.decoded))
                row["decode_tflop"] = flops / 1e12
                row["decode_tflops"] = flops / m.stages_s["decode"] / 1e12
            if side != "diffusers" and reference is not None:
                row["ratio_vs_diffusers"] = ratio(m.e2e_s, reference.e2e_s)
                row["psnr_vs_diffusers_db"] = (
                    psnr_db(m.output, reference.output, peak=1.0) if m.output.shape == reference.output.shape else None
                )
            if opt_in and default is not None:
                row["psnr_vs_default_db"] = psnr_db(m.output, default.output, peak=1.0)
            rows.append(row)
    return rows
