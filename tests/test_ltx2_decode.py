"""LTX-2 parallel video VAE decode (``runtime/models/families/ltx2_decode.py``) on 2 and 4 gloo ranks.

The tiny checkpoint's ``AutoencoderKLLTX2Video`` (``ltx2.build_tiny_ltx2``'s config: 32x spatial,
8x temporal, reflect padding, causal decoder; seeded weights) decodes 8 latent rows x 2 cols (256 x
64 px) over 2 latent frames (9 frames). 2 ranks split the rows 4/4, 4 ranks 2/2/2/2 (the fewest
rows a rank takes). The reference is diffusers' serial ``vae.decode`` of the same latents in the
test process, on one thread like the ranks. Frames compare as uint8 (what is written) and as floats:

    bound: PSNR >= 60 dB, max |difference| <= 1/255 on uint8 frames, float max |diff| <= 1e-5;
    the same decode in float64 within 1e-12 of serial float64.

Measured (one thread, this machine; ``pytest -s`` prints them): 2 ranks: PSNR 94.6 dB, max diff
1/255, float max |diff| 3.8e-6, float64 0; 4 ranks: 95.1 dB, 1/255, 3.8e-6, float64 5.4e-15. Not
bit-exact: the convolutions run on band shapes, which moves fp rounding only, as the float64 run
shows. Decoding the bands *without* the sharding (independent bands, reflect padding at the band
edges) is off by 1.73, so the bound does see seams (``SEAM_FLOOR``).

The pipeline test serves ``LTX2T2VPipeline`` on 2 ranks whose decode group spans both (Ulysses
degree 2: one DP replica of 2 ranks; the DiT itself runs replicated here) with
``--vae-config.use-parallel-decode`` and compares its frames (and its soundtrack, decoded
replicated) with the same rank's serial pipeline (measured: max |diff| 2.4e-7 on the ``[0, 1]``
frames, 9 frames of 128 x 64 px, 2 latent rows per rank; the audio is equal).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.distributed import one_thread, run_ranks
from tests.test_spatial_shard import psnr_and_max_diff, to_uint8
from tilecast.kernels.halo import split_sizes

TIMEOUT = 120
PSNR_BOUND_DB = 60.0
MAX_DIFF_BOUND = 1  # uint8 levels
FLOAT_BOUND = 1e-5
FLOAT64_BOUND = 1e-12
"""The same decode in float64: the sharded arithmetic is the serial one up to rounding."""
SEAM_FLOOR = 1e-2
PRELOAD = ("diffusers.models.autoencoders.autoencoder_kl_ltx2",)
ROWS, COLS, LATENT_FRAMES, CHANNELS = 8, 2, 2, 8


def tiny_vae():
    """The tiny checkpoint's ``AutoencoderKLLTX2Video`` config with seeded weights."""
    from diffusers import AutoencoderKLLTX2Video

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoencoderKLLTX2Video(
            latent_channels=CHANNELS,
            block_out_channels=(8, 16, 32, 64),
            decoder_block_out_channels=(8, 16, 32),
            layers_per_block=(1, 1, 1, 1, 1),
            decoder_layers_per_block=(1, 1, 1, 1),
            spatial_compression_ratio=32,
            temporal_compression_ratio=8,
        ).eval()


def latents(rows: int = ROWS, latent_frames: int = LATENT_FRAMES) -> torch.Tensor:
    return torch.randn(1, CHANNELS, latent_frames, rows, COLS, generator=torch.Generator().manual_seed(3))


def serial_decode(rows: int = ROWS, latent_frames: int = LATENT_FRAMES) -> torch.Tensor:
    with torch.no_grad(), one_thread():
        return tiny_vae().decode(latents(rows, latent_frames), return_dict=False)[0]


def changed(vae) -> list[str]:
    """Decoder modules left with a swapped forward."""
    return [name for name, module in vae.decoder.named_modules() if "forward" in vars(module)]


def _decode_rank(rank, world_size):
    import torch.distributed as dist

    from tilecast.runtime.models.families.ltx2_decode import decode_spatial_shard

    vae = tiny_vae()
    group = dist.group.WORLD
    with torch.no_grad():
        videos = [decode_spatial_shard(vae, latents(), group) for _ in range(2)]
        short = decode_spatial_shard(vae, latents(world_size, 1), group)  # 1 row each: replicated
        sizes = split_sizes(ROWS, world_size)
        band = latents().narrow(3, sum(sizes[:rank]), sizes[rank])
        unsharded_band = vae.decode(band, return_dict=False)[0]  # what seams look like
        exact = decode_spatial_shard(vae.double(), latents().double(), group)
    return {"videos": videos, "short": short, "band": unsharded_band, "left": changed(vae), "float64": exact}


