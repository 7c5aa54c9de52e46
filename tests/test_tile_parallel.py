"""Tile-parallel denoise (+ whole-tile decode, pipelined) on 2 gloo ranks equals sequential chunks.

The tiny checkpoint's DiT and K-VAE work on seeded low-resolution latent tiles (8x8 latents,
2 latent frames). The reference is the serial code path of ``stages`` (``denoise_tiles`` then
``decode_and_blend``) in the test process, on one thread like the ranks. Each rank runs
``TileWork.run`` in every mode: tile-parallel (twice: it must reproduce itself), whole-tile decode
and spatial-shard decode (both after a replicated denoise).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed import one_thread, run_ranks
from tilecast.runtime.models.k6sr.tiling import plan_tiles

TIMEOUT = 120
NUM_TILES = 3  # 3 chunks on 2 ranks: rank 1 has no chunk in the second round
WIDTH_FOR_3_TILES = 128


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from tilecast.runtime.models.k6sr.tiny import ensure_tiny_k6sr

    return ensure_tiny_k6sr(tmp_path_factory.mktemp("cache"))


def load(model_dir):
    from tilecast.runtime.models.k6sr.attention import install_dense_attention
    from tilecast.runtime.models.k6sr.loading import load_components

    parts = load_components(model_dir, device="cpu", dtype=torch.float32)
    install_dense_attention(parts.transformer)
    return parts


def make_case(batch: int):
    from tilecast.runtime.models.k6sr.stages import SRSettings

    plan = plan_tiles(64, WIDTH_FOR_3_TILES, tiling_scale=2, tile_sizes=((128, 128),), min_overlap=0.2, snap=16)
    assert plan.num_tiles == NUM_TILES
    tiles_NCTHW = torch.randn(NUM_TILES, 16, 2, 8, 8, generator=torch.Generator().manual_seed(11))
    settings = SRSettings(scale=2, num_inference_steps=2, seed=42, tiles_batch_size=batch)
    return plan, tiles_NCTHW, settings, 5


def _modes(rank, world_size, model_dir, batches):
    import torch.distributed as dist

    from tilecast.runtime.models.k6sr.tile_parallel import TileWork

    parts = load(model_dir)
    group = dist.group.WORLD
    results = []
    for batch in batches:
        plan, tiles_NCTHW, settings, num_frames = make_case(batch)
        progress = []
        outputs = {}

        def record(done, total, progress=progress):
            progress.append((done, total))

        with torch.no_grad():
            work = TileWork(group=group, decode_mode="whole_tile", tile_parallel=True)
            outputs["tile_parallel"] = [
                work.run(parts, tiles_NCTHW, settings, plan, num_frames, on_progress=record) for _ in range(2)
            ]
            for mode in ("whole_tile", "spatial_shard"):
                work = TileWork(group=group, decode_mode=mode)
                outputs[mode] = work.run(parts, tiles_NCTHW, settings, plan, num_frames)
        results.append((outputs, progress))
    return results


def _units(rank, world_size, model_dir):
    """4 ranks as 2 units of 2 (DP replicas); the DiT is not sharded here, which the dealing and
    gathering do not care about. The second run decodes each chunk spatially sharded in its unit."""
    import torch.distributed as dist

    from tilecast.runtime.models.k6sr.tile_parallel import TileWork

    parts = load(model_dir)
    unit_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    plan, tiles_NCTHW, settings, num_frames = make_case(1)
    outputs = {}
    with torch.no_grad():
        for mode in ("whole_tile", "spatial_shard"):
            work = TileWork(
                group=dist.group.WORLD,
                decode_mode=mode,
                tile_parallel=True,
                unit_size=2,
                unit_group=unit_groups[rank // 2],
            )
            outputs[mode] = work.run(parts, tiles_NCTHW, settings, plan, num_frames)
    return outputs


@pytest.fixture(scope="module")
def reference(model_dir):
    from tilecast.runtime.models.k6sr.stages import decode_and_blend, denoise_tiles

    parts = load(model_dir)
    cache = {}

    def get(batch):
        if batch not in cache:
            plan, tiles_NCTHW, settings, num_frames = make_case(batch)
            with torch.no_grad(), one_thread():
                chunks = denoise_tiles(parts, tiles_NCTHW, settings)
                cache[batch] = decode_and_blend(parts, chunks, plan, num_frames)
        return cache[batch]

    return get


def test_tile_parallel_equals_sequential_chunks(model_dir, reference):
    # 3 chunks of 1 tile (rank 1 idles in round 2); chunks of 2 + 1 tiles; one chunk (serial fallback)
    batches = [1, 2, 3]
    results = run_ranks(_modes, 2, model_dir, batches, timeout=TIMEOUT)
    for batch_index, batch in enumerate(batches):
        expected = reference(batch)
        for rank, per_batch in enumerate(results):
            outputs, progress = per_batch[batch_index]
            first, second = outputs["tile_parallel"]
            assert torch.equal(first, expected), f"rank {rank}, batch {batch}: tile-parallel != sequential chunks"
            assert torch.equal(second, first), f"rank {rank}, batch {batch}: tile-parallel does not reproduce itself"
            assert torch.equal(outputs["whole_tile"], expected), f"rank {rank}, batch {batch}: whole-tile != serial"
            spatial_error = (outputs["spatial_shard"] - expected).abs().max().item()
            assert spatial_error <= 1e-4, f"rank {rank}, batch {batch}: spatial shard max |diff| {spatial_error}"
            # Chunk c is denoised by rank c % 2 (a single chunk by every rank); progress counts this
            # rank's own DiT steps.
            num_chunks = -(-NUM_TILES // batch)
            own_steps = (len(range(rank, num_chunks, 2)) if num_chunks > 1 else 1) * 2
            assert progress[-1] == (own_steps, own_steps)


def test_tile_parallel_over_units_of_two_ranks(model_dir, reference):
    expected = reference(1)
    for rank, outputs in enumerate(run_ranks(_units, 4, model_dir, timeout=TIMEOUT)):
        assert torch.equal(outputs["whole_tile"], expected), f"rank {rank}: units of 2 != sequential chunks"
        spatial_error = (outputs["spatial_shard"] - expected).abs().max().item()
        assert spatial_error <= 1e-4, f"rank {rank}: spatial shard in units, max |diff| {spatial_error}"
