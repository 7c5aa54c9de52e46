"""The compute stages of Kandinsky 6 video super-resolution, one function each.

``upscale_video`` chains them: input frames → encode (K-VAE) → latent upscale (per tile) → tile
plan → denoise (DiT + PiFlow, ``tiles_batch_size`` tiles per call; PiFlow's step runs as one
kernel, ``kernels/piflow.py``, and each chunk's CPU noise is drawn ahead on a thread,
``NoiseAhead``) → decode (serially, one tile chunk at a time) → Hann blend. It returns the float
video before any quantisation or MP4 encoding, so tests compare it with diffusers' ``Kandinsky6SRPipeline``.
``RunHooks`` (the serving ``RankContext``) carries the stuck watchdog's heartbeat into the long
stages and puts cancel points where every rank of the request meets.

Numerics follow diffusers' pipeline step by step (pixel normalisation, the K-VAE's ``/128``
convention, variance-preserving noise with ``lq_noise_scale = 0.7``, the zero anchor channels),
with one deliberate difference: **noise seeding**. diffusers draws every chunk's noise from one
generator in sequence; tilecast seeds a fresh CPU generator with ``seed + index of the chunk's
first tile`` per chunk, so a tile's noise does not depend on the tiles before it (and whole-tile
parallel denoising can reproduce it). With one tile and ``tiles_batch_size=1`` both agree.

Shapes: ``video_BCFHW`` (batch, RGB, frames, height, width) in ``[-1, 1]``; ``latents_BCTHW``
(batch, latent channels, latent frames, height, width); ``tiles_NCTHW`` (tiles, ...);
``x_BTHWC`` (the transformer's channels-last layout); ``frames_FHWC`` uint8.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch
import torch.nn.functional as F

from tilecast.kernels import piflow
from tilecast.runtime.models.k6sr.loading import K6SRComponents
from tilecast.runtime.models.k6sr.tiling import (
    TileBlender,
    TilePlan,
    plan_tiles,
    pre_upscaled_size,
    snapped_size,
    split_scale,
)
from tilecast.runtime.placement import on_device

logger = logging.getLogger(__name__)

LQ_NOISE_SCALE = 0.7
"""Share of Gaussian noise mixed (variance preserving) into the low-resolution latents."""

StepCallback = Callable[[int, int], None]


class RunHooks:
    """What a running request tells the server besides its progress. ``RankContext`` has the same
    methods; this default does nothing (benchmarks, tests).

    - ``alive()``: a long stage is still moving (feeds the stuck watchdog; per decoded level or tile);
    - ``alive_during(module)``: ``alive`` on every forward of ``module`` while inside;
    - ``cancel_point()``: a boundary every rank of the request reaches together (a collective
      with several ranks); raises ``PlanCancelled`` when every job of the batch was cancelled.
    """

    def alive(self) -> None:
        pass

    def alive_during(self, module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def cancel_point(self) -> None:
        pass


NO_HOOKS = RunHooks()


class StepCounter:
    """Counts DiT steps and reports ``(done, total)`` to ``on_progress`` after each one, then calls
    ``after_step`` (a cancel point, where every rank takes the same steps)."""

    def __init__(
        self, total: int, on_progress: StepCallback | None, after_step: Callable[[], None] | None = None
    ) -> None:
        self.total, self.on_progress, self.after_step, self.done = total, on_progress, after_step, 0

    def __call__(self) -> None:
        self.done += 1
        if self.on_progress is not None:
            self.on_progress(self.done, self.total)
        if self.after_step is not None:
            self.after_step()


@dataclasses.dataclass(kw_only=True)
class SRSettings:
    """Per-request numerics of ``upscale_video`` (a subset of ``SRParams``)."""

    scale: float = 2.25
    """Total spatial upscale: 2, 4 or 2.25."""
    num_inference_steps: int = 2
    """DiT evaluations per tile."""
    seed: int = 42
    """Chunk ``i`` (first tile index ``t``) draws its noise from ``Generator().manual_seed(seed + t)``."""
    tiles_batch_size: int = 1
    """Tiles per DiT call (changes the noise, hence the output)."""
    min_overlap: float = 0.2
    """Minimum overlap between neighbouring tiles, as a fraction of the tile."""


def frames_to_video(frames_FHWC: torch.Tensor, device) -> torch.Tensor:
    """uint8 frames to a ``[-1, 1]`` float32 ``video_BCFHW`` (batch 1), like diffusers' video processor.
    The frames cross to ``device`` as uint8 (a quarter of the bytes) and are converted there."""
    video_FCHW = frames_FHWC.to(device).permute(0, 3, 1, 2).float() / 255.0
    return (2.0 * video_FCHW - 1.0).permute(1, 0, 2, 3)[None]


def video_to_frames(video_BCFHW: torch.Tensor) -> torch.Tensor:
    """``[-1, 1]`` float ``video_BCFHW`` (batch 1) to uint8 ``frames_FHWC`` on the CPU (laid out on
    the video's device, so the host receives contiguous frames and does no strided copy)."""
    video_FCHW = (video_BCFHW[0].permute(1, 0, 2, 3).float() / 2 + 0.5).clamp(0, 1)
    return (video_FCHW * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous().cpu()


def _resize_frames(video_BCFHW: torch.Tensor, size: tuple[int, int], **interp) -> torch.Tensor:
    batch, _, num_frames = video_BCFHW.shape[:3]
    frames = video_BCFHW.permute(0, 2, 1, 3, 4).flatten(0, 1)
    frames = F.interpolate(frames, size=size, **interp)
    return frames.unflatten(0, (batch, num_frames)).permute(0, 2, 1, 3, 4)


def snap_input(video_BCFHW: torch.Tensor, snap: int) -> torch.Tensor:
    """Resize (nearest) to the size rounded down to a multiple of the VAE factor, as diffusers'
    video processor does; a no-op for aligned sizes."""
    height, width = video_BCFHW.shape[-2:]
    target = snapped_size(height, width, snap)
    if target == (height, width):
        return video_BCFHW
    return _resize_frames(video_BCFHW, target, mode="nearest")


def pre_upscale(video_BCFHW: torch.Tensor, pre: float, snap: int) -> torch.Tensor:
    """The 2.25x route's bilinear 1.125x pixel pre-upscale, snapped to the VAE factor."""
    if pre == 1.0:
        return video_BCFHW
    target = pre_upscaled_size(*video_BCFHW.shape[-2:], pre, snap)
    return _resize_frames(video_BCFHW, target, mode="bilinear", align_corners=False)


def encode_video(parts: K6SRComponents, video_BCFHW: torch.Tensor) -> torch.Tensor:
    """K-VAE latents (posterior mode, times ``scaling_factor``) of a ``[-1, 1]`` video."""
    vae = parts.vae
    # The K-VAE was trained on pixels / 128 - 1, not pixels / 127.5 - 1.
    video = (video_BCFHW.to(vae.dtype) + 1) * (127.5 / 128) - 1
    with on_device(vae):
        latents_BCTHW = vae.encode(video, return_dict=False)[0].mode()
    return latents_BCTHW * vae.config.scaling_factor


def decode_latents(
    parts: K6SRComponents, latents_BCTHW: torch.Tensor, alive: Callable[[], None] | None = None
) -> torch.Tensor:
    """Decode scaled latents to a float32 ``[-1, 1]`` video. ``alive`` is called per block of
    tilecast's decoder (diffusers' decode beats through ``RunHooks.alive_during`` on the VAE)."""
    vae = parts.vae
    latents_BCTHW = latents_BCTHW.to(vae.dtype) / vae.config.scaling_factor
    with on_device(vae):
        if parts.decoder is not None:
            video = parts.decoder.decode(latents_BCTHW, alive=alive)
        else:
            video = vae.decode(latents_BCTHW, return_dict=False)[0]
    return ((video.float() + 1) * (128 / 127.5) - 1).clamp(-1, 1)


def make_plan(parts: K6SRComponents, height: int, width: int, settings: SRSettings) -> TilePlan:
    """The tile plan for a source of ``height`` x ``width`` pixels (before snapping/pre-upscale)."""
    tiling_scale, pre = split_scale(settings.scale)
    snap = parts.spatial_factor
    snapped = snapped_size(height, width, snap)
    lr_height, lr_width = pre_upscaled_size(*snapped, pre, snap)
    return plan_tiles(
        lr_height,
        lr_width,
        tiling_scale=tiling_scale,
        tile_sizes=parts.tile_sizes,
        min_overlap=settings.min_overlap,
        snap=snap,
        scale_label=settings.scale,
    )


def low_res_tiles(
    parts: K6SRComponents,
    video_BCFHW: torch.Tensor,
    plan: TilePlan,
    timings: dict[str, float] | None = None,
    hooks: RunHooks = NO_HOOKS,
) -> torch.Tensor:
    """Low-resolution latent tiles at the trained tile size: ``tiles_NCTHW`` (batch 1) in ``parts.dtype``.

    With a latent upscaler for the tiling scale, tiles are cut from the latents of the whole video
    and upscaled in latent space; otherwise pixel tiles are bilinearly upscaled and encoded.
    """
    snap = parts.spatial_factor
    tile_h, tile_w = plan.tile_size
    upscaler = parts.latent_upscaler
    timings = timings if timings is not None else {}
    tiles = []
    started = time.perf_counter()
    if upscaler is not None and plan.tiling_scale in upscaler.config.scales:
        latents_BCTHW = encode_video(parts, video_BCFHW)
        timings["encode"] = time.perf_counter() - started
        started = time.perf_counter()
        with on_device(upscaler):  # component offload: the stage moves it once, not per tile
            for top, left in plan.grid:
                crop = latents_BCTHW[
                    :, :, :, top // snap : (top + tile_h) // snap, left // snap : (left + tile_w) // snap
                ]
                tiles.append(upscaler(crop, scale=plan.tiling_scale, return_dict=False)[0])
                hooks.alive()
    else:
        with on_device(parts.vae):
            for top, left in plan.grid:
                crop = video_BCFHW[:, :, :, top : top + tile_h, left : left + tile_w]
                crop = _resize_frames(crop, plan.base_size, mode="bilinear", align_corners=False)
                tiles.append(encode_video(parts, crop))
                hooks.alive()
        timings["encode"] = 0.0
    timings["latent_upscale"] = time.perf_counter() - started
    return torch.stack(tiles, dim=1)[0].to(parts.dtype)


def chunk_starts(num_tiles: int, tiles_batch_size: int) -> list[range]:
    """Tile index ranges of the DiT calls, in order."""
    if tiles_batch_size < 1:
        raise ValueError(f"sr_tiles_batch_size must be at least 1, got {tiles_batch_size}")
    return [range(start, min(start + tiles_batch_size, num_tiles)) for start in range(0, num_tiles, tiles_batch_size)]


def draw_chunk_noise(shape, seed: int, first_tile: int, dtype: torch.dtype, *, pin: bool = False) -> torch.Tensor:
    """Noise of one chunk on the CPU: a generator seeded ``seed + first_tile``, drawn like diffusers'
    ``randn_tensor`` (``torch.randn`` is ``normal_`` into a new tensor; here, pinned if ``pin``)."""
    generator = torch.Generator(device="cpu").manual_seed(seed + first_tile)
    return torch.empty(shape, dtype=dtype, pin_memory=pin).normal_(generator=generator)


def chunk_noise(shape, seed: int, first_tile: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``draw_chunk_noise`` on ``device``."""
    return draw_chunk_noise(shape, seed, first_tile, dtype).to(device)


class NoiseAhead:
    """The noise of a rank's chunks, each drawn on a worker thread while the chunk before it is
    denoised, so the GPU does not wait for the CPU's draw. The values are ``chunk_noise``'s; on CUDA they are drawn into pinned memory and copied
    without a device sync. ``take`` must be called in ``order``."""

    def __init__(
        self,
        tiles_NCTHW: torch.Tensor,
        ranges: list[range],
        order: list[int],
        settings: SRSettings,
        device: torch.device,
    ) -> None:
        self._pin = torch.device(device).type == "cuda"
        self._device, self._dtype, self._seed = device, tiles_NCTHW.dtype, settings.seed
        self._tile_shape = tuple(tiles_NCTHW.shape[i] for i in (2, 3, 4, 1))  # the DiT's T, H, W, C
        self._ranges, self._order = ranges, list(order)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tilecast-noise")
        self._pending = self._submit(0)

    def _submit(self, position: int) -> Future | None:
        if position >= len(self._order):
            return None
        indices = self._ranges[self._order[position]]
        shape = (len(indices), *self._tile_shape)
        return self._pool.submit(draw_chunk_noise, shape, self._seed, indices.start, self._dtype, pin=self._pin)

    def take(self, chunk: int) -> torch.Tensor:
        """The noise of ``chunk`` (the next one in ``order``) on the device; starts drawing the one after."""
        if not self._order or self._order[0] != chunk:
            raise RuntimeError(f"NoiseAhead: chunk {chunk} taken out of order (next: {self._order[:1]})")
        self._order.pop(0)
        noise = self._pending.result()
        self._pending = self._submit(0)
        return noise.to(self._device, non_blocking=self._pin)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "NoiseAhead":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def piflow_schedule(scheduler, num_inference_steps: int) -> list[piflow.PiflowStep] | None:
    """Each step's PiFlow schedule as ``kernels.piflow.PiflowStep``, or ``None`` when ``scheduler`` is
    not diffusers' ``PiflowScheduler`` (then ``scheduler.step`` runs). A CPU copy of the scheduler
    computes the schedule (float32, like the device copy), so reading it never waits for the GPU."""
    from diffusers import PiflowScheduler

    if type(scheduler) is not PiflowScheduler:
        return None
    twin = PiflowScheduler.from_config(scheduler.config)
    twin.set_timesteps(num_inference_steps, device="cpu")
    raw = [float(value) for value in twin._piflow_raw_timesteps]
    raw.append(float(torch.tensor(twin.eps, dtype=torch.float32)))  # diffusers' end point of the last step
    return [
        piflow.PiflowStep(
            sigma_src=float(twin.sigmas[index]),
            raw_src=raw[index],
            raw_dst=raw[index + 1],
            shift=float(twin.config.shift),
            eps=twin.eps,
            n_grid=twin.n_grid,
            num_policy_substeps=twin.num_policy_substeps,
        )
        for index in range(num_inference_steps)
    ]


def denoise_chunk(
    parts: K6SRComponents,
    lq_BTHWC: torch.Tensor,
    *,
    seed: int,
    first_tile: int,
    num_inference_steps: int,
    on_step: Callable[[], None] | None = None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Denoise one chunk of tiles (channels-last); returns the final ``latents_BTHWC``. ``noise``:
    the chunk's ``chunk_noise`` when drawn ahead (``NoiseAhead``). A ``PiflowScheduler`` steps
    through ``kernels.piflow.rollout`` (its step, bit for bit, in one kernel on CUDA)."""
    dtype, device = parts.dtype, parts.device
    scheduler = type(parts.scheduler).from_config(parts.scheduler.config)
    if noise is None:
        noise = chunk_noise(lq_BTHWC.shape, seed, first_tile, dtype, device)
    latents = math.sqrt(1 - LQ_NOISE_SCALE**2) * lq_BTHWC + LQ_NOISE_SCALE * noise
    scheduler.set_timesteps(num_inference_steps, device=device)
    policy = piflow_schedule(scheduler, num_inference_steps)
    with on_device(parts.transformer):
        for index, t in enumerate(scheduler.timesteps):
            # Input is [latent | anchor latent | anchor mask]; the released checkpoints are anchor-free (zeros).
            anchor = torch.zeros_like(latents)
            anchor_mask = torch.zeros((*latents.shape[:-1], 1), dtype=dtype, device=device)
            model_input = torch.cat([latents, anchor, anchor_mask], dim=-1)
            prediction = parts.transformer(
                hidden_states=model_input, timestep=t.expand(latents.shape[0]), return_dict=False
            )[0]
            if policy is not None:
                latents = piflow.rollout(latents, prediction, policy[index])
            else:
                latents = scheduler.step(prediction, t, latents, return_dict=False)[0]
            if on_step is not None:
                on_step()
    return latents


def denoise_tile_range(
    parts: K6SRComponents,
    tiles_NCTHW: torch.Tensor,
    indices: range,
    settings: SRSettings,
    on_step: Callable[[], None] | None = None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Denoise the tiles ``indices`` of ``tiles_NCTHW`` in one chunk: their ``latents_BCTHW``."""
    latents_BTHWC = denoise_chunk(
        parts,
        tiles_NCTHW[indices.start : indices.stop].permute(0, 2, 3, 4, 1),
        seed=settings.seed,
        first_tile=indices.start,
        num_inference_steps=settings.num_inference_steps,
        on_step=on_step,
        noise=noise,
    )
    return latents_BTHWC.permute(0, 4, 1, 2, 3)


def denoise_tiles(
    parts: K6SRComponents,
    tiles_NCTHW: torch.Tensor,
    settings: SRSettings,
    on_progress: StepCallback | None = None,
    hooks: RunHooks = NO_HOOKS,
) -> list[tuple[range, torch.Tensor]]:
    """Denoise all tiles, ``settings.tiles_batch_size`` per DiT call; ``[(tile indices, latents_BCTHW)]``.
    Every rank that calls this denoises every chunk, so each step is a cancel point."""
    chunks = chunk_starts(tiles_NCTHW.shape[0], settings.tiles_batch_size)
    step = StepCounter(len(chunks) * settings.num_inference_steps, on_progress, hooks.cancel_point)
    order = list(range(len(chunks)))
    # component offload: the transformer moves once for all chunks
    with on_device(parts.transformer), NoiseAhead(tiles_NCTHW, chunks, order, settings, parts.device) as noises:
        return [
            (indices, denoise_tile_range(parts, tiles_NCTHW, indices, settings, step, noise=noises.take(chunk)))
            for chunk, indices in enumerate(chunks)
        ]


def decode_and_blend(
    parts: K6SRComponents,
    chunks: list[tuple[range, torch.Tensor]],
    plan: TilePlan,
    num_frames: int,
    hooks: RunHooks = NO_HOOKS,
) -> torch.Tensor:
    """Decode the denoised chunks one at a time and Hann-blend them: ``video_BCFHW`` in ``[-1, 1]``.
    A cancel point after each chunk."""
    blender = TileBlender(plan, batch_size=1, num_frames=num_frames, device=parts.device)
    with on_device(parts.vae):  # component offload: moved once for all chunks
        for indices, latents_BCTHW in chunks:
            decoded_BCFHW = decode_latents(parts, latents_BCTHW, alive=hooks.alive)
            for tile_CFHW, tile_index in zip(decoded_BCFHW, indices):
                blender.add(tile_index, tile_CFHW)
            hooks.cancel_point()
    return blender.result()


@torch.no_grad()
def upscale_video(
    parts: K6SRComponents,
    video_BCFHW: torch.Tensor,
    settings: SRSettings,
    *,
    on_progress: StepCallback | None = None,
    timings: dict[str, float] | None = None,
    tile_work=None,
    hooks: RunHooks = NO_HOOKS,
) -> tuple[torch.Tensor, TilePlan]:
    """Super-resolve a ``[-1, 1]`` float ``video_BCFHW`` (batch 1, ``1 + 4k`` frames).

    Returns the blended float video in ``[-1, 1]`` (before quantisation) and the tile plan.
    ``on_progress(done, total)`` is called after every DiT step; ``timings`` receives seconds per
    stage (``pre_upscale``, ``encode``, ``latent_upscale``, ``denoise``, ``decode`` incl. blend;
    without a latent upscaler the per-tile encodes count as ``latent_upscale``). ``tile_work`` (a
    ``tile_parallel.TileWork``) spreads denoise/decode over ranks; ``None``: serial on this rank.
    ``hooks`` (a ``RankContext`` when serving): the VAE's and upscaler's module calls and every tile
    beat the watchdog; cancel points after the encode, after each DiT step every rank takes, after
    each decoded chunk or gathered round.
    """
    if video_BCFHW.shape[0] != 1:
        raise ValueError(f"upscale_video takes one video at a time, got a batch of {video_BCFHW.shape[0]}")
    num_frames = video_BCFHW.shape[2]
    if (num_frames - 1) % parts.temporal_factor:
        raise ValueError(f"the video must have 1 + {parts.temporal_factor}k frames, got {num_frames}")
    timings = timings if timings is not None else {}
    tiling_scale, pre = split_scale(settings.scale)
    snap = parts.spatial_factor

    started = time.perf_counter()
    video_BCFHW = video_BCFHW.to(parts.device, torch.float32)
    video_BCFHW = pre_upscale(snap_input(video_BCFHW, snap), pre, snap)
    timings["pre_upscale"] = time.perf_counter() - started
    plan = plan_tiles(
        *video_BCFHW.shape[-2:],
        tiling_scale=tiling_scale,
        tile_sizes=parts.tile_sizes,
        min_overlap=settings.min_overlap,
        snap=snap,
        scale_label=settings.scale,
    )
    with hooks.alive_during(parts.vae), hooks.alive_during(parts.latent_upscaler):
        tiles_NCTHW = low_res_tiles(parts, video_BCFHW, plan, timings, hooks)
        hooks.cancel_point()

        if tile_work is not None and tile_work.is_parallel:
            # Whole-tile / spatial-shard decode, tile-parallel denoise (runtime/models/k6sr/tile_parallel.py).
            video_BCFHW = tile_work.run(
                parts,
                tiles_NCTHW,
                settings,
                plan,
                num_frames,
                on_progress=on_progress,
                timings=timings,
                hooks=hooks,
            )
        else:
            started = time.perf_counter()
            chunks = denoise_tiles(parts, tiles_NCTHW, settings, on_progress, hooks)
            timings["denoise"] = time.perf_counter() - started

            started = time.perf_counter()
            video_BCFHW = decode_and_blend(parts, chunks, plan, num_frames, hooks)
            timings["decode"] = time.perf_counter() - started
    logger.debug("upscaled %d frames in %d tiles: %s", num_frames, plan.num_tiles, timings)
    return video_BCFHW, plan
