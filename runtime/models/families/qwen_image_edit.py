"""Image editing on Qwen-Image: Qwen-Image-Edit (``QwenImageEditPipeline``, built-in ``tiny/qwen-image-edit``)
and Qwen-Image-Edit-2509 / 2511 and FireRed-Image-Edit 1.0 / 1.1 (``QwenImageEditPlusPipeline``,
built-in ``tiny/qwen-image-edit-2511``).

The tiny checkpoints keep ``tiny/qwen-image``'s structure (Wan-style 8x ``AutoencoderKLQwenImage``,
MMDiT ``QwenImageTransformer2DModel`` on 2x2-packed latents, ``Qwen2_5_VLForConditionalGeneration``)
and add what editing uses: the text encoder's vision tower runs on the input image (one block,
Qwen2.5-VL's 14-pixel patches merged 2x2, so the image's tokens enter the prompt as in the released
model), a ``Qwen2VLProcessor`` built offline (``tokenizers.qwen_tokenizer(vision=True)``: Qwen2-VL's
``<|vision_start|>`` ``<|image_pad|>`` ... tokens; a ``Qwen2VLImageProcessor`` whose ``max_pixels``
keeps the vision tower at a few patches; a default ``Qwen2VLVideoProcessor``), and the transformer's
input image latents concatenated to the noise tokens. The 2511 checkpoint's transformer sets
``zero_cond_t`` (the input image's tokens are modulated at timestep 0), as the released 2511 does.

**torchvision is required.** With transformers 5, a ``Qwen2VLProcessor`` (its video processor) loads
only with torchvision installed; ``load`` says so (``required_modules``) instead of failing deep in
transformers, and the tests of these families skip where it is missing.

Sizes follow diffusers' own rule (``output_size``): the input image is resized to about 1024 x 1024
pixels (``calculate_dimensions(1024 * 1024, width / height)``, multiples of 32) for the VAE whatever
the output size, and the output defaults to that size. Edit Plus resizes every input image so
(the vision tower's copy to about 384 x 384) and takes the size of the last one.

Defaults from the model cards: Qwen-Image-Edit 50 steps, Edit-2509 / 2511 40 steps, FireRed-Image-Edit
40 steps (its ``inference.py``), all ``true_cfg_scale`` 4.0 with ``negative_prompt`` ``" "`` (the
cards' ``guidance_scale=1.0`` is ignored by diffusers for these non-distilled transformers).

Batching: a ``QwenImageEditPipeline`` call pairs input image i with prompt i (the processor expands
each prompt's one image placeholder with its own image; the VAE encodes each image for its own row),
sizing all of them from the first image, so requests merge when their images have the same size
(``image_sizes`` is in the batch key); a merged request equals its singleton within 1e-4
(``tests/test_image_edit.py``). ``QwenImageEditPlusPipeline`` refuses more than one prompt per call
(diffusers: "currently only supports batch_size=1"), so Edit Plus is served one request at a time.

Ranks: diffusers' ``QwenImageTransformer2DModel._cp_plan`` splits the noise and input-image tokens
(and 2511's ``modulate_index``) over the Ulysses / Ring ranks; 2 and 4 ranks match one rank within
1.3e-6 (``tests/test_families_sp.py``).

Qwen-Image-Layered (``QwenImageLayeredPipeline``: an RGBA image in, several RGBA layers out at a
640 / 1024 resolution bucket) is ``families.qwen_image_layered``.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from tilecast.runtime.models.families import common, images, qwen_image, tokenizers
from tilecast.runtime.models.families.common import I2IParams, TinyCheckpoint
from tilecast.runtime.models.families.qwen_image import QwenImageT2IPipeline
from tilecast.runtime.pipeline import WorkItem

logger = logging.getLogger(__name__)

VISION_MAX_PIXELS = 56 * 56
"""The tiny processor's ``max_pixels``: an input image reaches the vision tower as at most 4 x 4
patches of 14 pixels, 2 x 2 merged tokens (the released processor allows 12845056 pixels)."""
VISION_MIN_PIXELS = 28 * 28
"""The tiny processor's ``min_pixels`` (one merged token)."""
VAE_IMAGE_AREA = 1024 * 1024
"""diffusers' target area of the VAE's copy of an input image, and the default output area."""


def calculate_dimensions(target_area: int, ratio: float) -> tuple[int, int]:
    """diffusers' ``calculate_dimensions`` of the Qwen-Image edit pipelines: the ``(width, height)``
    of about ``target_area`` pixels at ``ratio`` (width / height), each rounded to a multiple of 32."""
    width = math.sqrt(target_area * ratio)
    height = width / ratio
    return round(width / 32) * 32, round(height / 32) * 32


