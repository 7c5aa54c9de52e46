"""Wan parallel VAE decode (``runtime/models/families/wan_decode.py``) on 2, 3 and 4 gloo ranks.

The tiny checkpoint's ``AutoencoderKLWan`` (``wan.build_tiny_wan``'s config, seeded weights)
decodes 8 latent rows x 6 cols (64 x 48 px). 2 ranks split the rows 4/4 over 3 latent frames
(9 frames); 3 ranks split them 3/3/2 (uneven) over 5 latent frames (17 frames). Diffusers decodes
one latent frame per decoder call, so every frame after the first runs on the causal feature cache
that sharded decode keeps per band. The reference is diffusers' serial ``vae.decode`` of the same
latents in the test process, on one thread like the ranks. Frames compare as uint8 (what is
written), and as floats:

    bound: PSNR >= 60 dB, max |difference| <= 1/255 on uint8 frames, float max |diff| <= 1e-5.

Measured (fp32, one thread, this machine; ``pytest -s`` prints them): 2 ranks, 9 frames: PSNR
92.55 dB, max diff 1/255, float max |diff| 2.09e-6; 3 ranks (3/3/2), 17 frames: PSNR 93.09 dB, max
diff 1/255, float max |diff| 2.15e-6. Not bit-exact: the convolutions run on band shapes, which
moves fp rounding only (a value near a uint8 rounding boundary can flip by one level). Decoding the
bands *without* the halo hooks (independent bands, zero-padded edges) is off by 1.38 (2 ranks) and
1.71 (3 ranks) in float, so the bound does see seams (``SEAM_FLOOR``).

Wan 2.2 TI2V 5B's VAE (the tiny checkpoint's config, ``wan22.tiny_wan22_vae_config``: residual up
blocks with ``DupUp3D`` shortcuts, 2x2 patches, 48 latent channels) decodes through the same
hooks: 2 latent frames on the same 2 / 3 ranks, float max |diff| 0 / 8.9e-7; on 4 ranks (2 latent
rows each), 9 frames: 1.0e-6, PSNR 97.3 dB, max diff 1/255 (same bound).

The pipeline tests run each Wan VAE's family (``FAMILIES``: Wan2.1 T2V; Wan2.2 I2V A14B, Wan2.1's
VAE, with a first frame; Wan2.2 TI2V 5B, its own VAE; Helios Base, whose diffusers pipeline decodes
each 33-frame chunk with ``vae.decode``) on 2 ranks whose decode group spans both (Ulysses degree
2, so one DP replica of 2 ranks; the families still compute the DiT replicated) with
``--vae-config.use-parallel-decode`` and compare the output with the same rank's serial pipeline
(measured max |diff| on the ``[0, 1]`` frames of 64 x 32 px: 7.5e-7, 4.5e-7, 0 and 4.8e-7).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.distributed import one_thread, run_ranks
from tests.test_spatial_shard import psnr_and_max_diff, to_uint8
from tilecast.kernels.halo import split_sizes

TIMEOUT = 120
PSNR_BOUND_DB = 60.0
MAX_DIFF_BOUND = 1  # uint8 levels
FLOAT_BOUND = 1e-5
SEAM_FLOOR = 1e-2
"""Bands decoded without halos must differ from serial by more than this (the test sees seams)."""
PRELOAD = ("diffusers.models.autoencoders.autoencoder_kl_wan",)


TINY_VAE = dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1, temperal_downsample=[False, True, True])
"""``wan.build_tiny_wan``'s VAE config."""


def wan22_vae_config() -> dict:
    """The Wan 2.2 (TI2V-5B) VAE's structure as the tiny checkpoint has it (``wan22.tiny_wan22_vae_config``):
    residual up blocks with ``DupUp3D`` shortcuts, 2x2 patches (``unpatchify`` after the decoder), 48
    latent channels, 16x spatial."""
    from tilecast.runtime.models.families.wan22 import tiny_wan22_vae_config

    return tiny_wan22_vae_config()


def tiny_vae(config=None):
    """An ``AutoencoderKLWan`` of ``config`` (default ``TINY_VAE``) with seeded weights."""
    from diffusers import AutoencoderKLWan

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoencoderKLWan(**(config or TINY_VAE)).eval()


