"""Tile plan and Hann-window blend of the SR pipeline.

The (pre-upscaled) low-resolution video is covered by overlapping tiles of ``base / scale``
pixels, where ``base`` is the trained tile size (``transformer.config.tile_sizes``) whose aspect
ratio is closest to the video's. Every tile is refined at ``base`` pixels and blended back into
the output canvas with a 2-D Hann window whose borders stay positive (so a pixel covered by one
tile keeps a non-zero weight). Tile positions are spread evenly, aligned to the VAE spatial
factor, with at least ``min_overlap`` of a tile shared between neighbours: the same positions as
diffusers' ``Kandinsky6SRPipeline``.

Shapes: ``video_BCFHW`` (batch, RGB, frames, height, width); ``window_HW``; ``weight_HW``.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch

logger = logging.getLogger(__name__)

SUPPORTED_SCALES = (2, 2.25, 4)
"""Total spatial upscale factors the pipeline serves."""
PRE_UPSCALE_2_25 = 1.125
"""The 2.25x route bilinearly pre-upscales the pixels by this factor, then takes the 2x path."""


def split_scale(scale: float) -> tuple[int, float]:
    """Return ``(tiling_scale, pre_upscale)`` for a supported total scale."""
    if scale not in SUPPORTED_SCALES:
        raise ValueError(f"sr_resolution_scale must be one of 2, 2.25 or 4, got {scale}")
    if scale == 2.25:
        return 2, PRE_UPSCALE_2_25
    return int(scale), 1.0


def snapped_size(height: int, width: int, snap: int) -> tuple[int, int]:
    """Source size rounded down to a multiple of the VAE spatial factor (what diffusers' video
    processor resizes to)."""
    return (height // snap) * snap, (width // snap) * snap


def pre_upscaled_size(height: int, width: int, pre_upscale: float, snap: int) -> tuple[int, int]:
    """Size after the bilinear pre-upscale, snapped to the VAE factor (identity when ``pre_upscale == 1``)."""
    if pre_upscale == 1.0:
        return height, width
    return round(height * pre_upscale / snap) * snap, round(width * pre_upscale / snap) * snap


def tile_starts(length: int, tile: int, min_overlap: float, snap: int) -> list[int]:
    """Start offsets of tiles of ``tile`` pixels covering ``length`` pixels.

    Offsets are multiples of ``snap``, the first is 0 and the last is ``length - tile`` rounded
    down to ``snap``; the stride between neighbours is at most ``tile * (1 - min_overlap)``
    (rounded down to ``snap``, at least ``snap``), and the tiles are spread as evenly as the
    snapping allows.
    """
    if tile >= length:
        return [0]
    num_steps = (length - tile) // snap  # the span to cover, in snap units
    longest_stride = max(1, math.floor(tile * (1.0 - min_overlap) / snap))
    num_tiles = 1 + math.ceil(num_steps / longest_stride)
    return [snap * round(i * num_steps / (num_tiles - 1)) for i in range(num_tiles)]


@dataclasses.dataclass(kw_only=True, frozen=True)
class TilePlan:
    """Where the tiles go, in low-resolution pixels, and how big they are at each end."""

    height: int
    """Low-resolution (pre-upscaled) video height the tiles cover."""
    width: int
    """Low-resolution (pre-upscaled) video width."""
    tiling_scale: int
    """Upscale of the tiled stage (2 or 4)."""
    base_size: tuple[int, int]
    """Trained tile ``(height, width)`` in output pixels."""
    tile_size: tuple[int, int]
    """Tile ``(height, width)`` in low-resolution pixels (``base_size / tiling_scale``)."""
    tops: tuple[int, ...]
    """Tile start rows (low resolution)."""
    lefts: tuple[int, ...]
    """Tile start columns (low resolution)."""

    @property
    def grid(self) -> list[tuple[int, int]]:
        """``(top, left)`` of every tile, row-major: the tile order (and seed order)."""
        return [(top, left) for top in self.tops for left in self.lefts]

    @property
    def num_tiles(self) -> int:
        return len(self.tops) * len(self.lefts)

    @property
    def output_size(self) -> tuple[int, int]:
        return self.height * self.tiling_scale, self.width * self.tiling_scale


def closest_tile_size(tile_sizes, height: int, width: int) -> tuple[int, int]:
    """The trained ``(height, width)`` whose aspect ratio is closest to the video's (first wins ties)."""
    return tuple(min(tile_sizes, key=lambda hw: abs(hw[1] / hw[0] - width / height)))