def build_tiny_qwen_image_edit(*, plus: bool):
    """The tiny ``QwenImageEditPipeline`` (``plus``: ``QwenImageEditPlusPipeline``, 2511's transformer)
    in memory (call under a seed; ``TinyCheckpoint`` does). Needs torchvision (the processor)."""
    import diffusers
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    tokenizer = tokenizers.qwen_tokenizer(vision=True)
    text_encoder = qwen_image.tiny_text_encoder(tokenizer, vision_tokens=True)
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=VISION_MIN_PIXELS, max_pixels=VISION_MAX_PIXELS),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=tokenizers.QWEN_CHAT_TEMPLATE,
    )
    transformer = qwen_image.tiny_transformer(**({"zero_cond_t": True} if plus else {}))
    vae = qwen_image.tiny_vae()
    scheduler = qwen_image.released_scheduler()
    cls = diffusers.QwenImageEditPlusPipeline if plus else diffusers.QwenImageEditPipeline
    return cls(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=processor,
        transformer=transformer,
    )


def _build_edit():
    return build_tiny_qwen_image_edit(plus=False)


def _build_edit_plus():
    return build_tiny_qwen_image_edit(plus=True)


TINY_QWEN_IMAGE_EDIT = TinyCheckpoint(
    name="tiny-qwen-image-edit-v1", seed=20250818, build=_build_edit, ref=f"{__name__}:TINY_QWEN_IMAGE_EDIT"
)
TINY_QWEN_IMAGE_EDIT_2511 = TinyCheckpoint(
    name="tiny-qwen-image-edit-2511-v1",
    seed=20251223,
    build=_build_edit_plus,
    ref=f"{__name__}:TINY_QWEN_IMAGE_EDIT_2511",
)


class QwenImageEditI2IPipeline(QwenImageT2IPipeline):
    """Qwen-Image-Edit: one input image per request; a merged batch is one ``QwenImageEditPipeline``
    call, image i with prompt i (module docstring)."""

    family = "qwen-image-edit"
    task = "i2i"
    params_type = I2IParams
    upload_fields = ("image",)
    diffusers_class = "QwenImageEditPipeline"
    checkpoint = TINY_QWEN_IMAGE_EDIT
    builtin_name = "tiny/qwen-image-edit"
    model_id_hints = ("qwen-image-edit",)
    default_steps = 50
    default_guidance = 4.0
    min_images = 1
    max_images = 1
    required_modules = ("torchvision",)

    def output_size(self, params, image_sizes: list[list[int]]) -> tuple[int, int]:
        """diffusers' rule: about 1024 x 1024 pixels at the first input image's aspect ratio."""
        return self.vae_sizes(image_sizes)[0]

    def vae_sizes(self, image_sizes: list[list[int]]) -> list[tuple[int, int]]:
        """The ``(width, height)`` diffusers resizes each input image to for the VAE (the Edit pipeline
        resizes every image of a call to the first one's); ``ValueError`` naming an image whose aspect
        ratio gives a side below 32 or above ``MAX_SIDE`` pixels."""
        sizes = [calculate_dimensions(VAE_IMAGE_AREA, width / height) for width, height in image_sizes]
        for index, ((width, height), (vae_width, vae_height)) in enumerate(zip(image_sizes, sizes)):
            if not (32 <= vae_width <= common.MAX_SIDE and 32 <= vae_height <= common.MAX_SIDE):
                label = "image" if len(sizes) == 1 else f"image {index + 1} of {len(sizes)}"
                raise ValueError(
                    f"{label}: {self.family} resizes a {width}x{height} input to {vae_width}x{vae_height} pixels"
                    f" (about 1024x1024 at its aspect ratio); send an image nearer to square (at most 16:1)"
                )
        return sizes

    def validate(self, params) -> None:
        if params.max_sequence_length is not None:
            raise ValueError(
                f"max_sequence_length cannot be used by {self.family}: diffusers' {self.diffusers_class} encodes"
                " the whole prompt with its image (no text length to set)"
            )

    def call_kwargs(self, params) -> dict[str, Any]:
        kwargs = super().call_kwargs(params)
        del kwargs["max_sequence_length"]  # not read by the edit pipelines (validate refuses it)
        return kwargs


class QwenImageEditPlusI2IPipeline(QwenImageEditI2IPipeline):
    """Qwen-Image-Edit-2509 / 2511 and FireRed-Image-Edit 1.0 / 1.1: one to three input images
    ("Picture 1", "Picture 2", ... in the prompt); one request per ``QwenImageEditPlusPipeline`` call."""

    family = "qwen-image-edit-plus"
    diffusers_class = "QwenImageEditPlusPipeline"
    checkpoint = TINY_QWEN_IMAGE_EDIT_2511
    builtin_name = "tiny/qwen-image-edit-2511"
    model_id_hints = ("qwen-image-edit-2509", "qwen-image-edit-2511", "firered-image-edit")
    default_steps = 40
    max_images = 3
    max_batch_size = 1
    """diffusers' ``QwenImageEditPlusPipeline`` refuses a call with more than one prompt."""

    def output_size(self, params, image_sizes: list[list[int]]) -> tuple[int, int]:
        """diffusers' rule: about 1024 x 1024 pixels at the last input image's aspect ratio."""
        return self.vae_sizes(image_sizes)[-1]

    def image_kwargs(self, items: list[WorkItem]) -> dict[str, Any]:
        """``image``: the request's input images in order (one request per call)."""
        (item,) = items
        return {"image": images.load_images(item.uploads)}
