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
1.71 (3 ranks) in float, so the bound does see seams (``decode_harness.SEAM_FLOOR``; the checks
shared with the other families' decodes are ``tests/decode_harness.py``'s).

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
from types import SimpleNamespace

import pytest
import torch

from tests import decode_harness
from tests.decode_harness import MAX_DIFF_BOUND, TIMEOUT, Case
from tests.distributed import one_thread, run_ranks
from tests.test_spatial_shard import psnr_and_max_diff, to_uint8

FLOAT_BOUND = 1e-5
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


def _wan22_in_bands(group) -> dict:
    """Wan 2.2's VAE structure decoded in bands on the same ranks (2 latent frames)."""
    from tilecast.runtime.models.families.wan_decode import decode_spatial_shard

    return {"wan22": decode_spatial_shard(tiny_vae(wan22_vae_config()), latents(8, 2, channels=48), group)}


def _case(latent_frames: int) -> Case:
    return Case(
        label="Wan",
        module="wan_decode",
        tiny_vae=tiny_vae,
        latents=latents,
        changed=hooks_left,
        rows=8,
        latent_frames=latent_frames,
        scale=8,
        float_bound=FLOAT_BOUND,
        float64=False,
        preload=PRELOAD,
        extra=_wan22_in_bands,
    )


@pytest.mark.parametrize(("world_size", "latent_frames"), [(2, 3), (3, 5)])
def test_parallel_decode_matches_serial(world_size, latent_frames):
    results = decode_harness.check_parallel_decode(_case(latent_frames), world_size)
    assert results[0]["videos"][0].shape == (1, 3, 4 * (latent_frames - 1) + 1, 8 * 8, 48)
    with torch.no_grad(), one_thread():
        wan22_reference = tiny_vae(wan22_vae_config()).decode(latents(8, 2, channels=48), return_dict=False)[0]
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


@pytest.mark.parametrize("family", list(FAMILIES))
def test_wan_pipeline_decodes_in_parallel_on_two_ranks(tiny_cache, family):
    """Each Wan VAE served with ``--vae-config.use-parallel-decode`` (honoured, not refused): the
    family's output on 2 ranks equals its serial decode within ``FLOAT_BOUND``."""
    from tilecast.runtime.models.families.wan_decode import ShardedWanDecode

    request = dict(width=32, height=64, num_frames=FAMILIES[family][2], num_inference_steps=1)
    decode_harness.check_pipeline_decode(
        _family(family), ShardedWanDecode, tiny_cache, request, float_bound=FLOAT_BOUND, preload=PRELOAD
    )


# ---- one process -----------------------------------------------------------------------------


class _Ctx:
    def __init__(self, vae_settings, groups=None):
        from tilecast.runtime.config import VaeConfig

        self.rank, self.settings, self.groups = 0, SimpleNamespace(vae=VaeConfig(**vae_settings)), groups


def test_install_needs_a_decode_group_of_several_ranks_and_says_so(caplog):
    from tilecast.runtime.models.families import row_band_decode, wan_decode

    vae = tiny_vae()
    with caplog.at_level(logging.WARNING, logger=row_band_decode.__name__):
        assert not wan_decode.install(vae, _Ctx({"use_parallel_decode": True}))
    assert "decode" not in vars(vae)
    assert "use-parallel-decode has no effect" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=row_band_decode.__name__):
        assert not wan_decode.install(vae, _Ctx({}))
    assert caplog.text == ""
    with pytest.raises(ValueError, match="parallel-decode-mode must be one of spatial_shard"):
        wan_decode.install(vae, _Ctx({"use_parallel_decode": True, "parallel_decode_mode": "frames"}))


def test_single_rank_decodes_serially_and_tiling_is_refused():
    decode_harness.check_single_rank_and_tiling(_case(2), latent_frames=2)


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
