"""Wan2.1 T2V 1.3B text-to-video (``WanPipeline``) and its built-in tiny checkpoint ``tiny/wan2.1-t2v``.

The tiny checkpoint keeps the real structure: the causal 3D ``AutoencoderKLWan`` (8x spatial, 4x
temporal, 16 latent channels), a ``WanTransformer3DModel`` with 1x2x2 patches, cross-attention on a
``UMT5EncoderModel`` (the config of ``tiny/flux``'s T5 encoder) with a ``T5TokenizerFast`` built
offline, and the flow-matching UniPC scheduler with ``flow_shift=3`` that the released 1.3B
checkpoint ships.

``num_frames`` must be ``4k + 1`` (the VAE's temporal factor; diffusers would silently round
otherwise). ``guidance_scale`` above 1 runs classifier-free guidance with each request's
``negative_prompt`` (default ``""``, as diffusers does).

With ``--vae-config.use-parallel-decode`` and a decode group of several ranks, the VAE decode is
split by rows across the group (``wan_decode``).
"""

from __future__ import annotations

import logging

from tilecast.runtime.models.families import common, flux, tokenizers
from tilecast.runtime.models.families.common import DiffusersBatchPipeline, T2VParams, TinyCheckpoint

logger = logging.getLogger(__name__)

TEXT_DIM = flux.TEXT_DIM
"""``d_model`` of the tiny UMT5 encoder, tiny FLUX's T5 (the transformer's ``text_dim``)."""
MAX_FRAMES = 257
"""Longest video a request may ask for."""


def tiny_vae_config() -> dict:
    """The tiny causal 3D VAE's config (``AutoencoderKLWan``; Qwen-Image's ``AutoencoderKLQwenImage``
    has the same structure)."""
    return dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1, temperal_downsample=[False, True, True])


def build_tiny_wan():
    """The tiny ``WanPipeline`` in memory (call under a seed; ``TinyCheckpoint`` does)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = tokenizers.t5_tokenizer()
    t5 = flux.flux_configs(flux.TINY_OVERRIDES)["text_encoder_2"]  # UMT5 has T5-v1.1's structure
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=tokenizers.T5_VOCAB_SIZE, **t5)).eval()
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        **common.TINY_DIT,
        in_channels=16,
        out_channels=16,
        text_dim=TEXT_DIM,
        freq_dim=32,
        ffn_dim=64,
        rope_max_seq_len=1024,
    ).eval()
    vae = AutoencoderKLWan(**tiny_vae_config()).eval()
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=3.0,
        num_train_timesteps=1000,
    )
    return WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=transformer
    )


TINY_WAN = TinyCheckpoint(name="tiny-wan2.1-t2v-v1", seed=20250704, build=build_tiny_wan, ref=f"{__name__}:TINY_WAN")


class WanT2VPipeline(DiffusersBatchPipeline):
    """Wan2.1 T2V; a merged batch is one ``WanPipeline`` call (see ``families.common``)."""

    family = "wan2.1-t2v"
    task = "t2v"
    num_frames_rule = (4, 1)
    params_type = T2VParams
    diffusers_class = "WanPipeline"
    checkpoint = TINY_WAN
    builtin_name = "tiny/wan2.1-t2v"
    cp_plan = "diffusers:WanTransformer3DModel._cp_plan"
    size_multiple = 16
    default_guidance = 5.0
    max_sequence_length = 64
    output_kind = "video"
    per_request_fields = DiffusersBatchPipeline.per_request_fields + ("fps",)
    """``fps`` only stamps the written file, so requests with different rates still merge."""
    honoured_settings = DiffusersBatchPipeline.honoured_settings | {
        "vae.use_parallel_decode",
        "vae.parallel_decode_mode",
    }
    """Also the parallel decode settings, which ``wan_decode.install`` reads; the other ``--vae-config.*``
    settings (K6 SR's tiles and K-VAE decoder) are refused."""

    def __init__(self, pipe, ctx) -> None:
        from tilecast.runtime.models.families import wan_decode  # imports diffusers' Wan VAE module

        super().__init__(pipe, ctx)
        self.parallel_decode = wan_decode.install(pipe.vae, ctx)
        """Whether the VAE decode is split by rows across the decode group (``wan_decode``)."""

    def validate(self, params) -> None:
        if not 1 <= params.num_frames <= MAX_FRAMES or (params.num_frames - 1) % 4:
            raise ValueError(f"num_frames must be 4k+1 in 1..{MAX_FRAMES} for {self.family}, got {params.num_frames}")
        if not 1 <= params.fps <= 120:
            raise ValueError(f"fps must be in 1..120, got {params.fps}")

    def call_kwargs(self, params) -> dict:
        return {**super().call_kwargs(params), "num_frames": params.num_frames}