@pytest.mark.parametrize("world_size", [2, 4])
def test_parallel_decode_matches_serial(world_size):
    reference = serial_decode()
    assert reference.shape == (1, 3, 8 * (LATENT_FRAMES - 1) + 1, 32 * ROWS, 32 * COLS)
    results = run_ranks(_decode_rank, world_size, timeout=TIMEOUT, preload=PRELOAD)
    video = results[0]["videos"][0]
    for rank, result in enumerate(results):
        assert result["left"] == [], f"rank {rank}: decoder not restored after the sharded decode: {result['left']}"
        for again in result["videos"]:
            assert torch.equal(again, video), f"rank {rank}: output differs from rank 0's or from its first decode"
        assert torch.equal(result["short"], serial_decode(world_size, 1)), f"rank {rank}: replicated fallback"
    float_diff = (video - reference).abs().max().item()
    psnr, max_diff = psnr_and_max_diff(to_uint8(video), to_uint8(reference))
    sizes = split_sizes(ROWS, world_size)
    seams = max(
        (result["band"] - reference.narrow(3, 32 * sum(sizes[:rank]), 32 * sizes[rank])).abs().max().item()
        for rank, result in enumerate(results)
    )
    with torch.no_grad(), one_thread():
        exact_diff = (results[0]["float64"] - tiny_vae().double().decode(latents().double())[0]).abs().max().item()
    print(
        f"\nLTX-2 parallel decode, {world_size} ranks, latent rows {sizes}, {reference.shape[2]} frames: "
        f"PSNR {psnr:.2f} dB, max diff {max_diff}/255, float max |diff| {float_diff:.3g}; "
        f"float64: {exact_diff:.3g}; bands decoded alone: float max |diff| {seams:.3g}"
    )
    assert psnr >= PSNR_BOUND_DB and max_diff <= MAX_DIFF_BOUND and float_diff <= FLOAT_BOUND
    assert exact_diff <= FLOAT64_BOUND
    assert seams > SEAM_FLOOR


def _pipeline_rank(rank, world_size, cache):
    import torch.distributed as dist

    from tests.harness import make_context
    from tilecast.runtime.models.families.ltx2 import LTX2T2VPipeline
    from tilecast.runtime.models.families.ltx2_decode import ShardedLTX2Decode
    from tilecast.runtime.pipeline import WorkItem
    from tilecast.runtime.topology import Topology

    os.environ["TILECAST_CACHE"] = cache
    topology = Topology(num_gpus=world_size, ulysses_degree=world_size)
    groups = topology.groups(topology.build_mesh("cpu"))
    outputs = {}
    for name, vae in (("serial", {}), ("parallel", {"use_parallel_decode": True})):
        ctx = make_context(
            Path(cache) / f"out{rank}",
            rank=rank,
            world_size=world_size,
            cpu_group=dist.group.WORLD,
            device_group=dist.group.WORLD,
            groups=groups,
            dtype="float32",
            vae=vae,
        )
        pipe = LTX2T2VPipeline.load(LTX2T2VPipeline.builtin_name, ctx)
        params = pipe.prepare(
            pipe.params_type(
                prompt="a red kite",
                width=64,
                height=128,
                num_frames=9,
                seed=5,
                num_inference_steps=2,  # one step: NaN from the released scheduler's shift_terminal
                return_tensor=True,
            ),
            {},
        )
        output = pipe.run([WorkItem(job_id=name, params=params)], ctx)[0]
        outputs[name], outputs[f"{name}_audio"] = output.tensors["video"], output.tensors["audio"]
        outputs[f"{name}_installed"] = isinstance(vars(pipe.pipe.vae).get("decode"), ShardedLTX2Decode)
        assert pipe.parallel_decode == outputs[f"{name}_installed"]
    return outputs


def test_ltx2_pipeline_decodes_in_parallel_on_two_ranks(tiny_cache):
    from tilecast.runtime.models.families.ltx2 import TINY_LTX2

    TINY_LTX2.ensure(tiny_cache)  # built once here, not raced by the ranks
    results = run_ranks(_pipeline_rank, 2, str(tiny_cache), timeout=TIMEOUT, preload=PRELOAD)
    for rank, result in enumerate(results):
        assert result["parallel_installed"] and not result["serial_installed"], rank
        assert result["parallel"].shape == (9, 3, 128, 64)
        assert torch.equal(result["parallel"], results[0]["parallel"]), f"rank {rank} differs from rank 0"
        assert torch.equal(result["parallel_audio"], result["serial_audio"]), rank  # decoded replicated
        diff = (result["parallel"] - result["serial"]).abs().max().item()
        print(f"\nLTX2T2VPipeline rank {rank}: parallel vs serial decode, max |diff| {diff:.3g} on [0, 1] frames")
        assert diff <= FLOAT_BOUND, (rank, diff)


# ---- one process -----------------------------------------------------------------------------


def test_single_rank_decodes_serially_and_tiling_is_refused():
    from tilecast.runtime.models.families.ltx2_decode import decode_spatial_shard

    vae = tiny_vae()
    with torch.no_grad(), one_thread():
        assert torch.equal(decode_spatial_shard(vae, latents(8, 1), None), serial_decode(8, 1))
    vae.enable_tiling()
    with pytest.raises(ValueError, match="tiling"):
        decode_spatial_shard(vae, latents(8, 1), None)


def test_unknown_decoder_module_and_noise_injection_are_refused_and_nothing_stays_changed():
    from tilecast.runtime.models.families.ltx2_decode import sharded_ltx2_decoder

    vae = tiny_vae()
    vae.decoder.up_blocks[0].extra = torch.nn.Conv3d(8, 8, kernel_size=3, padding=1)
    with pytest.raises(RuntimeError, match="up_blocks.0.extra"):
        with sharded_ltx2_decoder(vae.decoder, None):
            pass
    del vae.decoder.up_blocks[0].extra
    vae.decoder.up_blocks[0].resnets[0].per_channel_scale1 = torch.nn.Parameter(torch.zeros(8, 1, 1))
    with pytest.raises(RuntimeError, match="noise injection"):
        with sharded_ltx2_decoder(vae.decoder, None):
            pass
    assert changed(vae) == []
