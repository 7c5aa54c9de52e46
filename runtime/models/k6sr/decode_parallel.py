"""Whole-tile parallel decode: denoised tile chunks dealt to the decode group, gathered, blended in order.

Legend: ``latents_BCTHW`` one chunk's denoised latents (batch = its tiles); ``video_BCFHW`` its
decoded pixels (float ``[-1, 1]``); ``round_GBCFHW`` one round as gathered (G = group size).

The unit of work is a chunk (the tiles one DiT call denoised), decoded as one batch exactly as the
serial ``stages.decode_and_blend`` does, each with a fresh ``vae.decode`` (so fresh temporal
caches): the same ops on the same values, hence the same bits. Chunk ``c`` belongs to group rank
``c % G``; chunks are processed in **rounds** of ``G`` (round ``r`` = chunks ``rG .. rG+G-1``):
every rank decodes its chunk of the round, one ``all_gather`` brings the round to every rank, and
the round is blended in chunk order before the next starts. So blending follows the serial order
(bit-identical output on every rank), and no rank holds more than one round of decoded tiles.

Every rank takes part in every round's ``all_gather``, also when it has no chunk in the last round
(5 chunks on 3 ranks): it sends zeros, and since the chunk list is known to all ranks, nobody needs
a flag to tell real slots from empty ones. Every rank issues the same collectives in the same
order. All ranks end up with the blended video (the pipeline runs identical post-processing on
every rank; only the output rank's copy is written).

Tile-parallel (``tile_parallel.py``) reuses :func:`blend_rounds` with units of several ranks (one DP
replica each) in place of single ranks: chunk ``c`` then belongs to unit ``c % num_units``.

The gather runs on the group given: on CUDA the NCCL device group, on CPU gloo. Bit-exactness
holds for the same per-rank setup: CPU kernels split work by thread count, so the serial reference
must run with the ranks' thread count (the tests use one thread everywhere).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from tilecast.kernels.halo import group_rank, group_size
from tilecast.runtime.models.k6sr.tiling import TileBlender, TilePlan

logger = logging.getLogger(__name__)

DecodeFn = Callable[[torch.Tensor], torch.Tensor]
"""``latents_BCTHW`` (scaled, as denoised) → float ``video_BCFHW`` in ``[-1, 1]``."""


def owner_of(chunk: int, num_units: int) -> int:
    """The unit (a rank, or a DP replica under tile-parallel) that works on chunk ``chunk``: round-robin."""
    return chunk % num_units


def num_rounds(num_chunks: int, num_units: int) -> int:
    return -(-num_chunks // num_units)


def blend_rounds(
    produce: Callable[[int], torch.Tensor | None],
    chunk_tiles: Sequence[range],
    plan: TilePlan,
    num_frames: int,
    *,
    group,
    device,
    overlap: bool = False,
    unit_size: int = 1,
    between_rounds: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Gather the chunks round by round and blend them in chunk order: ``video_BCFHW`` on every rank.

    The group's ranks form units of ``unit_size`` consecutive ranks (1: every rank a unit; under
    tile-parallel with a sharded DiT, one DP replica). Chunk ``c`` belongs to unit ``c % num_units``
    and round ``r`` holds chunks ``r * num_units ..``. ``chunk_tiles[c]`` are chunk ``c``'s tile
    indices (the same list on every rank). ``produce(c)`` is called on every rank of the owning
    unit, for its chunks in increasing order, and returns the decoded ``video_BCFHW`` of chunk
    ``c`` (the same on every rank of the unit; the unit's first rank's copy is blended). With
    ``overlap`` the gather of round ``r`` runs asynchronously while round ``r + 1`` is produced
    (then a rank holds two rounds). ``between_rounds()`` runs on every rank before each round after
    the first (a cancel point: every rank of the group is there, whatever chunks it owns).
    """
    size, index = group_size(group), group_rank(group)
    if unit_size < 1 or size % unit_size:
        raise ValueError(f"unit_size {unit_size} does not divide the group of {size} ranks")
    num_units, unit = size // unit_size, index // unit_size
    blender = TileBlender(plan, batch_size=1, num_frames=num_frames, device=device)
    base_h, base_w = plan.base_size
    widest = max(len(tiles) for tiles in chunk_tiles)
    slot_shape = (widest, 3, num_frames, base_h, base_w)

    def blend(first_chunk: int, round_GBCFHW: Sequence[torch.Tensor]) -> None:
        for owner in range(num_units):
            chunk = first_chunk + owner
            if chunk >= len(chunk_tiles):
                break
            for tile_CFHW, tile_index in zip(round_GBCFHW[owner * unit_size], chunk_tiles[chunk]):
                blender.add(tile_index, tile_CFHW)

    pending: tuple[int, Any, list[torch.Tensor]] | None = None
    for round_index in range(num_rounds(len(chunk_tiles), num_units)):
        if round_index and between_rounds is not None:
            between_rounds()
        first = round_index * num_units
        mine = first + unit
        send = torch.zeros(slot_shape, dtype=torch.float32, device=device)
        if mine < len(chunk_tiles):
            video_BCFHW = produce(mine)
            expected = (len(chunk_tiles[mine]), *slot_shape[1:])
            if tuple(video_BCFHW.shape) != expected:
                raise RuntimeError(f"chunk {mine} decoded to {tuple(video_BCFHW.shape)}, expected {expected}")
            send[: video_BCFHW.shape[0]] = video_BCFHW
            del video_BCFHW
        received = [torch.empty_like(send) for _ in range(size)]
        work = dist.all_gather(received, send, group=group, async_op=overlap)
        if pending is not None:
            _finish(pending, blend)
            pending = None
        if overlap:
            pending = (first, work, received)
        else:
            blend(first, received)
        del send
    if pending is not None:
        _finish(pending, blend)
    return blender.result()


def _finish(pending, blend) -> None:
    first, work, received = pending
    work.wait()
    blend(first, received)


def decode_whole_tiles(
    decode: DecodeFn,
    chunks: Sequence[tuple[range, torch.Tensor]],
    plan: TilePlan,
    num_frames: int,
    *,
    group,
    device,
    cancel_point: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Decode replicated denoised ``chunks`` (the same on every rank) with whole-tile parallelism.

    Bit-identical to ``stages.decode_and_blend`` on every rank. One chunk, or a group of one,
    decodes serially without collectives. ``cancel_point`` runs between rounds (or chunks).
    """
    chunk_tiles = [tiles for tiles, _ in chunks]
    if group_size(group) == 1 or len(chunks) == 1:
        return decode_serial(decode, chunks, plan, num_frames, device=device, cancel_point=cancel_point)

    def produce(chunk: int) -> torch.Tensor:
        return decode(chunks[chunk][1])

    return blend_rounds(produce, chunk_tiles, plan, num_frames, group=group, device=device, between_rounds=cancel_point)


def decode_serial(
    decode: DecodeFn,
    chunks: Sequence[tuple[range, torch.Tensor]] | Iterator[tuple[range, torch.Tensor]],
    plan: TilePlan,
    num_frames: int,
    *,
    device,
    cancel_point: Callable[[], None] | None = None,
) -> torch.Tensor:
    """The serial reference: decode each chunk in order and blend (what every rank does by default).
    ``cancel_point()`` after each chunk (every rank that calls this decodes every chunk)."""
    blender = TileBlender(plan, batch_size=1, num_frames=num_frames, device=device)
    for tiles, latents_BCTHW in chunks:
        for tile_CFHW, tile_index in zip(decode(latents_BCTHW), tiles):
            blender.add(tile_index, tile_CFHW)
        if cancel_point is not None:
            cancel_point()
    return blender.result()
