"""FLUX.2-dev text-to-image (``Flux2Pipeline``), its built-in tiny checkpoint ``tiny/flux.2-dev``, and
the FLUX.2 networks the Klein family (``families.flux2_klein``) shares.

The tiny checkpoint keeps FLUX.2-dev's structure with every size shrunk: the 8x
``AutoencoderKLFlux2`` with its 32 latent channels (2x2-patchified to 128 and normalised by its
batch-norm statistics), an MMDiT ``Flux2Transformer2DModel`` (one double-stream and one
single-stream block, 4-axis rotary embedding over (T, H, W, L), guidance embedding: FLUX.2-dev is
guidance-distilled), and a ``Mistral3ForConditionalGeneration`` text encoder (tiny Mistral text
tower of 30 layers, because the pipeline stacks the hidden states of layers 10, 20 and 30 as the
text embedding; a one-layer Pixtral vision tower that T2I never runs), with FLUX.2's
flow-matching Euler scheduler (dynamic exponential shift; the pipeline computes its ``mu``).

The released checkpoint stores its tokenizer as a ``PixtralProcessor``, whose import needs
torchvision. FLUX.2's text path reads only the processor's tokenizer and chat template (the
processor's image side serves caption upsampling, which tilecast does not run), so the family
loads the ``tokenizer/`` folder as a plain tokenizer (``own_components``); the tiny checkpoint
stores that tokenizer directly (byte-level, Mistral's control tokens and chat format).

Defaults follow the FLUX.2-dev model card (black-forest-labs/FLUX.2-dev) and diffusers: 50 steps at
``guidance_scale`` 4.0, 512 text tokens. ``guidance_scale`` is an embedding, not classifier-free
guidance: a request takes no ``negative_prompt``. FLUX.2-dev-NVFP4 (one file of BFL-format NVFP4
transformer weights) is served here too: the base pipeline as ``--model-path``, the file as
``--transformer-weights-path`` (``families.flux2_nvfp4``; built-in: ``tiny/flux.2-dev-nvfp4``).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch

from tilecast.runtime.models.families import images, tokenizers
from tilecast.runtime.models.families.common import DiffusersBatchPipeline, I2IParams, TinyCheckpoint
from tilecast.runtime.pipeline import WorkItem

logger = logging.getLogger(__name__)

TEXT_DIM = 16
"""Hidden size of the tiny text encoders (Mistral's here, Qwen3's in Klein)."""
TEXT_LAYERS_TAPPED = 3
"""The pipelines stack three hidden states of the text encoder: the transformer reads 3 x its width."""
TINY_ROPE_AXES = (4, 4, 4, 4)
"""Rotary channels of a tiny 16-wide head per (T, H, W, L) axis (FLUX.2 has four; released: 32 each)."""


def tiny_transformer(*, guidance_embeds: bool):
    """The tiny ``Flux2Transformer2DModel``: 128 input channels (32 latent channels x 2x2), one
    double-stream and one single-stream block of two 16-wide heads."""
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(
        in_channels=128,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,  # two heads: Ulysses 2 can split them
        joint_attention_dim=TEXT_LAYERS_TAPPED * TEXT_DIM,
        axes_dims_rope=TINY_ROPE_AXES,
        guidance_embeds=guidance_embeds,
    ).eval()


def tiny_vae():
    """The tiny ``AutoencoderKLFlux2``: four levels (8x), FLUX.2's 32 latent channels, narrow blocks."""
    from diffusers import AutoencoderKLFlux2

    return AutoencoderKLFlux2(
        block_out_channels=(8, 16, 16, 16), layers_per_block=1, norm_num_groups=8, sample_size=64
    ).eval()


def scheduler():
    """FLUX.2's scheduler (the released ``scheduler_config.json``): dynamic exponential shift, ``mu``
    given by the pipeline from the image size and step count."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
        time_shift_type="exponential",
    )


def build_tiny_flux2():
    """The tiny ``Flux2Pipeline`` in memory (call under a seed; ``TinyCheckpoint`` does)."""
    from diffusers import Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tokenizer = tokenizers.mistral_tokenizer()
    config = Mistral3Config(
        text_config=dict(
            model_type="mistral",
            vocab_size=tokenizers.MISTRAL_VOCAB_SIZE,
            hidden_size=TEXT_DIM,
            intermediate_size=32,
            num_hidden_layers=30,  # the pipeline reads hidden states 10, 20 and 30
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=2048,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        # One block (T2I never runs it); patch and image size: Pixtral's released geometry.
        vision_config=dict(
            model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
        ),
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
    )
    return Flux2Pipeline(
        scheduler=scheduler(),
        vae=tiny_vae(),
        text_encoder=Mistral3ForConditionalGeneration(config).eval(),
        tokenizer=tokenizer,
        transformer=tiny_transformer(guidance_embeds=True),
    )


TINY_FLUX2 = TinyCheckpoint(
    name="tiny-flux.2-dev-v1", seed=20250705, build=build_tiny_flux2, ref=f"{__name__}:TINY_FLUX2"
)


def chat_tokenizer(folder: Path):
    """The tokenizer of a FLUX.2-dev ``tokenizer/`` folder, with its chat template, without the
    ``PixtralProcessor`` around it. A processor saved with its template in ``chat_template.json``
    (the older layout) gives the tokenizer that template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    legacy = folder / "chat_template.json"
    if not tokenizer.chat_template and legacy.is_file():
        tokenizer.chat_template = json.loads(legacy.read_text())["chat_template"]
    if not tokenizer.chat_template:
        raise ValueError(f"{folder} has no chat template: FLUX.2-dev formats every prompt through one")
    return tokenizer