def plan_tiles(
    height: int,
    width: int,
    *,
    tiling_scale: int,
    tile_sizes,
    min_overlap: float,
    snap: int,
    scale_label: float | None = None,
) -> TilePlan:
    """Plan the tiles of a ``height`` x ``width`` (already pre-upscaled, snapped) video.

    Raises ``ValueError`` when the video is smaller than one tile or the trained tile size does
    not align with the latent grid at this scale.
    """
    if not 0.0 <= min_overlap < 1.0:
        raise ValueError(f"sr_tile_min_overlap must be in [0, 1), got {min_overlap}")
    base_h, base_w = closest_tile_size(tile_sizes, height, width)
    if base_h % (snap * tiling_scale) or base_w % (snap * tiling_scale):
        raise ValueError(
            f"trained tile size {base_h}x{base_w} is not divisible by the VAE factor times the upscale "
            f"({snap * tiling_scale}); tiles would not align with the latent grid"
        )
    tile_h, tile_w = base_h // tiling_scale, base_w // tiling_scale
    if height < tile_h or width < tile_w:
        label = scale_label if scale_label is not None else tiling_scale
        raise ValueError(
            f"the video is smaller than one tile: it must be at least {tile_w}x{tile_h} pixels (width x height, after snapping to the "
            f"VAE factor {snap}) for sr_resolution_scale={label:g}, got {width}x{height}"
        )
    return TilePlan(
        height=height,
        width=width,
        tiling_scale=tiling_scale,
        base_size=(base_h, base_w),
        tile_size=(tile_h, tile_w),
        tops=tuple(tile_starts(height, tile_h, min_overlap, snap)),
        lefts=tuple(tile_starts(width, tile_w, min_overlap, snap)),
    )


def hann_window_2d(height: int, width: int, device=None) -> torch.Tensor:
    """``window_HW``: outer product of periodic Hann windows of ``n + 2`` points with the two
    zero-valued ends dropped, so every border weight is positive."""
    window_y = torch.hann_window(height + 2, device=device)[1:-1]
    window_x = torch.hann_window(width + 2, device=device)[1:-1]
    return window_y[:, None] * window_x[None, :]


class TileBlender:
    """Accumulates windowed output tiles into a float32 canvas; ``result`` divides by the weights."""

    def __init__(self, plan: TilePlan, *, batch_size: int, num_frames: int, device) -> None:
        self.plan = plan
        out_h, out_w = plan.output_size
        self.window_HW = hann_window_2d(*plan.base_size, device=device)
        self.video_BCFHW = torch.zeros((batch_size, 3, num_frames, out_h, out_w), device=device)
        self.weight_HW = torch.zeros((out_h, out_w), device=device)
        base_h, base_w = plan.base_size
        for top, left in plan.grid:
            top, left = top * plan.tiling_scale, left * plan.tiling_scale
            self.weight_HW[top : top + base_h, left : left + base_w] += self.window_HW

    def add(self, tile_index: int, tile_CFHW: torch.Tensor, sample_index: int = 0) -> None:
        """Add one decoded tile (``[-1, 1]`` float, ``base_size`` pixels) at its place."""
        top, left = self.plan.grid[tile_index]
        top, left = top * self.plan.tiling_scale, left * self.plan.tiling_scale
        base_h, base_w = self.plan.base_size
        self.video_BCFHW[sample_index, :, :, top : top + base_h, left : left + base_w] += tile_CFHW * self.window_HW

    def result(self) -> torch.Tensor:
        """The blended ``video_BCFHW`` in ``[-1, 1]``."""
        return (self.video_BCFHW / self.weight_HW).clamp(-1, 1)