def latents(rows: int, latent_frames: int, cols: int = 6, channels: int = 16) -> torch.Tensor:
    return torch.randn(1, channels, latent_frames, rows, cols, generator=torch.Generator().manual_seed(3))


def serial_decode(rows: int, latent_frames: int) -> torch.Tensor:
    with torch.no_grad(), one_thread():
        return tiny_vae().decode(latents(rows, latent_frames), return_dict=False)[0]


def hooks_left(vae) -> list[str]:
    """Decoder modules that still carry a hook or a changed row padding."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    left = []
    for name, module in vae.decoder.named_modules():
        if module._forward_hooks or module._forward_pre_hooks:
            left.append(name)
        elif isinstance(module, WanCausalConv3d) and module.kernel_size[1] == 3 and module._padding[2] != 1:
            left.append(name)
        elif isinstance(module, torch.nn.Conv2d) and module.kernel_size[0] == 3 and module.padding != (1, 1):
            left.append(name)
    return left


def _decode_rank(rank, world_size, rows, latent_frames):
    import torch.distributed as dist

    from tilecast.runtime.models.families.wan_decode import decode_spatial_shard

    vae = tiny_vae()
    group = dist.group.WORLD
    with torch.no_grad():
        videos = [decode_spatial_shard(vae, latents(rows, latent_frames), group) for _ in range(2)]
        short = decode_spatial_shard(vae, latents(world_size, 2), group)  # 1 row each: replicated
        sizes = split_sizes(rows, world_size)
        band = latents(rows, latent_frames).narrow(3, sum(sizes[:rank]), sizes[rank])
        unsharded_band = vae.decode(band, return_dict=False)[0]  # no halos: what seams look like
        wan22 = decode_spatial_shard(tiny_vae(wan22_vae_config()), latents(rows, 2, channels=48), group)
    return {"videos": videos, "short": short, "band": unsharded_band, "left": hooks_left(vae), "wan22": wan22}


@pytest.mark.parametrize(("world_size", "latent_frames"), [(2, 3), (3, 5)])
def test_parallel_decode_matches_serial(world_size, latent_frames):
    rows = 8
    reference = serial_decode(rows, latent_frames)
    assert reference.shape == (1, 3, 4 * (latent_frames - 1) + 1, 8 * rows, 48)
    results = run_ranks(_decode_rank, world_size, rows, latent_frames, timeout=TIMEOUT, preload=PRELOAD)
    video = results[0]["videos"][0]
    for rank, result in enumerate(results):
        assert result["left"] == [], f"rank {rank}: decoder not restored after the sharded decode: {result['left']}"
        for again in result["videos"]:
            assert torch.equal(again, video), f"rank {rank}: output differs from rank 0's or from its first decode"
        assert torch.equal(result["short"], serial_decode(world_size, 2)), f"rank {rank}: replicated fallback"
    float_diff = (video - reference).abs().max().item()
    psnr, max_diff = psnr_and_max_diff(to_uint8(video), to_uint8(reference))
    sizes = split_sizes(rows, world_size)
    seams = max(
        (result["band"] - reference.narrow(3, 8 * sum(sizes[:rank]), 8 * sizes[rank])).abs().max().item()
        for rank, result in enumerate(results)
    )
    print(
        f"\nWan parallel decode, {world_size} ranks, latent rows {sizes}, {reference.shape[2]} frames: "
        f"PSNR {psnr:.2f} dB, max diff {max_diff}/255, float max |diff| {float_diff:.3g}; "
        f"bands without halos: float max |diff| {seams:.3g}"
    )
    assert psnr >= PSNR_BOUND_DB and max_diff <= MAX_DIFF_BOUND and float_diff <= FLOAT_BOUND
    assert seams > SEAM_FLOOR
    with torch.no_grad(), one_thread():
        wan22_reference = tiny_vae(wan22_vae_config()).decode(latents(rows, 2, channels=48), return_dict=False)[0]
    wan22_diff = (results[0]["wan22"] - wan22_reference).abs().max().item()
    print(
        f"Wan 2.2 VAE structure, {world_size} ranks, 5 frames of {tuple(wan22_reference.shape[3:])}: "
        f"float max |diff| {wan22_diff:.3g}"
    )
    assert all(torch.equal(result["wan22"], results[0]["wan22"]) for result in results)
    assert wan22_diff <= FLOAT_BOUND


def _wan22_rank(rank, world_size, rows, latent_frames):
    import torch.distributed as dist

    from tilecast.runtime.models.families.wan_decode import decode_spatial_shard

    with torch.no_grad():
        return decode_spatial_shard(
            tiny_vae(wan22_vae_config()), latents(rows, latent_frames, channels=48), dist.group.WORLD
        )


def test_wan22_vae_decodes_in_parallel_on_four_ranks():
    """Wan 2.2's residual, patched VAE on 4 ranks (2 latent rows each, the fewest a rank takes), 9 frames."""
    rows, latent_frames = 8, 3
    with torch.no_grad(), one_thread():
        reference = tiny_vae(wan22_vae_config()).decode(latents(rows, latent_frames, channels=48), return_dict=False)[0]
    results = run_ranks(_wan22_rank, 4, rows, latent_frames, timeout=TIMEOUT, preload=PRELOAD)
    assert reference.shape == (1, 3, 9, 16 * rows, 16 * 6)
    assert all(torch.equal(result, results[0]) for result in results)
    diff = (results[0] - reference).abs().max().item()
    psnr, max_diff = psnr_and_max_diff(to_uint8(results[0]), to_uint8(reference))
    print(
        f"\nWan 2.2 VAE, 4 ranks x 2 latent rows, 9 frames: PSNR {psnr:.2f} dB, max diff {max_diff}/255, "
        f"float max |diff| {diff:.3g}"
    )
    assert diff <= FLOAT_BOUND and max_diff <= MAX_DIFF_BOUND


