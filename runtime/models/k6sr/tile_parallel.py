"""How one request's tiles are spread over the ranks: decode mode, tile-parallel denoise, pipelining.

Legend: ``tiles_NCTHW`` low-resolution latent tiles; ``lq_BTHWC`` one chunk, channels last (the
DiT layout); ``latents_BCTHW`` a denoised chunk; ``video_BCFHW`` float pixels in ``[-1, 1]``.

:class:`TileWork` is built once per pipeline from ``RankContext`` and runs the denoise → decode →
blend part of ``stages.upscale_video``. Its ``group`` is every rank that runs the request: today
every rank runs every request (rank 0 broadcasts one plan to all), so it is the device group, which
spans all DP replicas of the mesh. Modes:

- **serial** (default, one rank, or nothing enabled): every rank denoises and decodes every chunk.
- **whole-tile decode** (``vae.use_parallel_tiling``): replicated denoise, then
  ``decode_parallel.decode_whole_tiles`` over ``group`` (bit-identical to serial).
- **spatial-shard decode** (``vae.use_parallel_decode`` with ``parallel_decode_mode =
  "spatial_shard"``; wins when both decode flags are on): replicated denoise, then each chunk is
  decoded by the whole group split by latent rows (``spatial_shard``; not bit-exact), in order.
- **tile-parallel** (``tile_parallel``): the ranks form *units* of ``unit_size`` consecutive ranks,
  one DP replica each (``unit_size`` = TP x Ulysses x Ring, the ranks that shard one DiT call; 1
  with an unsharded DiT, then every rank is a unit). Chunk ``c`` is denoised *and* decoded by unit
  ``c % num_units`` alone; the DiT's own collectives stay inside the unit's mesh groups, and no
  unit talks to another while denoising. Each chunk's noise is seeded by ``seed + first tile
  index``, so the result equals running the chunks one after another. A unit decodes its chunk
  whole on each of its ranks, or, with spatial-shard decode, split by rows across the unit
  (``unit_group``: the replica's decode group). The decoded chunks meet in
  ``decode_parallel.blend_rounds`` (serial blend order), so the output on every rank is
  bit-identical to serial (whole decode) for the same DiT topology. With a single unit (the DiT
  spans all ranks) it is refused (``ValueError``), and so is spatial-shard decode with units of one rank.

**Pipelining** (tile-parallel): each unit loops denoise → decode over its own chunks, and the
all_gather of round ``r`` runs asynchronously (gloo's worker thread on CPU, NCCL's stream on
CUDA) while round ``r + 1`` is denoised and decoded; a rank then holds two rounds of decoded tiles.
Decoding of one unit's chunk also overlaps other units' denoising (no barrier until the gather).
With replicated denoise the decode starts after the last DiT call: no overlap.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import torch

from tilecast.kernels.halo import group_rank, group_size
from tilecast.runtime.config import ServeConfig, VaeConfig
from tilecast.runtime.models.k6sr.decode_parallel import blend_rounds, decode_serial, decode_whole_tiles, owner_of
from tilecast.runtime.models.k6sr.spatial_shard import decode_spatial_shard
from tilecast.runtime.models.k6sr.tiling import TilePlan

logger = logging.getLogger(__name__)

DECODE_MODES = ("serial", "whole_tile", "spatial_shard")
StepCallback = Callable[[int, int], None]
DecodeFn = Callable[[torch.Tensor], torch.Tensor]


def select_decode_mode(vae: VaeConfig, num_ranks: int) -> str:
    """``"serial"``, ``"whole_tile"`` or ``"spatial_shard"`` from the ``--vae-config.*`` settings.

    Spatial shard wins when both flags are on; a single rank always decodes serially.
    """
    if vae.use_parallel_decode and vae.parallel_decode_mode != "spatial_shard":
        raise ValueError(f"--vae-config.parallel-decode-mode must be spatial_shard, got {vae.parallel_decode_mode!r}")
    if num_ranks == 1:
        return "serial"
    if vae.use_parallel_decode:
        return "spatial_shard"
    if vae.use_parallel_tiling:
        return "whole_tile"
    return "serial"


@dataclasses.dataclass(kw_only=True)
class TileWork:
    """The tile distribution of one pipeline; ``run`` does denoise + decode + blend."""

    group: Any
    """Every rank that runs the request (gathers go over it; gloo for CPU tensors, the NCCL group
    for CUDA tensors). ``None``: one rank."""
    decode_mode: str = "serial"
    """One of ``DECODE_MODES``."""
    tile_parallel: bool = False
    """Deal whole chunks to units (DP replicas) for the DiT too."""
    unit_size: int = 1
    """Ranks per unit under tile-parallel: consecutive ranks of ``group`` that shard one DiT call."""
    unit_group: Any = None
    """The unit's own group (its DP replica's decode group), for spatial-shard decode inside a unit."""

    def __post_init__(self) -> None:
        if self.decode_mode not in DECODE_MODES:
            raise ValueError(f"decode mode must be one of {DECODE_MODES}, got {self.decode_mode!r}")
        if self.unit_size < 1:
            raise ValueError(f"unit_size must be >= 1, got {self.unit_size}")

    @classmethod
    def from_context(cls, ctx) -> "TileWork":
        """From ``ctx.settings`` (``vae``, ``tile_parallel``, the DiT degrees), ``ctx.device_group`` and
        ``ctx.groups`` (the mesh's groups; ``decode_group`` is a unit's group)."""
        group = ctx.device_group
        num_ranks = group_size(group) if group is not None else 1
        unit_group = ctx.groups.decode_group if getattr(ctx, "groups", None) is not None else None
        return cls.from_settings(ctx.settings, group=group, num_ranks=num_ranks, unit_group=unit_group)

    @classmethod
    def from_settings(cls, settings: ServeConfig, *, group, num_ranks: int, unit_group=None) -> "TileWork":
        """Read ``settings.vae`` (``--vae-config.*``), ``settings.tile_parallel`` and the DiT degrees
        (``tp_size``, ``ulysses_degree``, ``ring_degree``). ``ValueError`` for a combination that
        cannot apply on ``num_ranks`` ranks (tile-parallel with one unit; spatial-shard decode inside
        units of one rank). On one rank everything decodes serially (the same result)."""
        vae = settings.vae
        mode = select_decode_mode(vae, num_ranks)
        unit_size = settings.tp_size * settings.ulysses_degree * settings.ring_degree
        if num_ranks == 1:
            return cls(group=group, decode_mode="serial")
        if not settings.tile_parallel:
            return cls(group=group, decode_mode=mode)
        if num_ranks % unit_size or num_ranks == unit_size:
            raise ValueError(
                f"--tile-parallel needs at least two data-parallel units, but the DiT is sharded (TP x Ulysses x "
                f"Ring = {unit_size}) across all {num_ranks} ranks: drop --tile-parallel or lower the degrees"
            )
        if mode == "spatial_shard" and unit_size == 1:
            raise ValueError(
                "--vae-config.use-parallel-decode cannot apply with --tile-parallel on unsharded DiT ranks (each "
                "rank decodes the chunks it denoised whole): drop one of them"
            )
        return cls(group=group, decode_mode=mode, tile_parallel=True, unit_size=unit_size, unit_group=unit_group)

    @property
    def is_parallel(self) -> bool:
        return self.tile_parallel or self.decode_mode != "serial"

    def run(
        self,
        parts,
        tiles_NCTHW: torch.Tensor,
        settings,
        plan: TilePlan,
        num_frames: int,
        *,
        on_progress: StepCallback | None = None,
        timings: dict[str, float] | None = None,
        hooks=None,
    ) -> torch.Tensor:
        """Denoise, decode and blend ``tiles_NCTHW``: ``video_BCFHW`` on every rank.

        ``timings`` gets ``denoise`` and ``decode`` (incl. blend); under tile-parallel they overlap,
        so all of it is counted as ``denoise`` and ``decode`` is 0. ``hooks`` (``stages.RunHooks``):
        decoder blocks beat the watchdog; cancel points only where every rank of ``group`` meets
        (each replicated DiT step, each chunk decoded together, each gathered round), never inside a
        unit's own tiles (the units hold different numbers of chunks).
        """
        from tilecast.runtime.models.k6sr import stages  # stages calls into this module

        hooks = hooks if hooks is not None else stages.NO_HOOKS
        timings = timings if timings is not None else {}
        decode = _bind_decode(stages, parts, hooks.alive)
        started = time.perf_counter()
        if self.tile_parallel:

            def spatial_decode(latents_BCTHW: torch.Tensor) -> torch.Tensor:
                return decode_spatial_shard(decode, parts.vae.decoder, latents_BCTHW, self.unit_group)

            unit_decode = spatial_decode if self.decode_mode == "spatial_shard" and self.unit_size > 1 else decode

            video = denoise_decode_tile_parallel(
                parts,
                tiles_NCTHW,
                settings,
                plan,
                num_frames,
                decode=unit_decode,
                group=self.group,
                unit_size=self.unit_size,
                on_progress=on_progress,
                cancel_point=hooks.cancel_point,
            )
            timings["denoise"], timings["decode"] = time.perf_counter() - started, 0.0
            return video
        chunks = stages.denoise_tiles(parts, tiles_NCTHW, settings, on_progress, hooks)
        timings["denoise"] = time.perf_counter() - started
        started = time.perf_counter()
        video = decode_chunks(
            decode,
            parts.vae.decoder,
            chunks,
            plan,
            num_frames,
            mode=self.decode_mode,
            group=self.group,
            device=parts.device,
            cancel_point=hooks.cancel_point,
        )
        timings["decode"] = time.perf_counter() - started
        return video


def _bind_decode(stages, parts, alive: Callable[[], None] | None = None) -> DecodeFn:
    def decode(latents_BCTHW: torch.Tensor) -> torch.Tensor:
        return stages.decode_latents(parts, latents_BCTHW, alive=alive)

    return decode


def decode_chunks(
    decode: DecodeFn,
    decoder: torch.nn.Module,
    chunks: list[tuple[range, torch.Tensor]],
    plan: TilePlan,
    num_frames: int,
    *,
    mode: str,
    group,
    device,
    cancel_point: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Decode replicated denoised ``chunks`` in ``mode`` and blend: ``video_BCFHW`` on every rank.
    ``cancel_point`` runs after each chunk (serial, spatial shard) or round (whole tile)."""
    if mode == "whole_tile":
        return decode_whole_tiles(
            decode, chunks, plan, num_frames, group=group, device=device, cancel_point=cancel_point
        )
    if mode == "spatial_shard":

        def decode_sharded(latents_BCTHW: torch.Tensor) -> torch.Tensor:
            return decode_spatial_shard(decode, decoder, latents_BCTHW, group)

        return decode_serial(decode_sharded, chunks, plan, num_frames, device=device, cancel_point=cancel_point)
    if mode != "serial":
        raise ValueError(f"decode mode must be one of {DECODE_MODES}, got {mode!r}")
    return decode_serial(decode, chunks, plan, num_frames, device=device, cancel_point=cancel_point)


