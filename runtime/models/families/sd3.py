"""Stable Diffusion 3 / 3.5 text-to-image (``StableDiffusion3Pipeline``) and its built-in tiny checkpoint ``tiny/sd3``.

The tiny checkpoint keeps SD3 Medium's structure with every size shrunk: a 16-channel, 8x
``AutoencoderKL`` without quant convs (``tiny/flux``'s VAE config with SD3's scaling and shift
factors), an MMDiT ``SD3Transformer2DModel`` on 2x2 patches with a learned, cropped positional
embedding (two joint blocks, the last one updating only the image stream), two
``CLIPTextModelWithProjection`` encoders (CLIP ViT-L/14 and OpenCLIP ViT-bigG/14 in the release;
their penultimate hidden states, concatenated and zero-padded to T5's width, precede the T5
tokens, and their pooled projections, concatenated, are the pooled embedding) and a
``T5EncoderModel`` (T5-v1.1-XXL in the release), with offline character-level tokenizers, and
SD3's flow-matching Euler scheduler (shift 3.0, no dynamic shifting).

Defaults follow the Stable Diffusion 3 Medium model card (stabilityai/stable-diffusion-3-medium):
28 steps at ``guidance_scale`` 7.0, which are also ``StableDiffusion3Pipeline``'s own defaults. The
3.5 checkpoints are served by the same class (Large's card: 28 steps at 3.5; Medium's: 40 at 4.5):
pass ``num_inference_steps`` / ``guidance_scale`` for those. ``guidance_scale`` above 1 runs
classifier-free guidance with each request's ``negative_prompt`` (default ``""``, as diffusers
does), fed to all three encoders.

Ranks: diffusers 0.42 declares no ``_cp_plan`` for ``SD3Transformer2DModel``, so ``cp_plan`` is
None and the family runs replicated only; the Ulysses and Ring degrees are refused at start-up.
"""

from __future__ import annotations

import logging

from tilecast.runtime.models.families import common, flux, tokenizers
from tilecast.runtime.models.families.common import DiffusersBatchPipeline, T2IParams, TinyCheckpoint

logger = logging.getLogger(__name__)

CLIP_DIM = 16
"""Hidden and projection size of each tiny CLIP encoder (two of them: the pooled embedding is 2x this)."""
TEXT_DIM = flux.TEXT_DIM
"""Hidden size of the tiny T5 encoder (the transformer's ``joint_attention_dim``; it holds both CLIPs' widths)."""
POS_EMBED_MAX_SIZE = 96
"""SD3's released positional-embedding grid (patches per side): 96 x 2 x 8 = 1536 pixels at most."""


def build_tiny_sd3():
    """The tiny ``StableDiffusion3Pipeline`` in memory (call under a seed; ``TinyCheckpoint`` does)."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    def clip_encoder(tokenizer):
        config = CLIPTextConfig(
            vocab_size=tokenizers.CLIP_VOCAB_SIZE,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            hidden_size=CLIP_DIM,
            intermediate_size=32,
            projection_dim=CLIP_DIM,
            num_hidden_layers=2,  # SD3 reads the penultimate hidden state: one real layer below the last
            num_attention_heads=2,
            max_position_embeddings=77,
        )
        return CLIPTextModelWithProjection(config).eval()

    clip_tok, clip_tok_2 = tokenizers.clip_tokenizer(), tokenizers.clip_tokenizer()
    t5_tok = tokenizers.t5_tokenizer()
    clip, clip_2 = clip_encoder(clip_tok), clip_encoder(clip_tok_2)
    t5_config = flux.flux_configs(flux.TINY_OVERRIDES)["text_encoder_2"]  # T5-v1.1-XXL, as FLUX's
    t5 = T5EncoderModel(T5Config(vocab_size=tokenizers.T5_VOCAB_SIZE, **t5_config)).eval()
    transformer = SD3Transformer2DModel(  # 2x2 patches of 16 latent channels: the class's defaults, as released
        sample_size=8,
        **{**common.TINY_DIT, "num_layers": 2},  # a full joint block, then the context-pre-only last one
        joint_attention_dim=TEXT_DIM,
        caption_projection_dim=common.TINY_DIT["num_attention_heads"] * common.TINY_DIT["attention_head_dim"],
        pooled_projection_dim=2 * CLIP_DIM,
        pos_embed_max_size=POS_EMBED_MAX_SIZE,
    ).eval()
    vae_config = {**flux.flux_configs(flux.TINY_OVERRIDES)["vae"], "scaling_factor": 1.5305, "shift_factor": 0.0609}
    return StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=AutoencoderKL(**vae_config).eval(),
        text_encoder=clip,
        tokenizer=clip_tok,
        text_encoder_2=clip_2,
        tokenizer_2=clip_tok_2,
        text_encoder_3=t5,
        tokenizer_3=t5_tok,
        transformer=transformer,
    )


TINY_SD3 = TinyCheckpoint(name="tiny-sd3-v1", seed=20250704, build=build_tiny_sd3, ref=f"{__name__}:TINY_SD3")


class SD3T2IPipeline(DiffusersBatchPipeline):
    """Stable Diffusion 3 / 3.5 T2I; a merged batch is one ``StableDiffusion3Pipeline`` call (see ``families.common``)."""

    family = "sd3"
    task = "t2i"
    params_type = T2IParams
    diffusers_class = "StableDiffusion3Pipeline"
    checkpoint = TINY_SD3
    builtin_name = "tiny/sd3"
    model_id_hints = ("stable-diffusion-3-medium", "stable-diffusion-3.5-medium", "stable-diffusion-3.5-large")
    default_steps = 28
    default_guidance = 7.0
    max_sequence_length = 256
    """``StableDiffusion3Pipeline``'s T5 length (diffusers' default; at most 512)."""

    @classmethod
    def install_fast_paths(cls, pipe, settings) -> None:
        """``--compile``: diffusers' regional compilation of the joint blocks (``SD3Transformer2DModel``
        declares no ``_repeated_blocks`` in diffusers 0.42; they are named here)."""
        pipe.transformer._repeated_blocks = ["JointTransformerBlock"]
        super().install_fast_paths(pipe, settings)

    def validate(self, params) -> None:
        """The positional embedding is cropped from a fixed grid: larger images have no positions."""
        config = self.pipe.transformer.config
        largest = config.pos_embed_max_size * config.patch_size * self.pipe.vae_scale_factor
        for field in ("width", "height"):
            if getattr(params, field) > largest:
                raise ValueError(
                    f"{field} must be at most {largest} for {self.family} (its positional embedding covers "
                    f"{config.pos_embed_max_size} patches per side), got {getattr(params, field)}"
                )