REFERENCE_AREA = 1024 * 1024
"""FLUX.2's pipelines shrink a larger reference image to this many pixels (keeping its aspect)."""
MIN_REFERENCE_SIDE = 64
MAX_REFERENCE_ASPECT = 8
"""``Flux2ImageProcessor.check_image_input``'s limits on a reference image."""


class Flux2ReferenceImages:
    """FLUX.2's image inputs (dev and [klein]): 0..``max_images`` reference images per request.

    Both diffusers pipelines take ``image=`` as one list of references for the whole call (each
    reference is VAE-encoded and its tokens appended to every prompt's image tokens), so requests
    merge only with requests that send the same references (``batch_shares_images``); requests
    without references merge as before. Without ``width``/``height`` the output takes the first
    reference's size as the pipeline computes it (shrunk to ``REFERENCE_AREA``, floored to 16)."""

    params_type = I2IParams
    upload_fields = ("image",)
    min_images = 0
    batch_shares_images = True

    def output_size(self, params, image_sizes: list[list[int]]) -> tuple[int, int]:
        width, height = image_sizes[0]
        if width * height > REFERENCE_AREA:
            scale = math.sqrt(REFERENCE_AREA / (width * height))
            width, height = int(width * scale), int(height * scale)
        multiple = self.pipe.vae_scale_factor * 2
        return width // multiple * multiple, height // multiple * multiple

    def validate(self, params) -> None:
        super().validate(params)
        for index, (width, height) in enumerate(params.image_sizes):
            label = "image" if len(params.image_sizes) == 1 else f"image {index + 1}"
            if min(width, height) < MIN_REFERENCE_SIDE:
                raise ValueError(f"{label} is {width}x{height}; {self.family} needs both sides >= {MIN_REFERENCE_SIDE}")
            if max(width, height) > MAX_REFERENCE_ASPECT * min(width, height):
                raise ValueError(
                    f"{label} is {width}x{height}; {self.family} takes aspect ratios up to {MAX_REFERENCE_ASPECT}:1"
                )

    def image_kwargs(self, items: list[WorkItem]) -> dict[str, Any]:
        references = images.load_images(items[0].uploads)  # the batch key holds their digests: shared by all
        return {"image": references} if references else {}


class Flux2T2IPipeline(Flux2ReferenceImages, DiffusersBatchPipeline):
    """FLUX.2-dev T2I and reference-image editing; a merged batch is one ``Flux2Pipeline`` call (see
    ``families.common``)."""

    family = "flux.2-dev"
    task = "t2i"
    max_images = 10
    """BFL: up to 10 references (6 recommended for [dev])."""
    diffusers_class = "Flux2Pipeline"
    checkpoint = TINY_FLUX2
    builtin_name = "tiny/flux.2-dev"
    model_id_hints = ("flux.2-dev",)  # also FLUX.2-dev-NVFP4
    cp_plan = "diffusers:Flux2Transformer2DModel._cp_plan"
    default_steps = 50
    default_guidance = 4.0
    max_sequence_length = 512
    """diffusers' default (the released encoder's trained length for FLUX.2)."""

    honoured_settings = DiffusersBatchPipeline.honoured_settings | {"transformer_weights_path"}

    @staticmethod
    def check_base(path: Path) -> None:
        """``ValueError`` saying what to pass when ``path`` holds transformer weights alone (FLUX.2-dev-NVFP4)."""
        if not (path / "model_index.json").is_file() and any(path.glob("*.safetensors")):
            raise ValueError(
                f"{path} holds only transformer weights (no model_index.json), as FLUX.2-dev-NVFP4 does: pass "
                f"the base pipeline as --model-path and this as --transformer-weights-path (--model-path "
                f"black-forest-labs/FLUX.2-dev --transformer-weights-path {path})"
            )

    @classmethod
    def own_components(cls, path: Path) -> dict[str, Any]:
        cls.check_base(path)
        return {"tokenizer": chat_tokenizer(path / "tokenizer")}

    @classmethod
    def load_options(cls, ctx) -> dict[str, Any]:
        weights = ctx.settings.transformer_weights_path
        return {"transformer_weights_path": weights} if weights else {}

    @classmethod
    def build_diffusers(cls, model_path: str, device, dtype, transformer_weights_path: str | None = None) -> Any:
        """The family's pipeline; with ``transformer_weights_path``, its transformer from that BFL
        NVFP4 file (``families.flux2_nvfp4``) and the rest from ``model_path``."""
        if transformer_weights_path is None:
            return super().build_diffusers(model_path, device, dtype)
        from tilecast.runtime.hub import local_dir
        from tilecast.runtime.models.families import flux2_nvfp4

        base = cls.resolve_path(model_path)
        cls.check_base(base)  # before reading any weight
        weights = local_dir(transformer_weights_path, flag="--transformer-weights-path")
        transformer = flux2_nvfp4.load_transformer(weights, base, torch.device(device), dtype)
        return super().build_diffusers(model_path, device, dtype, components={"transformer": transformer})

    def guidance_on(self, params) -> bool:
        return False  # guidance-distilled: guidance_scale is an embedding, not CFG

    def no_guidance_reason(self, params) -> str:
        return "FLUX.2-dev is guidance-distilled and runs no classifier-free guidance"
