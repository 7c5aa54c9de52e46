"""HunyuanVideo parallel VAE decode (``runtime/models/families/hunyuan_decode.py``) on 2 and 4 gloo ranks.

The tiny checkpoint's ``AutoencoderKLHunyuanVideo`` (``hunyuan_video.build_tiny_hunyuan_video``'s
config, seeded weights) decodes 8 latent rows x 4 cols (64 x 32 px). 2 ranks split the rows 4/4,
4 ranks 2/2/2/2 (the fewest rows a rank takes), over 5 latent frames (17 frames): more than 4, so
diffusers decodes two overlapping temporal tiles and blends them (``_temporal_tiled_decode``). The
reference is diffusers' serial ``vae.decode`` of the same latents in the test process, on one
thread like the ranks. Frames compare as uint8 (what is written) and as floats:

    bound: PSNR >= 60 dB, max |difference| <= 1/255 on uint8 frames, float max |diff| <= 2e-5;
    the same decode in float64 within 1e-12 of serial float64.

Measured (one thread, this machine; ``pytest -s`` prints them): 2 ranks: PSNR 90.5 dB, max diff
1/255, float max |diff| 7.6e-6; 4 ranks: 89.9 dB, 1/255, 7.3e-6; float64 1.7e-14 / 1.8e-14. Not
bit-exact: the convolutions run on band shapes and the group norms combine their statistics from
the bands, which moves fp rounding only, as the float64 run shows (the arithmetic is the serial
one). The fp32 bound has room over the measured 7.6e-6 because this VAE's outputs are not clamped
(random weights: values up to 2.8) and serial fp32 decode is itself 7.9e-6 away from the float64
decode. Decoding the bands *without* the sharding (independent bands: replicate padding at the
band edges, each band's own norm statistics, attention within the band) is off by 3.05 (2 ranks)
and 2.84 (4 ranks), so the bound does see seams (``SEAM_FLOOR``; these checks are ``tests/decode_harness.py``'s,
shared with the other families' decodes).

The pipeline test serves ``HunyuanVideoT2VPipeline`` on 2 ranks whose decode group spans both
(Ulysses degree 2: one DP replica of 2 ranks; the DiT itself runs replicated here) with
``--vae-config.use-parallel-decode`` and compares its frames with the same rank's serial pipeline
(measured: max |diff| 2.2e-6 on the ``[0, 1]`` frames, 9 frames of 64 x 32 px).
"""

from __future__ import annotations

import pytest
import torch

from tests import decode_harness
from tests.decode_harness import FLOAT64_BOUND, SEAM_FLOOR, Case

FLOAT_BOUND = 2e-5
PRELOAD = ("diffusers.models.autoencoders.autoencoder_kl_hunyuan_video",)
ROWS, COLS, LATENT_FRAMES = 8, 4, 5


def tiny_vae():
    """The tiny checkpoint's ``AutoencoderKLHunyuanVideo`` config with seeded weights."""
    from diffusers import AutoencoderKLHunyuanVideo

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        vae = AutoencoderKLHunyuanVideo(
            latent_channels=16, block_out_channels=(8, 16, 16, 16), layers_per_block=1, norm_num_groups=8
        ).eval()
        for module in vae.modules():  # GroupNorm's fresh weights are ones / zeros: make the affine part count
            if isinstance(module, torch.nn.GroupNorm):
                module.weight.data.uniform_(0.5, 1.5)
                module.bias.data.uniform_(-0.2, 0.2)
    return vae


def latents(rows: int = ROWS, latent_frames: int = LATENT_FRAMES) -> torch.Tensor:
    return torch.randn(1, 16, latent_frames, rows, COLS, generator=torch.Generator().manual_seed(3))


def changed(vae) -> list[str]:
    """Decoder modules left with a swapped forward or a changed row padding."""
    from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import HunyuanVideoCausalConv3d

    left = []
    for name, module in vae.decoder.named_modules():
        if "forward" in vars(module):
            left.append(name)
        elif isinstance(module, HunyuanVideoCausalConv3d) and module.conv.kernel_size[1] == 3:
            if module.time_causal_padding[2:4] != (1, 1):
                left.append(name)
    return left


CASE = Case(
    label="HunyuanVideo",
    module="hunyuan_decode",
    tiny_vae=tiny_vae,
    latents=latents,
    changed=changed,
    rows=ROWS,
    latent_frames=LATENT_FRAMES,
    scale=8,
    float_bound=FLOAT_BOUND,
    preload=PRELOAD,
)


