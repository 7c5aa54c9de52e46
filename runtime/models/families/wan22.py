"""Wan2.2: T2V A14B and I2V A14B (two denoising experts) and TI2V 5B (text- or image-to-video), with
the built-in tiny checkpoints ``tiny/wan2.2-t2v-a14b``, ``tiny/wan2.2-i2v-a14b`` and ``tiny/wan2.2-ti2v-5b``.

A14B (``WanPipeline`` / ``WanImageToVideoPipeline`` with ``transformer_2`` and ``boundary_ratio``):
``transformer`` denoises the high-noise steps (timestep >= ``boundary_ratio`` x 1000),
``transformer_2`` the rest; the tiny checkpoints keep two separately seeded tiny
``WanTransformer3DModel`` experts and the released boundaries (0.875 T2V, 0.9 I2V), with Wan2.1's
VAE, UMT5 encoder and offline tokenizer. The I2V experts take 36 channels (noise, first-frame mask,
image latents) and no CLIP image encoder (Wan2.2 I2V has none). Both experts get the
sequence-parallel plan; ``--cpu-offload-components transformer_2`` keeps the idle expert in host
memory (``wan.ExpertOffload``). ``guidance_scale_2`` is the low-noise expert's guidance.

TI2V 5B (``WanPipeline`` with ``expand_timesteps``): Wan2.2's residual VAE (16x spatial with its 2x2
patchify, 48 latent channels; tiny widths here) and a 48-channel transformer. Without an image it
is text-to-video (``WanPipeline``); with one image it is image-to-video through diffusers'
``WanImageToVideoPipeline`` over the same components (the first latent frame is the image's and
keeps timestep 0, ``expand_timesteps``), as diffusers' TI2V example loads it. Sizes are multiples
of 32. ``--vae-config.use-parallel-decode`` splits the residual VAE's decode by rows as it does
Wan2.1's (``wan_decode``: the ``DupUp3D`` shortcuts and the final unpatchify are row-local).

Defaults (Wan-AI cards): T2V A14B 1280 x 720, 81 frames at 16 fps, 40 steps, guidance 4.0 / 3.0 (high /
low noise); I2V A14B 1280 x 720 (``max_area`` of the image's aspect ratio), 81 frames, 40 steps, 3.5 /
3.5; TI2V 5B 1280 x 704, 121 frames at 24 fps, 50 steps, guidance 5.0; the schedulers' own flow shift
(12, 5, 5). FastVideo's sampling configs (``configs/sample/wan.py``) agree.
Distilled releases (``wan_fewstep``): TurboWan2.2 I2V A14B (TurboDiffusion's rCM, 4 steps from
sigma_max 200, no CFG; its SLA attention served dense only behind ``--allow-dense-attention-fallback``)
and FastWan2.2 TI2V 5B Full Attn (FastVideo's DMD at 1000/757/522, no CFG; dense attention as released).
"""

from __future__ import annotations

import logging
from typing import Any

from tilecast.runtime.models.families import common, images, wan, wan_i2v
from tilecast.runtime.models.families.common import TinyCheckpoint
from tilecast.runtime.models.families.wan import WanDefaults, WanFamily, WanI2VParams
from tilecast.runtime.models.families.wan_fewstep import dmd, rcm
from tilecast.runtime.models.families.wan_i2v import WanI2VPipeline
from tilecast.runtime.pipeline import WorkItem

logger = logging.getLogger(__name__)

T2V_BOUNDARY = 0.875
"""Wan2.2 T2V A14B's ``boundary_ratio`` (model_index.json)."""
I2V_BOUNDARY = 0.9
"""Wan2.2 I2V A14B's ``boundary_ratio``."""
TI2V_CHANNELS = 48
"""Latent channels of Wan2.2's residual VAE (the TI2V transformer's in/out channels)."""


