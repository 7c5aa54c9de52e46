"""Qwen-Image and Qwen-Image-2512 text-to-image (``QwenImagePipeline``) and their built-in tiny
checkpoints ``tiny/qwen-image`` and ``tiny/qwen-image-2512``.

The tiny checkpoint keeps the real structure: the Wan-style 8x ``AutoencoderKLQwenImage`` with 16
latent channels (``tiny/wan2.1-t2v``'s VAE config), an MMDiT ``QwenImageTransformer2DModel`` on
2x2-packed latents, and a ``Qwen2_5_VLForConditionalGeneration`` text encoder (tiny text and
vision towers; only the text path runs) with a byte-level ``Qwen2Tokenizer`` built offline. The
pipeline drops the first 34 template tokens as the real one does; with a byte tokenizer that cut
falls inside the system prompt, which changes nothing structural.

``guidance_scale`` is Qwen-Image's true classifier-free guidance (diffusers' ``true_cfg_scale``):
above 1 every request runs a conditional and an unconditional pass, the latter on its own
``negative_prompt`` (default ``" "``, as diffusers recommends).

Qwen-Image-2512 (``QwenImage2512T2IPipeline``) is a newer checkpoint of the same architecture and
pipeline: the same family, its own tiny checkpoint (same configs, another seed) and its card's
defaults (Qwen/Qwen-Image-2512: 50 steps at ``true_cfg_scale`` 4.0). Both are ``QwenImagePipeline``
checkpoints: the registry tells them apart by name (``model_id_hints``; an unnamed directory is
served as Qwen-Image, the family's first declaration).
"""

from __future__ import annotations

import logging

from tilecast.runtime.models.families import common, tokenizers, wan
from tilecast.runtime.models.families.common import DiffusersBatchPipeline, T2IParams, TinyCheckpoint

logger = logging.getLogger(__name__)

TEXT_DIM = 32
"""Hidden size of the tiny text encoder (the transformer's ``joint_attention_dim``)."""


def tiny_text_encoder(tokenizer, *, vision_tokens: bool = False):
    """The tiny ``Qwen2_5_VLForConditionalGeneration`` every tiny Qwen-Image checkpoint builds: the
    two-layer text tower (``common.tiny_qwen_text_config``, ``TEXT_DIM`` wide) and a one-block vision
    tower. ``vision_tokens``: ``tokenizer`` has Qwen2-VL's vision tokens (the image-editing ones, whose
    vision tower runs) and the config names them; else the image and video placeholders lie outside
    the vocabulary, so no prompt can contain one (only the text path runs)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = common.tiny_qwen_text_config(tokenizer, hidden_size=TEXT_DIM)
    if vision_tokens:
        start, end, image_pad, video_pad = tokenizer.convert_tokens_to_ids(tokenizers.QWEN_VISION_SPECIAL)
        text["vocab_size"] = tokenizers.QWEN_VL_VOCAB_SIZE
    else:
        image_pad, video_pad, start, end = (tokenizers.QWEN_VOCAB_SIZE + offset for offset in (1, 2, 3, 4))
    config = Qwen2_5_VLConfig(
        text_config=dict(
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
            bos_token_id=None,
            **text,
        ),
        # One block of two 8-wide heads; patch (14), merge (2x2) and window geometry: the config's
        # defaults, Qwen2.5-VL's.
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=TEXT_DIM,
            fullatt_block_indexes=[0],
        ),
        image_token_id=image_pad,
        video_token_id=video_pad,
        vision_start_token_id=start,
        vision_end_token_id=end,
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def tiny_transformer(**config):
    """The tiny ``QwenImageTransformer2DModel`` (``common.TINY_DIT`` on 2x2-packed 16-channel latents);
    ``config``: the released variant's switches (2511's ``zero_cond_t``, Layered's layer RoPE)."""
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=64,
        out_channels=16,
        **common.TINY_DIT,
        joint_attention_dim=TEXT_DIM,
        axes_dims_rope=common.TINY_ROPE_AXES,
        **config,
    ).eval()


def tiny_vae(**config):
    """The tiny ``AutoencoderKLQwenImage`` (``tiny/wan2.1-t2v``'s VAE config; ``config`` overrides it:
    Layered's 4-channel RGBA ``input_channels`` and narrower ``base_dim``)."""
    from diffusers import AutoencoderKLQwenImage

    return AutoencoderKLQwenImage(**{**wan.tiny_vae_config(), **config}).eval()


def released_scheduler():
    """Qwen-Image's released schedule (diffusers' defaults but for these four; the edit and layered
    checkpoints ship the same scheduler config)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, max_shift=0.9, max_image_seq_len=8192, shift_terminal=0.02
    )


def build_tiny_qwen_image():
    """The tiny ``QwenImagePipeline`` in memory (call under a seed; ``TinyCheckpoint`` does)."""
    from diffusers import QwenImagePipeline

    tokenizer = tokenizers.qwen_tokenizer()
    text_encoder = tiny_text_encoder(tokenizer)
    transformer = tiny_transformer()
    vae = tiny_vae()
    return QwenImagePipeline(
        scheduler=released_scheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )


TINY_QWEN_IMAGE = TinyCheckpoint(
    name="tiny-qwen-image-v1", seed=20250702, build=build_tiny_qwen_image, ref=f"{__name__}:TINY_QWEN_IMAGE"
)
TINY_QWEN_IMAGE_2512 = TinyCheckpoint(
    name="tiny-qwen-image-2512-v1",
    seed=20251231,
    build=build_tiny_qwen_image,
    ref=f"{__name__}:TINY_QWEN_IMAGE_2512",
)


class QwenImageT2IPipeline(DiffusersBatchPipeline):
    """Qwen-Image T2I; a merged batch is one ``QwenImagePipeline`` call (see ``families.common``)."""

    family = "qwen-image"
    task = "t2i"
    params_type = T2IParams
    diffusers_class = "QwenImagePipeline"
    checkpoint = TINY_QWEN_IMAGE
    builtin_name = "tiny/qwen-image"
    model_id_hints = ("Qwen-Image",)
    cp_plan = "diffusers:QwenImageTransformer2DModel._cp_plan"
    size_multiple = 16
    default_guidance = 4.0
    max_sequence_length = 256
    max_sequence_length_limit = 1024
    true_cfg_is_guidance = True

    default_negative_prompt = " "
    """diffusers' recommendation for Qwen-Image."""

    def call_kwargs(self, params) -> dict:
        """``guidance_scale`` is diffusers' ``true_cfg_scale`` here (its own ``guidance_scale`` is for
        guidance-distilled checkpoints)."""
        return {**super().call_kwargs(params), "true_cfg_scale": params.guidance_scale, "guidance_scale": None}


class QwenImage2512T2IPipeline(QwenImageT2IPipeline):
    """Qwen-Image-2512: Qwen-Image's family with the 2512 card's defaults."""

    variant = True
    family = "qwen-image-2512"
    checkpoint = TINY_QWEN_IMAGE_2512
    builtin_name = "tiny/qwen-image-2512"
    model_id_hints = ("Qwen-Image-2512",)
    default_steps = 50