@pytest.mark.parametrize("world_size", [2, 4])
def test_parallel_decode_matches_serial(world_size):
    results = decode_harness.check_parallel_decode(CASE, world_size)
    assert results[0]["videos"][0].shape == (1, 3, 4 * (LATENT_FRAMES - 1) + 1, 8 * ROWS, 8 * COLS)


def test_hunyuan_video_pipeline_decodes_in_parallel_on_two_ranks(tiny_cache):
    from tilecast.runtime.models.families.hunyuan_decode import ShardedHunyuanDecode
    from tilecast.runtime.models.families.hunyuan_video import HunyuanVideoT2VPipeline

    request = dict(width=32, height=64, num_frames=9, num_inference_steps=1)
    decode_harness.check_pipeline_decode(
        HunyuanVideoT2VPipeline, ShardedHunyuanDecode, tiny_cache, request, float_bound=FLOAT_BOUND, preload=PRELOAD
    )


# ---- one process -----------------------------------------------------------------------------


def test_single_rank_decodes_serially_and_tiling_is_refused():
    decode_harness.check_single_rank_and_tiling(CASE, latent_frames=2)


def test_unknown_decoder_module_is_refused_and_nothing_stays_changed():
    from tilecast.runtime.models.families.hunyuan_decode import sharded_hunyuan_decoder

    vae = tiny_vae()
    vae.decoder.up_blocks[0].extra = torch.nn.Conv3d(8, 8, kernel_size=3, padding=1)
    with pytest.raises(RuntimeError, match="up_blocks.0.extra"):
        with sharded_hunyuan_decoder(vae.decoder, [4, 4], None):
            pass
    del vae.decoder.up_blocks[0].extra
    vae.decoder.up_blocks[0].resnets[0].conv1.pad_mode = "circular"
    with pytest.raises(RuntimeError, match="circular padding"):
        with sharded_hunyuan_decoder(vae.decoder, [4, 4], None):
            pass
    assert changed(vae) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_norm_forward_matches_pytorch_in_chunks(dtype, monkeypatch):
    """One rank: the sharded group norm is ``nn.GroupNorm`` (fp32 within rounding; bf16 as PyTorch
    rounds it), also when the groups are normalised a few at a time (``NORM_CHUNK_ELEMENTS``)."""
    from tilecast.runtime.models.families import hunyuan_decode

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        norm = torch.nn.GroupNorm(4, 16).to(dtype)
        norm.weight.data.uniform_(0.5, 1.5)
        norm.bias.data.uniform_(-1.0, 1.0)
        x = (torch.randn(2, 16, 3, 5, 6) * 3 + 1).to(dtype)
    forward = hunyuan_decode._group_norm_forward(None)
    whole = forward(norm, x)
    monkeypatch.setattr(hunyuan_decode, "NORM_CHUNK_ELEMENTS", 200)  # one group of 2 x 360 elements a chunk
    assert len(hunyuan_decode._group_chunks(x.reshape(2, 4, -1))) == 4
    assert torch.equal(forward(norm, x), whole)
    assert whole.dtype == dtype
    assert (whole.double() - norm(x).double()).abs().max().item() <= (1e-6 if dtype == torch.float32 else 0.0)


def test_band_attention_is_the_mid_block_attention_of_those_rows():
    """One process, float64: the queries of a band of rows (with the whole map's keys and norm)
    give the rows of diffusers' attention over the whole map (measured: equal); the frame-causal
    mask counts."""
    from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import prepare_causal_attention_mask

    from tilecast.runtime.models.families.hunyuan_decode import _band_attention

    attn = tiny_vae().double().decoder.mid_block.attentions[0]
    x_BCTHW = torch.randn(1, 16, 3, 6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    _, _, frames, height, width = x_BCTHW.shape
    tokens = x_BCTHW.permute(0, 2, 3, 4, 1).flatten(1, 3)
    mask = prepare_causal_attention_mask(frames, height * width, tokens.dtype, tokens.device, batch_size=1)
    with torch.no_grad():
        whole = attn(tokens, attention_mask=mask).unflatten(1, (frames, height, width)).permute(0, 4, 1, 2, 3)
        unmasked = attn(tokens).unflatten(1, (frames, height, width)).permute(0, 4, 1, 2, 3)
        for start, rows in ((0, 6), (0, 2), (2, 3), (5, 1)):
            band = _band_attention(attn, x_BCTHW, start, rows)
            assert (band - whole[:, :, :, start : start + rows]).abs().max() <= FLOAT64_BOUND, (start, rows)
    assert (unmasked - whole).abs().max() > SEAM_FLOOR
