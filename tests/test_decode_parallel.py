"""Whole-tile parallel decode on 2 and 3 gloo ranks is bit-identical to serial decode.

Works at the level of denoised latent tiles and the tiny K-VAE (8x8 latents → 128x128 px tiles,
5 frames): the single-rank reference (``decode_serial``, what ``stages.decode_and_blend`` does) is
computed in the test process; every rank returns its blended video, which must ``torch.equal`` it
(so every rank has the output). Tile counts not divisible by the rank count exercise ranks with no
chunk in the last round; a hang there would hit the hard timeout.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.distributed import one_thread, run_ranks
from tests.harness import make_context
from tilecast.runtime.config import ServeConfig, VaeConfig
from tilecast.runtime.models.k6sr.decode_parallel import decode_serial, decode_whole_tiles, num_rounds, owner_of
from tilecast.runtime.models.k6sr.tile_parallel import TileWork, select_decode_mode
from tilecast.runtime.models.k6sr.tiling import plan_tiles

TIMEOUT = 120
LATENT_FRAMES = 2  # 5 pixel frames
WIDTH_FOR_TILES = {1: 64, 3: 128, 5: 256}  # low-res width → tiles in one row (64 px tall, x2)


def tiny_vae():
    from diffusers import Kandinsky6SRVAE

    from tilecast.runtime.models.k6sr.tiny import VAE_CONFIG

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Kandinsky6SRVAE(**VAE_CONFIG).eval()


def make_case(num_tiles: int, batch: int):
    """(plan, chunks, decode, num_frames): seeded denoised latents in chunks of ``batch`` tiles."""
    from tilecast.runtime.models.k6sr.stages import chunk_starts, decode_latents

    plan = plan_tiles(
        64, WIDTH_FOR_TILES[num_tiles], tiling_scale=2, tile_sizes=((128, 128),), min_overlap=0.2, snap=16
    )
    assert plan.num_tiles == num_tiles
    latents_NCTHW = torch.randn(num_tiles, 16, LATENT_FRAMES, 8, 8, generator=torch.Generator().manual_seed(7))
    chunks = [(tiles, latents_NCTHW[tiles.start : tiles.stop]) for tiles in chunk_starts(num_tiles, batch)]
    parts = SimpleNamespace(vae=tiny_vae(), decoder=None)

    def decode(latents_BCTHW):
        return decode_latents(parts, latents_BCTHW)

    return plan, chunks, decode, 1 + 4 * (LATENT_FRAMES - 1)


def _whole_tile(rank, world_size, cases):
    import torch.distributed as dist

    outputs = []
    for num_tiles, batch, repeats in cases:
        plan, chunks, decode, num_frames = make_case(num_tiles, batch)
        with torch.no_grad():
            outputs.append(
                [
                    decode_whole_tiles(decode, chunks, plan, num_frames, group=dist.group.WORLD, device="cpu")
                    for _ in range(repeats)
                ]
            )
    return outputs


@pytest.fixture(scope="module")
def serial():
    cache = {}

    def get(num_tiles, batch):
        if (num_tiles, batch) not in cache:
            plan, chunks, decode, num_frames = make_case(num_tiles, batch)
            with torch.no_grad(), one_thread():
                cache[num_tiles, batch] = decode_serial(decode, chunks, plan, num_frames, device="cpu")
        return cache[num_tiles, batch]

    return get


@pytest.mark.parametrize(
    "world_size, cases",
    [
        # (tiles, tiles per chunk, runs): 5 chunks on 2 ranks (rank 1 idles in round 3), run twice to
        # show it reproduces itself; a single tile (serial fallback, no collectives).
        (2, [(5, 1, 2), (1, 1, 1)]),
        # 5 chunks on 3 ranks (rank 2 idles in round 2); 3 uneven chunks of 2, 2, 1 tiles (one round).
        (3, [(5, 1, 1), (5, 2, 1)]),
    ],
)
def test_whole_tile_is_bit_identical_to_serial(serial, world_size, cases):
    results = run_ranks(_whole_tile, world_size, cases, timeout=TIMEOUT)
    for case_index, (num_tiles, batch, _) in enumerate(cases):
        reference = serial(num_tiles, batch)
        for rank, outputs in enumerate(results):
            for video in outputs[case_index]:
                assert torch.equal(video, reference), f"rank {rank}, {num_tiles} tiles by {batch}: differs from serial"


def test_rounds_deal_chunks_round_robin():
    assert [owner_of(c, 3) for c in range(5)] == [0, 1, 2, 0, 1]
    assert [num_rounds(n, 3) for n in (1, 3, 4, 6, 7)] == [1, 1, 2, 2, 3]


@pytest.mark.parametrize(
    "vae, num_ranks, expected",
    [
        ({"use_parallel_tiling": True, "use_parallel_decode": False}, 2, "whole_tile"),
        ({"use_parallel_tiling": False, "use_parallel_decode": True}, 2, "spatial_shard"),
        ({"use_parallel_tiling": True, "use_parallel_decode": True}, 2, "spatial_shard"),  # spatial wins
        ({"use_parallel_tiling": True, "use_parallel_decode": True}, 1, "serial"),  # one GPU
        ({}, 4, "serial"),
    ],
)
def test_decode_mode_selection(vae, num_ranks, expected):
    assert select_decode_mode(VaeConfig(**vae), num_ranks) == expected


def test_bad_decode_mode_is_refused():
    with pytest.raises(ValueError, match="parallel-decode-mode"):
        select_decode_mode(VaeConfig(use_parallel_decode=True, parallel_decode_mode="patch"), 2)
    with pytest.raises(ValueError, match="decode mode"):
        TileWork(group=None, decode_mode="rows")


def test_tile_work_from_settings_refuses_what_cannot_apply():
    vae = {"use_parallel_tiling": True, "use_parallel_decode": True, "parallel_decode_mode": "spatial_shard"}

    def settings(num_gpus, **fields):
        return ServeConfig(device="cpu", num_gpus=num_gpus, tile_parallel=True, vae=vae, **fields)

    with pytest.raises(ValueError, match="--tile-parallel needs at least two data-parallel units"):
        TileWork.from_settings(settings(2, ulysses_degree=2), group=None, num_ranks=2)
    with pytest.raises(ValueError, match="--vae-config.use-parallel-decode cannot apply with --tile-parallel"):
        TileWork.from_settings(settings(2), group=None, num_ranks=2)
    work = TileWork.from_settings(settings(4, ulysses_degree=2), group=None, num_ranks=4)
    assert (work.decode_mode, work.tile_parallel, work.unit_size) == ("spatial_shard", True, 2)

    work = TileWork.from_context(make_context(tile_parallel=True, vae=vae))  # no process group: one rank
    assert (work.decode_mode, work.tile_parallel, work.is_parallel) == ("serial", False, False)


# ---------------------------------------------------------------------------------------------
# End to end: K6SRPipeline.run on 2 ranks (whole-tile decode; tile-parallel + whole-tile) vs 1 rank.


def _pipeline_ctx(rank, world_size, group, output_dir, cache_dir, media_dir, **settings):
    return make_context(
        output_dir,
        rank=rank,
        world_size=world_size,
        cpu_group=group,
        device_group=group,
        cache_dir=cache_dir,
        allowed_video_dirs=[str(media_dir)],
        **settings,
    )


def _run_pipeline(ctx, video_path):
    from tilecast.runtime.models.k6sr.params import SRParams
    from tilecast.runtime.models.k6sr.pipeline import K6SRPipeline
    from tilecast.runtime.models.k6sr.video_io import read_clip
    from tilecast.runtime.pipeline import WorkItem

    pipe = K6SRPipeline.load("tiny/k6sr", ctx)
    params = pipe.prepare(SRParams(video_path=str(video_path), sr_resolution_scale=2.25, return_frames=True), {})
    outputs = {}
    for label, options in MODES.items():
        pipe.tile_work = TileWork.from_context(
            _pipeline_ctx(ctx.rank, ctx.world_size, ctx.device_group, ctx.output_dir, "", "", **options)
        )
        output = pipe.run([WorkItem(job_id=label, params=params)], ctx)[0]
        audio = read_clip(output.files[0].path).audio_S if output.files else None
        outputs[label] = (output.tensors["frames"], audio, pipe.tile_work.decode_mode, pipe.tile_work.tile_parallel)
        outputs["num_tiles"] = output.info["num_tiles"]
    return outputs


MODES = {
    "whole_tile": {"vae": {"use_parallel_tiling": True}},
    "tile_parallel": {"vae": {"use_parallel_tiling": True}, "tile_parallel": True},
}


def _pipeline_rank(rank, world_size, tmp, video_path):
    from pathlib import Path

    import torch.distributed as dist

    tmp = Path(tmp)
    ctx = _pipeline_ctx(rank, world_size, dist.group.WORLD, tmp / f"out{rank}", tmp / "cache", video_path.parent)
    return _run_pipeline(ctx, video_path)


def test_pipeline_on_two_ranks_matches_one_rank(tmp_path):
    from tests.media import write_test_video
    from tilecast.runtime.models.k6sr.tiny import ensure_tiny_k6sr

    ensure_tiny_k6sr(tmp_path / "cache")
    (tmp_path / "media").mkdir()
    video_path = write_test_video(tmp_path / "media" / "clip.mp4", 80, 80, 9, 24, audio=True)
    ctx = _pipeline_ctx(0, 1, None, tmp_path / "single", tmp_path / "cache", tmp_path / "media")
    with torch.no_grad(), one_thread():
        single = _run_pipeline(ctx, video_path)
    results = run_ranks(_pipeline_rank, 2, str(tmp_path), video_path, timeout=TIMEOUT)
    frames_1, audio_1, mode_1, _ = single["whole_tile"]
    assert mode_1 == "serial" and frames_1.shape == (9, 192, 192, 3) and audio_1 is not None
    assert single["num_tiles"] == 4  # 2x2 tiles: 2 chunks per rank
    for label in MODES:
        for rank, outputs in enumerate(results):
            frames, audio, mode, tile_parallel = outputs[label]
            assert mode == "whole_tile" and tile_parallel == (label == "tile_parallel")
            assert torch.equal(frames, frames_1), f"{label}, rank {rank}: frames differ from one rank"
            if rank == 0:  # the output rank wrote the MP4
                assert audio is not None and audio.shape == audio_1.shape and (audio == audio_1).all()