def tiny_t2v_transformer(channels: int = 16):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        **common.TINY_DIT,
        in_channels=channels,
        out_channels=channels,
        text_dim=wan.TEXT_DIM,
        freq_dim=32,
        ffn_dim=64,
        rope_max_seq_len=1024,
    ).eval()


def build_tiny_wan22_t2v():
    """The tiny two-expert ``WanPipeline`` (call under a seed; ``TinyCheckpoint`` does)."""
    from diffusers import WanPipeline

    t2v = wan.build_tiny_wan()
    return WanPipeline(
        tokenizer=t2v.tokenizer,
        text_encoder=t2v.text_encoder,
        vae=t2v.vae,
        scheduler=t2v.scheduler,
        transformer=t2v.transformer,
        transformer_2=tiny_t2v_transformer(),
        boundary_ratio=T2V_BOUNDARY,
    )


def build_tiny_wan22_i2v():
    """The tiny two-expert ``WanImageToVideoPipeline`` without an image encoder."""
    from diffusers import WanImageToVideoPipeline

    t2v = wan.build_tiny_wan()
    return WanImageToVideoPipeline(
        tokenizer=t2v.tokenizer,
        text_encoder=t2v.text_encoder,
        vae=t2v.vae,
        scheduler=t2v.scheduler,
        transformer=wan_i2v.tiny_i2v_transformer(image_dim=None),
        transformer_2=wan_i2v.tiny_i2v_transformer(image_dim=None),
        boundary_ratio=I2V_BOUNDARY,
    )


def tiny_wan22_vae_config() -> dict:
    """Wan2.2's residual VAE (``AutoencoderKLWan`` with ``is_residual``, 2x2 patchify of 12 channels,
    16x spatial, 48 latent channels) at tiny widths (released: base 160, decoder base 256)."""
    return dict(
        base_dim=8,
        decoder_base_dim=16,
        z_dim=TI2V_CHANNELS,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
        latents_mean=[0.0] * TI2V_CHANNELS,
        latents_std=[1.0] * TI2V_CHANNELS,
    )


def build_tiny_wan22_ti2v():
    """The tiny TI2V ``WanPipeline`` (``expand_timesteps``)."""
    from diffusers import AutoencoderKLWan, WanPipeline

    t2v = wan.build_tiny_wan()
    return WanPipeline(
        tokenizer=t2v.tokenizer,
        text_encoder=t2v.text_encoder,
        vae=AutoencoderKLWan(**tiny_wan22_vae_config()).eval(),
        scheduler=t2v.scheduler,
        transformer=tiny_t2v_transformer(TI2V_CHANNELS),
        expand_timesteps=True,
    )


TINY_WAN22_T2V = TinyCheckpoint(
    name="tiny-wan2.2-t2v-a14b-v1", seed=20250802, build=build_tiny_wan22_t2v, ref=f"{__name__}:TINY_WAN22_T2V"
)
TINY_WAN22_I2V = TinyCheckpoint(
    name="tiny-wan2.2-i2v-a14b-v1", seed=20250803, build=build_tiny_wan22_i2v, ref=f"{__name__}:TINY_WAN22_I2V"
)
TINY_WAN22_TI2V = TinyCheckpoint(
    name="tiny-wan2.2-ti2v-5b-v1", seed=20250804, build=build_tiny_wan22_ti2v, ref=f"{__name__}:TINY_WAN22_TI2V"
)


class Wan22T2VPipeline(WanFamily):
    """Wan2.2 T2V A14B: two experts in one ``WanPipeline`` call."""

    family = "wan2.2-t2v-a14b"
    task = "t2v"
    diffusers_class = "WanPipeline"
    checkpoint = TINY_WAN22_T2V
    builtin_name = "tiny/wan2.2-t2v-a14b"
    variants = {
        "Wan2.2-T2V-A14B": WanDefaults(width=1280, height=720, num_frames=81, steps=40, guidance=4.0, guidance_2=3.0),
    }
    fallback_variant = "Wan2.2-T2V-A14B"