def unit_chunks(num_chunks: int, group, unit_size: int = 1) -> list[int]:
    """Chunk indices this rank's unit denoises and decodes under tile-parallel (round-robin)."""
    num_units, unit = group_size(group) // unit_size, group_rank(group) // unit_size
    return [chunk for chunk in range(num_chunks) if owner_of(chunk, num_units) == unit]


def denoise_decode_tile_parallel(
    parts,
    tiles_NCTHW: torch.Tensor,
    settings,
    plan: TilePlan,
    num_frames: int,
    *,
    decode: DecodeFn,
    group,
    unit_size: int = 1,
    on_progress: StepCallback | None = None,
    cancel_point: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Tile-parallel denoise + decode per unit, gathered in rounds, pipelined: ``video_BCFHW`` on every rank.

    Bit-identical to ``stages.denoise_tiles`` then ``stages.decode_and_blend`` when ``decode`` is
    ``stages.decode_latents`` (``parts.transformer`` sharded, if at all, within each unit only).
    ``cancel_point`` runs between gathered rounds (every rank takes part in every round), or after
    each chunk when every rank produces every chunk (one unit or one chunk).
    """
    from tilecast.runtime.models.k6sr import stages

    ranges = stages.chunk_starts(tiles_NCTHW.shape[0], settings.tiles_batch_size)
    serial = group_size(group) == unit_size or len(ranges) == 1  # one unit or one chunk: no gather
    own = list(range(len(ranges))) if serial else unit_chunks(len(ranges), group, unit_size)
    step = stages.StepCounter(max(1, len(own) * settings.num_inference_steps), on_progress)

    with stages.NoiseAhead(tiles_NCTHW, ranges, own, settings, parts.device) as noises:

        def produce(chunk: int) -> torch.Tensor:
            noise = noises.take(chunk)
            return decode(stages.denoise_tile_range(parts, tiles_NCTHW, ranges[chunk], settings, step, noise=noise))

        if serial:
            decoded = ((ranges[chunk], produce(chunk)) for chunk in own)
            return decode_serial(
                lambda video: video, decoded, plan, num_frames, device=parts.device, cancel_point=cancel_point
            )
        return blend_rounds(
            produce,
            ranges,
            plan,
            num_frames,
            group=group,
            device=parts.device,
            overlap=True,
            unit_size=unit_size,
            between_rounds=cancel_point,
        )