FAMILIES = {
    "wan2.1-t2v": ("wan", "WanT2VPipeline", 9),
    "wan2.2-i2v-a14b": ("wan22", "Wan22I2VPipeline", 9),
    "wan2.2-ti2v-5b": ("wan22", "Wan22TI2VPipeline", 9),
    "helios-base": ("helios", "HeliosT2VPipeline", 33),
}
"""Family -> (module under ``families``, class, frames): Wan2.1's VAE (Wan2.1, Wan2.2 A14B, Helios
Base) and Wan2.2's residual, patched VAE (TI2V 5B); Wan2.2 I2V A14B gets a first frame (its VAE
encodes it, then decodes in bands; T2V A14B is the same ``WanFamily`` install on the same VAE),
Helios decodes its one chunk of 33 frames
(Helios' pyramid rows install the same decode, in ``HeliosT2VPipeline.__init__``; measured on 2
ranks with the tiny Distilled's 4x VAE: 5.4e-7, not run in CI)."""


def _family(name: str):
    import importlib

    module, cls, _ = FAMILIES[name]
    return getattr(importlib.import_module(f"tilecast.runtime.models.families.{module}"), cls)


def _pipeline_rank(rank, world_size, cache, family):
    import torch.distributed as dist

    from tests.harness import make_context
    from tilecast.runtime.models.families import images
    from tilecast.runtime.models.families.wan_decode import ShardedWanDecode
    from tilecast.runtime.pipeline import WorkItem
    from tilecast.runtime.topology import Topology

    os.environ["TILECAST_CACHE"] = cache
    cls = _family(family)
    topology = Topology(num_gpus=world_size, ulysses_degree=world_size)
    groups = topology.groups(topology.build_mesh("cpu"))

    def load(vae):
        # The mesh's Ulysses axis makes the decode group of all ranks; the settings keep the DiT degrees
        # at 1 (the families refuse --ulysses-degree until they honour it).
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
        return cls.load(cls.builtin_name, ctx), ctx

    outputs = {}
    uploads = dict(zip(images.upload_names(1), [images.example_image(32, 64)])) if cls.min_images else {}
    for name, vae in (("serial", {}), ("parallel", {"use_parallel_decode": True})):
        pipe, ctx = load(vae)
        params = pipe.prepare(
            pipe.params_type(
                prompt="a red kite",
                width=32,
                height=64,
                num_frames=FAMILIES[family][2],
                seed=5,
                num_inference_steps=1,
                return_tensor=True,
            ),
            uploads,
        )
        item = WorkItem(job_id=name, params=params, uploads=uploads)
        outputs[name] = pipe.run([item], ctx)[0].tensors["video"]
        outputs[f"{name}_installed"] = isinstance(vars(pipe.pipe.vae).get("decode"), ShardedWanDecode)
        assert pipe.parallel_decode == outputs[f"{name}_installed"]
    return outputs