class Wan22I2VPipeline(WanI2VPipeline):
    """Wan2.2 I2V A14B (and TurboWan2.2 I2V A14B): two experts, no CLIP image encoder."""

    family = "wan2.2-i2v-a14b"
    checkpoint = TINY_WAN22_I2V
    builtin_name = "tiny/wan2.2-i2v-a14b"
    max_images = 1
    variants = {
        "Wan2.2-I2V-A14B": WanDefaults(width=1280, height=720, num_frames=81, steps=40, guidance=3.5, guidance_2=3.5),
        # TurboDiffusion (wan2.2_i2v_infer.py): rCM from sigma_max 200, experts switched at 0.9, SLA
        "TurboWan2.2-I2V-A14B": WanDefaults(
            width=1280,
            height=720,
            num_frames=81,
            steps=4,
            guidance=1.0,
            guidance_2=1.0,
            few_step=rcm(sigma_max=200.0),
            sparse_attention=wan.TURBO_SLA,
        ),
    }
    fallback_variant = "Wan2.2-I2V-A14B"
    max_sequence_length = wan.WanFamily.max_sequence_length
    """No image context (no CLIP): the tiny text length of the other Wan families."""


class WanTI2VParams(WanI2VParams, forbid_unknown_fields=True, kw_only=True):
    """A Wan2.2 TI2V request: text-to-video, or image-to-video with one image; 24 fps by default."""

    fps: int = 24
    """Frame rate of the written video (the TI2V 5B card's 24)."""


class Wan22TI2VPipeline(WanFamily):
    """Wan2.2 TI2V 5B (and FastWan2.2 TI2V 5B Full Attn): text-to-video without an image,
    image-to-video with one (see the module docstring)."""

    family = "wan2.2-ti2v-5b"
    task = "ti2v"
    params_type = WanTI2VParams
    upload_fields = ("image",)
    diffusers_class = "WanPipeline"
    checkpoint = TINY_WAN22_TI2V
    builtin_name = "tiny/wan2.2-ti2v-5b"
    size_multiple = 32
    min_images = 0
    max_images = 1
    batch_shares_images = True
    variants = {
        "Wan2.2-TI2V-5B": WanDefaults(width=1280, height=704, num_frames=121, fps=24, steps=50, guidance=5.0),
        "FastWan2.2-TI2V-5B-FullAttn": WanDefaults(  # FastVideo: DMD at 1000/757/522 (shift 5), dense attention
            width=1280,
            height=704,
            num_frames=121,
            fps=24,
            steps=3,
            guidance=1.0,
            few_step=dmd(shift=5.0),
        ),
    }
    fallback_variant = "Wan2.2-TI2V-5B"

    def __init__(self, pipe, ctx) -> None:
        from diffusers import WanImageToVideoPipeline

        super().__init__(pipe, ctx)
        self.i2v = WanImageToVideoPipeline(
            tokenizer=pipe.tokenizer,
            text_encoder=pipe.text_encoder,
            vae=pipe.vae,
            scheduler=pipe.scheduler,
            transformer=pipe.transformer,
            transformer_2=getattr(pipe, "transformer_2", None),
            boundary_ratio=pipe.config.boundary_ratio,
            expand_timesteps=True,
        )
        """Diffusers' image-to-video call over the same components (requests with an image)."""
        self.i2v.set_progress_bar_config(disable=True)

    def image_kwargs(self, items: list[WorkItem]) -> dict[str, Any]:
        frames = images.load_images(items[0].uploads)
        return {"image": frames[0]} if frames else {}

    def pipe_for(self, items: list[WorkItem]) -> Any:
        if not items[0].params.image_sizes:
            return self.pipe
        self.i2v.scheduler = self.pipe.scheduler  # a request's flow_shift swaps the scheduler for the batch
        return self.i2v
