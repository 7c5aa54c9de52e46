"""GLM-Image text-to-image (``GlmImagePipeline``) and its built-in tiny checkpoint ``tiny/glm-image``.

GLM-Image is a hybrid: an autoregressive vision-language model (``GlmImageForConditionalGeneration``,
9B in the release, from GLM-4-9B) samples the picture as discrete image tokens, first a preview
grid of about 16x16 and then one token per 32x32 pixels; those prior tokens, upsampled 2x, condition a
single-stream diffusion transformer (``GlmImageTransformer2DModel``, one token per 2x2 latent
patch of a 16-channel, 8x ``AutoencoderKL``) that denoises the latents, together with glyph
embeddings: a ByT5 ``T5EncoderModel`` encodes the text quoted in the prompt ('...', "...", “...”,
「...」) for text rendering.

The tiny checkpoint keeps every component and how they connect, each size shrunk: the AR model's
text tower (two layers, 3D rotary positions split 4/2/2), vision tower and VQ codebook; its
processor (``GlmImageProcessor``: the PIL image processor and an offline byte-level tokenizer laid
out as the released one, image-token ids first, ``families.tokenizers.glm_image_tokenizer``); a
one-layer T5 glyph encoder with the offline ``ByT5Tokenizer``; a one-block DiT; ``tiny/flux``'s
VAE config with per-channel latent statistics (which the pipeline reads). Two sizes tie the parts
together: the AR head's ``vision_vocab_size`` equals the DiT's prior codebook (so every sampled
token indexes the DiT's prior embedding), and the image start / end ids sit just past it, so the
sampler never emits the end token and always produces the full grid. The AR samples as released
(its ``generation_config``: temperature 0.9, top-p 0.75). The scheduler is the flow-matching Euler
one with the resolution-dependent shift the pipeline computes (base 0.25, max 0.75 at 256 tokens).

Defaults follow the GLM-Image model card (zai-org/GLM-Image): 30 steps at ``guidance_scale`` 1.5
(diffusers' own default is 50 steps), 1024x1024 in its serving example; width and height must be
multiples of 32 (one AR token per 32x32 pixels). Above 1, classifier-free guidance runs the DiT a
second time with the prior tokens dropped and the glyph text empty: ``GlmImagePipeline`` takes no
negative prompt, so ``negative_prompt`` is refused.

Batching: none (``max_batch_size = 1``). ``GlmImagePipeline`` samples the prior tokens of a whole
batch in one ``generate`` call whose random stream is seeded from the first request's generator
only, over left-padded prompts, and pads the glyph embeddings with unmasked zeros: a request's
picture depends on what it was batched with (measured in ``tests/test_families.py``,
``test_glm_image_serves_singletons_because_merging_changes_each_request``; diffusers' own tests
skip its batch tests for the same reason). The pipeline also reseeds torch's global generator
(``torch.manual_seed``) from the request's seed before sampling.

Ranks: diffusers 0.42 declares no ``_cp_plan`` for ``GlmImageTransformer2DModel``, so ``cp_plan``
is None and the family runs replicated only (DP); Ulysses and Ring are refused at start-up, as is
LoRA (``GlmImagePipeline`` loads no adapters). Only text-to-image is served (the pipeline's
image-to-image path takes source images, which ``T2IParams`` has no field for).
"""

from __future__ import annotations

import logging

from tilecast.runtime.models.families import common, flux, tokenizers
from tilecast.runtime.models.families.common import DiffusersBatchPipeline, T2IParams, TinyCheckpoint

logger = logging.getLogger(__name__)

CODEBOOK_SIZE = 64
"""Image tokens of the tiny AR model (the released codebook has 16384): its head's
``vision_vocab_size`` and the DiT's ``prior_vq_quantizer_codebook_size``."""
AR_DIM = 32
"""Hidden size of the tiny AR model's text and vision towers."""


