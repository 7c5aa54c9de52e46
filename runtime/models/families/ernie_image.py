"""ERNIE-Image and ERNIE-Image-Turbo text-to-image (``ErnieImagePipeline``) and their built-in tiny
checkpoints ``tiny/ernie-image`` and ``tiny/ernie-image-turbo``.

The tiny checkpoints keep the real structure: FLUX.2's ``AutoencoderKLFlux2`` (32 latent channels,
2x2-patchified to 128 and normalised by its batch-norm statistics; four levels, so 16 pixels per
latent token), a single-stream ``ErnieImageTransformer2DModel`` over ``[image, text]`` tokens (one
shared adaptive-norm modulation, 3-axis rotary embedding: text position, then row and column),
and a ``Mistral3Model`` text encoder (tiny Mistral text tower and Pixtral vision tower; only the
text path runs) whose second-to-last hidden state conditions the transformer, with a byte-level
BPE tokenizer built offline that prepends ``<s>`` as Mistral's does. The transformer
zero-initialises its modulation and output projections (a trained checkpoint replaces them); the
tiny one draws them at random, so that the prompt and the timestep reach the output.

Defaults follow the model cards: ERNIE-Image (baidu/ERNIE-Image) 50 steps at ``guidance_scale``
4.0, classifier-free guidance with each request's ``negative_prompt`` (default ``""``, as
diffusers); ERNIE-Image-Turbo (baidu/ERNIE-Image-Turbo, distilled: 8 NFEs) 8 steps at 1.0, no
guidance. Both share the class: the registry tells them apart by name (``model_id_hints``; an
unnamed directory is served as ERNIE-Image). Scheduler: flow-matching Euler with the released
static shift 4.0; the pipeline passes its own linear sigmas.

Not run: the pipeline's prompt enhancer (``use_pe``, a 3B language model that rewrites each prompt
by sampling from the global random state, so a request's image would depend on what ran before
it); the released checkpoint's ``pe`` is not even loaded. Rewrite prompts before sending them.
``ErnieImagePipeline`` takes no text length (its tokenizer truncates at its own limit), so a
request's ``max_sequence_length`` is refused.

Ranks: diffusers 0.42 ships no ``_cp_plan`` for ``ErnieImageTransformer2DModel``; tilecast's
(``ernie_image_cp_plan``, with ``sp_attention.ErnieImageSequenceParallelProcessor``) splits its
joint ``[image, text]`` sequence over the Ulysses and Ring ranks.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tilecast.runtime.models.families import common, tokenizers
from tilecast.runtime.models.families.common import DiffusersBatchPipeline, T2IParams, TinyCheckpoint

logger = logging.getLogger(__name__)

TEXT_DIM = 32
"""Hidden size of the tiny text encoder (the transformer's ``text_in_dim``)."""
TEXT_MAX_TOKENS = 512
"""The tiny tokenizer's truncation length (and the text encoder's positions)."""


def build_tiny_ernie_image():
    """The tiny ``ErnieImagePipeline`` in memory (call under a seed; ``TinyCheckpoint`` does)."""
    import torch
    from diffusers import (
        AutoencoderKLFlux2,
        ErnieImagePipeline,
        ErnieImageTransformer2DModel,
        FlowMatchEulerDiscreteScheduler,
    )
    from transformers import Mistral3Config, Mistral3Model

    tokenizer = tokenizers.ernie_tokenizer(model_max_length=TEXT_MAX_TOKENS)
    vocab_size = tokenizers.ERNIE_VOCAB_SIZE
    config = Mistral3Config(
        text_config=dict(
            model_type="mistral",
            vocab_size=vocab_size,
            hidden_size=TEXT_DIM,
            intermediate_size=64,
            num_hidden_layers=2,  # the pipeline reads the second-to-last hidden state
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=TEXT_MAX_TOKENS,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        ),
        # One block (only the text path runs); Pixtral's patch geometry.
        vision_config=dict(
            model_type="pixtral",
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            head_dim=8,
            image_size=28,
            patch_size=14,
        ),
        image_token_index=vocab_size + 1,  # outside the vocabulary: no prompt can hold an image placeholder
    )
    text_encoder = Mistral3Model(config).eval()
    transformer = ErnieImageTransformer2DModel(
        hidden_size=common.TINY_DIT["num_attention_heads"] * common.TINY_DIT["attention_head_dim"],
        num_attention_heads=common.TINY_DIT["num_attention_heads"],
        num_layers=common.TINY_DIT["num_layers"],
        ffn_hidden_size=64,
        in_channels=128,  # 32 latent channels, 2x2-patchified, as released
        out_channels=128,
        text_in_dim=TEXT_DIM,
        rope_axes_dim=common.TINY_ROPE_AXES,
    ).eval()
    with torch.no_grad():  # zero at init (see the module docstring): random, so the conditioning matters
        for layer in (transformer.adaLN_modulation[-1], transformer.final_linear):
            torch.nn.init.normal_(layer.weight, std=0.05)
            torch.nn.init.normal_(layer.bias, std=0.05)
    vae = AutoencoderKLFlux2(
        block_out_channels=(8, 16, 16, 16), layers_per_block=1, norm_num_groups=8, sample_size=64
    ).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(shift=4.0)  # baidu/ERNIE-Image's scheduler_config.json
    return ErnieImagePipeline(
        transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, scheduler=scheduler
    )


TINY_ERNIE_IMAGE = TinyCheckpoint(
    name="tiny-ernie-image-v1", seed=20250708, build=build_tiny_ernie_image, ref=f"{__name__}:TINY_ERNIE_IMAGE"
)
TINY_ERNIE_IMAGE_TURBO = TinyCheckpoint(
    name="tiny-ernie-image-turbo-v1",
    seed=20250709,
    build=build_tiny_ernie_image,
    ref=f"{__name__}:TINY_ERNIE_IMAGE_TURBO",
)


def ernie_image_cp_plan() -> dict:
    """``ErnieImageTransformer2DModel``'s context-parallel plan, in diffusers' ``_cp_plan`` form
    (diffusers ships none for ERNIE-Image). Its blocks run sequence-first (``x`` is ``(S, B, C)``)
    over the joint ``[image, text]`` tokens: the first block splits ``x``, every block splits the
    per-token inputs it is given whole (the rotary table, the six modulation tensors, expanded over
    the tokens, and the text-padding mask), and the output projection's tokens are gathered (the
    model then keeps the image tokens).
    """
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    tokens_first = ContextParallelInput(split_dim=0, expected_dims=3, split_output=False)
    return {
        "layers.0": {"x": tokens_first},
        "layers.*": {
            "rotary_pos_emb": ContextParallelInput(split_dim=1, expected_dims=4, split_output=False),
            "temb": [tokens_first] * 6,
            "attention_mask": ContextParallelInput(split_dim=3, expected_dims=4, split_output=False),
        },
        "final_linear": ContextParallelOutput(gather_dim=0, expected_dims=3),
    }


class ErnieImageT2IPipeline(DiffusersBatchPipeline):
    """ERNIE-Image T2I; a merged batch is one ``ErnieImagePipeline`` call (see ``families.common``)."""

    family = "ernie-image"
    task = "t2i"
    params_type = T2IParams
    diffusers_class = "ErnieImagePipeline"
    checkpoint = TINY_ERNIE_IMAGE
    builtin_name = "tiny/ernie-image"
    model_id_hints = ("ERNIE-Image",)
    cp_plan = f"{__name__}:ernie_image_cp_plan"
    default_steps = 50
    default_guidance = 4.0

    @classmethod
    def own_components(cls, path: Path) -> dict[str, Any]:
        """The prompt enhancer and its tokenizer stay unloaded (module docstring)."""
        return {"pe": None, "pe_tokenizer": None}

    def validate(self, params) -> None:
        if params.max_sequence_length is not None:
            raise ValueError(
                f"max_sequence_length cannot be used by {self.family}: ErnieImagePipeline takes no text length "
                "(its tokenizer truncates prompts at its own limit)"
            )

    def call_kwargs(self, params) -> dict[str, Any]:
        """No ``max_sequence_length`` (the pipeline takes none); the prompt enhancer off."""
        kwargs = super().call_kwargs(params)
        del kwargs["max_sequence_length"]
        return {**kwargs, "use_pe": False}


class ErnieImageTurboT2IPipeline(ErnieImageT2IPipeline):
    """ERNIE-Image-Turbo: ERNIE-Image's family with the distilled model's defaults (no guidance)."""

    variant = True
    family = "ernie-image-turbo"
    checkpoint = TINY_ERNIE_IMAGE_TURBO
    builtin_name = "tiny/ernie-image-turbo"
    model_id_hints = ("ERNIE-Image-Turbo",)
    default_steps = 8
    default_guidance = 1.0
