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
edges) is off by 1.73, so the bound does see seams (``SEAM_FLOOR``; these checks are
``tests/decode_harness.py``'s, shared with the other families' decodes).

The pipeline test serves ``LTX2T2VPipeline`` on 2 ranks whose decode group spans both (Ulysses
degree 2: one DP replica of 2 ranks; the DiT itself runs replicated here) with
``--vae-config.use-parallel-decode`` and compares its frames (and its soundtrack, decoded
replicated) with the same rank's serial pipeline (measured: max |diff| 2.4e-7 on the ``[0, 1]``
frames, 9 frames of 128 x 64 px, 2 latent rows per rank; the audio is equal).
"""

from __future__ import annotations

import pytest
import torch

from tests import decode_harness
from tests.decode_harness import Case
from tilecast.runtime.models.families import ltx2

FLOAT_BOUND = 1e-5
PRELOAD = ("diffusers.models.autoencoders.autoencoder_kl_ltx2",)
ROWS, COLS, LATENT_FRAMES = 8, 2, 2
CHANNELS = ltx2.TINY_VAE_CONFIG["latent_channels"]


def tiny_vae():
    """The tiny checkpoint's ``AutoencoderKLLTX2Video`` config with seeded weights."""
    from diffusers import AutoencoderKLLTX2Video

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoencoderKLLTX2Video(**ltx2.TINY_VAE_CONFIG).eval()


def latents(rows: int = ROWS, latent_frames: int = LATENT_FRAMES) -> torch.Tensor:
    return torch.randn(1, CHANNELS, latent_frames, rows, COLS, generator=torch.Generator().manual_seed(3))


def changed(vae) -> list[str]:
    """Decoder modules left with a swapped forward."""
    return [name for name, module in vae.decoder.named_modules() if "forward" in vars(module)]


CASE = Case(
    label="LTX-2",
    module="ltx2_decode",
    tiny_vae=tiny_vae,
    latents=latents,
    changed=changed,
    rows=ROWS,
    latent_frames=LATENT_FRAMES,
    scale=32,
    float_bound=FLOAT_BOUND,
    short_frames=1,
    preload=PRELOAD,
)


@pytest.mark.parametrize("world_size", [2, 4])
def test_parallel_decode_matches_serial(world_size):
    results = decode_harness.check_parallel_decode(CASE, world_size)
    assert results[0]["videos"][0].shape == (1, 3, 8 * (LATENT_FRAMES - 1) + 1, 32 * ROWS, 32 * COLS)


def test_ltx2_pipeline_decodes_in_parallel_on_two_ranks(tiny_cache):
    from tilecast.runtime.models.families.ltx2 import LTX2T2VPipeline
    from tilecast.runtime.models.families.ltx2_decode import ShardedLTX2Decode

    # two steps: one is NaN from the released scheduler's shift_terminal
    request = dict(width=64, height=128, num_frames=9, num_inference_steps=2)
    decode_harness.check_pipeline_decode(
        LTX2T2VPipeline, ShardedLTX2Decode, tiny_cache, request, float_bound=FLOAT_BOUND, preload=PRELOAD
    )


# ---- one process -----------------------------------------------------------------------------


def test_single_rank_decodes_serially_and_tiling_is_refused():
    decode_harness.check_single_rank_and_tiling(CASE, latent_frames=1)


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