def build_tiny_glm_image():
    """The tiny ``GlmImagePipeline`` in memory (call under a seed; ``TinyCheckpoint`` does)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, GlmImagePipeline, GlmImageTransformer2DModel
    from transformers import (
        ByT5Tokenizer,
        GenerationConfig,
        GlmImageConfig,
        GlmImageForConditionalGeneration,
        GlmImageImageProcessorPil,
        GlmImageProcessor,
        T5Config,
        T5EncoderModel,
    )

    ar_tokenizer = tokenizers.glm_image_tokenizer(codebook_size=CODEBOOK_SIZE)
    pad_id = ar_tokenizer.pad_token_id
    config = GlmImageConfig(
        text_config=dict(
            vocab_size=tokenizers.glm_image_vocab_size(CODEBOOK_SIZE),
            vision_vocab_size=CODEBOOK_SIZE,
            hidden_size=AR_DIM,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]},
            pad_token_id=pad_id,
            eos_token_id=ar_tokenizer.eos_token_id,
        ),
        vision_config=dict(depth=1, hidden_size=AR_DIM, num_heads=2, image_size=32, patch_size=8, intermediate_size=64),
        vq_config=dict(embed_dim=16, num_embeddings=CODEBOOK_SIZE, latent_channels=AR_DIM),
        image_token_id=ar_tokenizer.convert_tokens_to_ids(ar_tokenizer.image_token),
        image_start_token_id=ar_tokenizer.bos_token_id,
        image_end_token_id=ar_tokenizer.eos_token_id,
    )
    vision_language_encoder = GlmImageForConditionalGeneration(config).eval()
    vision_language_encoder.generation_config = GenerationConfig(  # the released sampling (model card)
        do_sample=True, temperature=0.9, top_p=0.75, eos_token_id=ar_tokenizer.eos_token_id, pad_token_id=pad_id
    )
    processor = GlmImageProcessor(
        image_processor=GlmImageImageProcessorPil(patch_size=8, temporal_patch_size=1, merge_size=1),
        tokenizer=ar_tokenizer,
        chat_template=ar_tokenizer.chat_template,
    )
    glyph_tokenizer = ByT5Tokenizer()
    t5_config = flux.flux_configs(flux.TINY_OVERRIDES)["text_encoder_2"]  # gated-GELU T5 encoder, as ByT5's
    text_encoder = T5EncoderModel(T5Config(vocab_size=len(glyph_tokenizer), **t5_config)).eval()
    transformer = GlmImageTransformer2DModel(  # 2x2 patches of 16 latent channels, as released
        **common.TINY_DIT,
        text_embed_dim=t5_config["d_model"],
        time_embed_dim=32,
        condition_dim=16,
        prior_vq_quantizer_codebook_size=CODEBOOK_SIZE,
    ).eval()
    latent_channels = 16
    vae_config = {
        **flux.flux_configs(flux.TINY_OVERRIDES)["vae"],
        "latents_mean": [0.0] * latent_channels,
        "latents_std": [1.0] * latent_channels,
    }
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.25, max_shift=0.75, base_image_seq_len=256, time_shift_type="linear"
    )
    return GlmImagePipeline(
        tokenizer=glyph_tokenizer,
        processor=processor,
        text_encoder=text_encoder,
        vision_language_encoder=vision_language_encoder,
        vae=AutoencoderKL(**vae_config).eval(),
        transformer=transformer,
        scheduler=scheduler,
    )


TINY_GLM_IMAGE = TinyCheckpoint(
    name="tiny-glm-image-v1", seed=20250705, build=build_tiny_glm_image, ref=f"{__name__}:TINY_GLM_IMAGE"
)


class GlmImageT2IPipeline(DiffusersBatchPipeline):
    """GLM-Image T2I, one request per ``GlmImagePipeline`` call (see the module docstring: why no batching)."""

    family = "glm-image"
    task = "t2i"
    params_type = T2IParams
    diffusers_class = "GlmImagePipeline"
    checkpoint = TINY_GLM_IMAGE
    builtin_name = "tiny/glm-image"
    model_id_hints = ("glm-image",)
    default_steps = 30
    default_guidance = 1.5
    size_multiple = 32
    max_batch_size = 1
    max_sequence_length = 2048
    """Glyph-text bytes per quoted span (``GlmImagePipeline``'s default)."""
    max_sequence_length_limit = 2048
    honoured_settings = frozenset({"dtype", "compile"})
    unsupported_reasons = {
        "lora_paths": "diffusers' GlmImagePipeline loads no LoRA adapters",
        "lora_dirs": "diffusers' GlmImagePipeline loads no LoRA adapters",
        "ulysses_degree": "GlmImageTransformer2DModel has no context-parallel plan in diffusers 0.42",
        "ring_degree": "GlmImageTransformer2DModel has no context-parallel plan in diffusers 0.42",
    }

    def validate(self, params) -> None:
        if params.negative_prompt is not None:
            raise ValueError(
                "negative_prompt cannot be used by glm-image: its guidance drops the prior image tokens and "
                "the glyph text instead (GlmImagePipeline takes no negative prompt)"
            )

    def negative_prompts(self, items) -> dict:
        return {}

    def generate(self, items, ctx):
        """The AR sampling before the first denoising step is one long stage (a token per 32x32
        pixels plus 256): a heartbeat per sampled token, from the AR head."""
        with ctx.alive_during(self.pipe.vision_language_encoder.lm_head):
            return super().generate(items, ctx)