@pytest.mark.parametrize("family", list(FAMILIES))
def test_wan_pipeline_decodes_in_parallel_on_two_ranks(tiny_cache, family):
    """Each Wan VAE served with ``--vae-config.use-parallel-decode`` (honoured, not refused): the
    family's output on 2 ranks equals its serial decode within ``FLOAT_BOUND``."""
    _family(family).checkpoint.ensure(tiny_cache)  # built once here, not raced by the ranks
    results = run_ranks(_pipeline_rank, 2, str(tiny_cache), family, timeout=TIMEOUT, preload=PRELOAD)
    for rank, result in enumerate(results):
        assert result["parallel_installed"] and not result["serial_installed"], rank
        assert result["parallel"].shape == (FAMILIES[family][2], 3, 64, 32)
        assert torch.equal(result["parallel"], results[0]["parallel"]), f"rank {rank} differs from rank 0"
        diff = (result["parallel"] - result["serial"]).abs().max().item()
        print(f"\n{family} rank {rank}: parallel vs serial decode, max |diff| {diff:.3g} on [0, 1] frames")
        assert diff <= FLOAT_BOUND, (rank, diff)


# ---- one process -----------------------------------------------------------------------------


class _Ctx:
    def __init__(self, vae_settings, groups=None):
        from tilecast.runtime.config import VaeConfig

        self.rank, self.settings, self.groups = 0, SimpleNamespace(vae=VaeConfig(**vae_settings)), groups


def test_install_needs_a_decode_group_of_several_ranks_and_says_so(caplog):
    from tilecast.runtime.models.families import wan_decode

    vae = tiny_vae()
    with caplog.at_level(logging.WARNING, logger=wan_decode.__name__):
        assert not wan_decode.install(vae, _Ctx({"use_parallel_decode": True}))
    assert "decode" not in vars(vae)
    assert "use-parallel-decode has no effect" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=wan_decode.__name__):
        assert not wan_decode.install(vae, _Ctx({}))
    assert caplog.text == ""
    with pytest.raises(ValueError, match="parallel-decode-mode must be one of spatial_shard"):
        wan_decode.install(vae, _Ctx({"use_parallel_decode": True, "parallel_decode_mode": "frames"}))


def test_single_rank_decodes_serially_and_tiling_is_refused():
    from tilecast.runtime.models.families.wan_decode import decode_spatial_shard

    vae = tiny_vae()
    with torch.no_grad(), one_thread():
        assert torch.equal(decode_spatial_shard(vae, latents(8, 2), None), serial_decode(8, 2))
    vae.enable_tiling()
    with pytest.raises(ValueError, match="tiling"):
        decode_spatial_shard(vae, latents(8, 2), None)


def test_unknown_decoder_module_is_refused_and_nothing_stays_hooked():
    from tilecast.runtime.models.families.wan_decode import sharded_wan_decoder

    vae = tiny_vae()
    vae.decoder.up_blocks[0].extra = torch.nn.Conv3d(8, 8, kernel_size=3, padding=1)
    with pytest.raises(RuntimeError, match="up_blocks.0.extra"):
        with sharded_wan_decoder(vae.decoder, [4, 4], None):
            pass
    del vae.decoder.up_blocks[0].extra
    vae.decoder.up_blocks[0].resnets[0].conv1.padding_mode = "replicate"
    with pytest.raises(RuntimeError, match="replicate padding"):
        with sharded_wan_decoder(vae.decoder, [4, 4], None):
            pass
    assert hooks_left(vae) == []
