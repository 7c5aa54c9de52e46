"""``bench k6sr``'s PSNR against diffusers means agreement on several tile chunks, not a noise mismatch.

tilecast seeds each tile chunk's noise with ``seed + index of its first tile`` (the reference's
rule); diffusers' ``Kandinsky6SRPipeline`` draws every chunk from one generator. The bench
therefore runs its diffusers peer under ``chunk_seeded_noise`` (diffusers' own draw, a fresh
generator per chunk). Here the bench's very functions (``run_diffusers`` with the bench's dense SDPA
processor, then ``run_tilecast`` with tilecast's attention installed, as ``bench_k6sr`` does) run on
the tiny checkpoint on the CPU in float32, on a 96x96 clip (one frame: the noise rule does not
depend on the frame count, and 5 frames cost 6x the time): x2 gives 2x2 tiles, so 4 chunks of one
tile.

Measured (``-s`` prints them): with the same per-chunk noise the videos are bit-identical (PSNR
inf, max |diff| 0: on the CPU both sides run the same float32 ops, tilecast's attention picking SDPA
as the peer's processor does); with diffusers' single generator, 18.2 dB (only chunk 0's noise
agrees), the same effect as the large workload's 18 dB on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from tilecast.launcher.bench.k6sr import (
    DenseSDPAProcessor,
    chunk_seeded_noise,
    pattern_video,
    run_diffusers,
    run_tilecast,
    set_processors,
)
from tilecast.launcher.bench.report import psnr_db

SEED = 42
SAME_NOISE_MIN_DB = 60.0
"""Same noise: both sides run the same float32 ops but the attention kernel (1e-4 atol elsewhere)."""
OWN_NOISE_MAX_DB = 40.0
"""diffusers' own noise: tiles 1..3 start from other noise."""


@pytest.fixture(scope="module")
def outputs(tiny_cache):
    from tilecast.runtime.models.k6sr.attention import install_dense_attention
    from tilecast.runtime.models.k6sr.loading import load_components
    from tilecast.runtime.models.k6sr.tiny import ensure_tiny_k6sr

    parts = load_components(ensure_tiny_k6sr(), device="cpu", dtype=torch.float32)
    frames = pattern_video(96, 96, 1)
    with torch.no_grad():
        set_processors(parts.transformer, DenseSDPAProcessor)
        with chunk_seeded_noise(SEED) as first_tiles:
            same = run_diffusers(parts, frames, SEED, chunk_seeded=False)  # the bench's wrap, seen from outside
        own = run_diffusers(parts, frames, SEED, chunk_seeded=False)
        assert torch.equal(run_diffusers(parts, frames, SEED), same)  # the bench's default is the wrap
        install_dense_attention(parts.transformer)
        ours = run_tilecast(parts, frames, SEED)
    return {"first_tiles": first_tiles, "same": same, "own": own, "ours": ours}


def test_clip_has_several_tile_chunks(outputs):
    assert outputs["first_tiles"] == [0, 1, 2, 3]
    assert outputs["ours"].shape == outputs["same"].shape == (1, 3, 192, 192)
    assert outputs["same"].std() > 0.02, "the tiny weights give a (nearly) constant video"


def test_same_per_chunk_noise_agrees_with_diffusers(outputs):
    db = psnr_db(outputs["ours"], outputs["same"], peak=1.0)
    diff = (outputs["ours"] - outputs["same"]).abs().max().item()
    print(f"tilecast vs diffusers, same per-chunk noise: {db:.1f} dB, max |diff| {diff:.3g}")
    assert db >= SAME_NOISE_MIN_DB and diff <= 1e-4


def test_diffusers_single_generator_noise_disagrees(outputs):
    db = psnr_db(outputs["ours"], outputs["own"], peak=1.0)
    print(f"tilecast vs diffusers, diffusers' own single-generator noise: {db:.1f} dB")
    assert db <= OWN_NOISE_MAX_DB


def test_wrap_is_undone_and_one_video_at_a_time():
    from diffusers.pipelines.kandinsky6 import pipeline_kandinsky6_sr as module

    original = module.randn_tensor
    with chunk_seeded_noise(0):
        assert module.randn_tensor is not original
        with pytest.raises(ValueError, match="batch 1"):
            module.randn_tensor((1, 2), generator=[torch.Generator(), torch.Generator()])
    assert module.randn_tensor is original


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_peer_draw_is_tilecast_chunk_noise_in_the_bench_dtype(dtype):
    """The GPU bench runs bf16: the wrapped draw equals tilecast's ``draw_chunk_noise`` bit for bit."""
    from diffusers.pipelines.kandinsky6 import pipeline_kandinsky6_sr as module

    from tilecast.runtime.models.k6sr.stages import draw_chunk_noise

    shapes = [(1, 5, 16, 24, 16), (2, 5, 16, 24, 16), (1, 5, 16, 24, 16)]
    with chunk_seeded_noise(SEED):
        drawn = [
            module.randn_tensor(s, generator=torch.Generator(), device=torch.device("cpu"), dtype=dtype) for s in shapes
        ]
    for noise, shape, first_tile in zip(drawn, shapes, [0, 1, 3]):
        assert torch.equal(noise, draw_chunk_noise(shape, SEED, first_tile, dtype))


def test_decode_flops_are_what_the_timed_decodes_ran(tiny_cache):
    """``bench k6sr``'s ``decode_tflops``: the timer records each decode's latent shape, and the FLOPs
    counted on meta tensors for those shapes equal those of the real decode on the CPU."""
    from torch.utils.flop_counter import FlopCounterMode

    from tilecast.launcher.bench.k6sr import StageTimer, decode_flops
    from tilecast.runtime.models.k6sr.loading import load_components
    from tilecast.runtime.models.k6sr.tiny import ensure_tiny_k6sr
    from tilecast.runtime.models.k6sr.vae_decode import ChannelsLastDecoder

    parts = load_components(ensure_tiny_k6sr(), device="cpu", dtype=torch.float32)
    parts.decoder = ChannelsLastDecoder(parts.vae)
    timer = StageTimer(parts)
    timer.wrap(parts.decoder, "decode", "decode")
    latents = torch.randn(1, parts.vae.config.latent_channels, 2, 6, 4)
    counter = FlopCounterMode(display=False)
    try:
        with counter, torch.no_grad():
            parts.decoder.decode(latents)
            parts.decoder.decode(latents)
    finally:
        timer.close()
    assert timer.decoded == [tuple(latents.shape)] * 2
    assert decode_flops(parts.vae, timer.decoded) == counter.get_total_flops() > 0
