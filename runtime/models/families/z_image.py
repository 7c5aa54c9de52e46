"""Z-Image and Z-Image-Turbo text-to-image (``ZImagePipeline``) and their built-in tiny checkpoints
``tiny/z-image-turbo`` and ``tiny/z-image``.

The tiny checkpoints keep the real structure: FLUX.1's 16-channel, 8x ``AutoencoderKL`` (the one
of ``tiny/flux``), a single-stream ``ZImageTransformer2DModel`` (2x2 patches, noise and context
refiner layers) and a ``Qwen3Model`` text encoder whose second-to-last hidden state conditions the
transformer, with a byte-level ``Qwen2Tokenizer`` built offline and a Qwen chat template (the
pipeline formats every prompt through ``apply_chat_template``). The two differ only in the
scheduler's shift, as the releases do (Turbo 3.0, Z-Image 6.0).

Z-Image-Turbo is distilled to run without guidance: the default ``guidance_scale`` is 0; above 0
diffusers runs classifier-free guidance with each request's ``negative_prompt`` (default ``""``).
Z-Image (the undistilled base, ``ZImageBaseT2IPipeline``) is the same family with its card's
defaults (Tongyi-MAI/Z-Image: 50 steps at ``guidance_scale`` 4, the card's range 28-50 steps and
3-5): guidance on. ``ZImagePipeline`` scales guidance as ``cond + g * (cond - uncond)``, so 0 is
off. Both are ``ZImagePipeline`` checkpoints: the registry tells them apart by name
(``model_id_hints``; an unnamed directory is served as Z-Image-Turbo, the family's first declaration).
"""

from __future__ import annotations

import functools
import logging

from tilecast.runtime.models.families import common, flux, tokenizers
from tilecast.runtime.models.families.common import DiffusersBatchPipeline, T2IParams, TinyCheckpoint

logger = logging.getLogger(__name__)

TEXT_DIM = 32
"""Hidden size of the tiny text encoder (the transformer's ``cap_feat_dim``)."""


def build_tiny_z_image(shift: float = 3.0):
    """The tiny ``ZImagePipeline`` in memory (call under a seed; ``TinyCheckpoint`` does); ``shift``:
    the flow-matching scheduler's (Z-Image-Turbo's 3.0 by default)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = tokenizers.qwen_tokenizer()
    text_config = common.tiny_qwen_text_config(tokenizer, hidden_size=TEXT_DIM)
    text_encoder = Qwen3Model(Qwen3Config(head_dim=16, **text_config)).eval()
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=16,
        dim=32,
        n_layers=1,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=TEXT_DIM,
        axes_dims=list(common.TINY_ROPE_AXES),
        axes_lens=[512, 128, 128],
    ).eval()
    vae = AutoencoderKL(**flux.flux_configs(flux.TINY_OVERRIDES)["vae"]).eval()  # Z-Image-Turbo uses FLUX.1's VAE
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift, use_dynamic_shifting=False)
    return ZImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )


TINY_Z_IMAGE = TinyCheckpoint(
    name="tiny-z-image-turbo-v1", seed=20250703, build=build_tiny_z_image, ref=f"{__name__}:TINY_Z_IMAGE"
)
TINY_Z_IMAGE_BASE = TinyCheckpoint(
    name="tiny-z-image-v1",
    seed=20250706,
    build=functools.partial(build_tiny_z_image, shift=6.0),  # Tongyi-MAI/Z-Image's scheduler_config.json
    ref=f"{__name__}:TINY_Z_IMAGE_BASE",
)


def z_image_cp_plan() -> dict:
    """``ZImageTransformer2DModel``'s context-parallel plan, in diffusers' ``_cp_plan`` form (diffusers
    ships none for Z-Image). Its three regions are sequence-parallel one after another: the image
    tokens through the noise refiner, the caption tokens through the context refiner, the unified
    ``[image, caption]`` sequence through the main layers. Each region splits its blocks' ``x`` at
    the first block and the per-token mask and rotary table at every block; the refiners' outputs
    are gathered after their last block (the model then builds the unified sequence per sample),
    the main layers' after the final projection (the smallest tensor).
    """
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    tokens = ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)
    per_token = {
        "attn_mask": ContextParallelInput(split_dim=1, expected_dims=2, split_output=False),
        "freqs_cis": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
        "noise_mask": ContextParallelInput(split_dim=1, expected_dims=2, split_output=False),
    }
    gather = ContextParallelOutput(gather_dim=1, expected_dims=3)
    plan: dict = {}
    for region in ("noise_refiner", "context_refiner", "layers"):
        plan[f"{region}.0"] = {"x": tokens}
        plan[f"{region}.*"] = per_token
    plan["noise_refiner.-1"] = gather
    plan["context_refiner.-1"] = gather
    plan["all_final_layer.*"] = gather
    return plan


class ZImageT2IPipeline(DiffusersBatchPipeline):
    """Z-Image-Turbo T2I; a merged batch is one ``ZImagePipeline`` call (see ``families.common``)."""

    family = "z-image-turbo"
    task = "t2i"
    params_type = T2IParams
    diffusers_class = "ZImagePipeline"
    checkpoint = TINY_Z_IMAGE
    builtin_name = "tiny/z-image-turbo"
    model_id_hints = ("Z-Image-Turbo",)
    cp_plan = f"{__name__}:z_image_cp_plan"
    size_multiple = 16
    default_guidance = 0.0
    max_sequence_length = 128

    def guidance_on(self, params) -> bool:
        return params.guidance_scale > 0.0


class ZImageBaseT2IPipeline(ZImageT2IPipeline):
    """Z-Image, the undistilled base: Z-Image-Turbo's family with the base card's defaults (guidance on)."""

    variant = True
    family = "z-image"
    checkpoint = TINY_Z_IMAGE_BASE
    builtin_name = "tiny/z-image"
    model_id_hints = ("Z-Image",)
    default_steps = 50
    default_guidance = 4.0
