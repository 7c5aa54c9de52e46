"""Qwen-Image-Layered (``QwenImageLayeredPipeline``, built-in ``tiny/qwen-image-layered``): one input
image in, several RGBA layers out (image decomposition).

The tiny checkpoint keeps the real structure, built from ``tiny/qwen-image``'s pieces
(``qwen_image.tiny_text_encoder`` / ``tiny_transformer`` / ``tiny_vae``): the Wan-style 8x
``AutoencoderKLQwenImage`` with 16 latent channels on **4-channel RGBA** pixels (``input_channels=4``,
the released Layered VAE; diffusers reads ``vae.config.z_dim``, ``latents_mean`` / ``latents_std``
and ``temperal_downsample``), the MMDiT ``QwenImageTransformer2DModel`` with Layered's switches
(``use_layer3d_rope``: each layer and the input image get their own RoPE frame index;
``use_additional_t_cond``: the RGB/RGBA flag added to the timestep embedding), and the
``Qwen2_5_VLForConditionalGeneration`` text encoder with a byte-level ``Qwen2Tokenizer``. The VAE is
narrower than ``tiny/qwen-image``'s (``base_dim`` 4, not 8; same stages): diffusers' 640 bucket makes
every run encode the input and decode each layer at about 640 x 640 pixels whatever the request, and
4 channels at full resolution keep a two-step, two-layer run at ~3 s on one CPU thread (8: ~9 s; 2
channels: ~3 s too, but the RMS norms over 2 channels amplify float noise: merged != singleton by 2e-4).

No ``Qwen2VLProcessor`` (so no torchvision): diffusers uses the processor only to caption the input
image when the prompt is empty (``get_image_caption``, the vision tower generating up to 512 tokens).
tilecast refuses an empty prompt (every family does), so the processor is never used: the tiny
checkpoint has none and a released checkpoint's is not loaded (``own_components``). Send the caption
of the image as the prompt.

Requests (``LayeredParams``): one input image, kept RGBA (``image_mode``; an image without alpha gets
an opaque one, as the card's ``.convert("RGBA")``); ``layers`` (output layers, 1..``MAX_LAYERS``);
``resolution`` (640 or 1024, diffusers' buckets); ``cfg_normalize``. The output size is diffusers'
rule and not a request field: about ``resolution`` x ``resolution`` pixels at the input image's aspect
ratio, sides multiples of 32 (``output_size``); ``width`` / ``height`` are refused. A request writes
``layers`` RGBA files, ``<name>_layer0.png`` ... in diffusers' order (``image_files``), its job info
says ``layers``, and ``return_tensor`` returns the ``layers x 4 x H x W`` stack. JPEG cannot hold
alpha: PNG or WebP only.

Defaults from the released model's example (the diffusers docstring, Qwen/Qwen-Image-Layered):
50 steps, ``true_cfg_scale`` 4.0 with ``negative_prompt`` ``" "`` (Qwen-Image's; without a negative
prompt diffusers would skip the guidance the example asks for), 4 layers at resolution 640,
``cfg_normalize`` off (diffusers' default).

Batching: one call takes a list of prompts and one image per prompt, each VAE-encoded on its own
(``argmax``: no noise) and each request's noise drawn from its own generator; the resolution and the
layer RoPE come from the first image, so requests merge when their image sizes, ``layers``,
``resolution`` and ``cfg_normalize`` agree (all in the batch key). diffusers splits the decoded
layers per prompt in steps of ``layers + 1`` (the input frame it dropped), so a merged call's per
prompt lists are misaligned; ``output_rows`` re-joins them and cuts ``layers`` per request. A merged
request equals its singleton within 1e-4 (measured ~1e-5; ``tests/test_families.py``).

Ranks: Qwen-Image's plan, diffusers' ``QwenImageTransformer2DModel._cp_plan``, splits the noise
frames' and the input image's tokens together (the layer RoPE's frequencies with them); Ulysses 2 x
Ring 2 matches one rank within 7.7e-6 (``tests/test_families_sp.py``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from tilecast.runtime.models.families import common, images, qwen_image, tokenizers
from tilecast.runtime.models.families.common import I2IParams, TinyCheckpoint
from tilecast.runtime.models.families.qwen_image import QwenImageT2IPipeline
from tilecast.runtime.models.families.qwen_image_edit import calculate_dimensions
from tilecast.runtime.pipeline import WorkItem

logger = logging.getLogger(__name__)

RESOLUTIONS = (640, 1024)
"""diffusers' resolution buckets (``QwenImageLayeredPipeline`` asserts one of them)."""
MAX_LAYERS = 10
"""tilecast's bound on ``layers``: each layer adds one image's tokens to every transformer pass
(at 1024, 4096 tokens a layer)."""
RGBA_FORMATS = ("png", "webp")
"""Output formats that keep the layers' alpha channel."""


class LayeredParams(I2IParams, forbid_unknown_fields=True, kw_only=True):
    """A Qwen-Image-Layered request: ``I2IParams`` plus the decomposition's settings."""

    layers: int = 4
    """Output layers (RGBA images) the input image is decomposed into; 1..``MAX_LAYERS``."""
    resolution: int = 640
    """diffusers' size bucket, 640 or 1024: the output holds about resolution x resolution pixels."""
    cfg_normalize: bool = False
    """Rescale the guided prediction to the conditional one's norm (needs guidance on)."""


def build_tiny_qwen_image_layered():
    """The tiny ``QwenImageLayeredPipeline`` in memory (call under a seed; ``TinyCheckpoint`` does)."""
    from diffusers import QwenImageLayeredPipeline

    tokenizer = tokenizers.qwen_tokenizer()
    text_encoder = qwen_image.tiny_text_encoder(tokenizer)
    transformer = qwen_image.tiny_transformer(use_additional_t_cond=True, use_layer3d_rope=True)
    vae = qwen_image.tiny_vae(input_channels=4, base_dim=4)  # narrower: the 640 bucket's pixels (docstring)
    return QwenImageLayeredPipeline(
        scheduler=qwen_image.released_scheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=None,
        transformer=transformer,
    )


TINY_QWEN_IMAGE_LAYERED = TinyCheckpoint(
    name="tiny-qwen-image-layered-v1",
    seed=20251217,
    build=build_tiny_qwen_image_layered,
    ref=f"{__name__}:TINY_QWEN_IMAGE_LAYERED",
)


class QwenImageLayeredI2IPipeline(QwenImageT2IPipeline):
    """Qwen-Image-Layered: one RGBA input image, ``layers`` RGBA output images per request (module
    docstring)."""

    family = "qwen-image-layered"
    task = "i2i"
    params_type = LayeredParams
    upload_fields = ("image",)
    diffusers_class = "QwenImageLayeredPipeline"
    checkpoint = TINY_QWEN_IMAGE_LAYERED
    builtin_name = "tiny/qwen-image-layered"
    model_id_hints = ("qwen-image-layered",)
    default_steps = 50
    default_guidance = 4.0
    max_sequence_length = 512
    """diffusers' default for this pipeline."""
    min_images = 1
    max_images = 1
    image_mode = "RGBA"
    size_from_image = True
    size_rule = "about resolution x resolution pixels at its aspect ratio, diffusers' rule"

    @classmethod
    def own_components(cls, path: Path) -> dict[str, Any]:
        """The captioning processor stays unloaded (module docstring: it needs torchvision and only
        captions empty prompts, which are refused)."""
        return {"processor": None}

    def prepare(self, params, uploads: dict[str, bytes]):
        if params.resolution not in RESOLUTIONS:
            raise ValueError(
                f"resolution must be one of {', '.join(map(str, RESOLUTIONS))} for {self.family}"
                f" (diffusers' buckets), got {params.resolution}"
            )
        return super().prepare(params, uploads)

    def output_size(self, params, image_sizes: list[list[int]]) -> tuple[int, int]:
        """diffusers' rule: about ``resolution`` x ``resolution`` pixels at the input image's aspect
        ratio, sides multiples of 32; ``ValueError`` for an image too far from square for it."""
        width, height = image_sizes[0]
        out_width, out_height = calculate_dimensions(params.resolution**2, width / height)
        if not (32 <= out_width <= common.MAX_SIDE and 32 <= out_height <= common.MAX_SIDE):
            raise ValueError(
                f"image: {self.family} resizes a {width}x{height} input to {out_width}x{out_height} pixels"
                f" (about {params.resolution}x{params.resolution} at its aspect ratio); send an image nearer to square"
            )
        return out_width, out_height

    def validate(self, params) -> None:
        super().validate(params)
        if not 1 <= params.layers <= MAX_LAYERS:
            raise ValueError(f"layers must be in 1..{MAX_LAYERS} for {self.family}, got {params.layers}")
        if params.output_format not in RGBA_FORMATS:
            raise ValueError(
                f"output_format {params.output_format!r} cannot hold the layers' alpha channel;"
                f" use {' or '.join(RGBA_FORMATS)}"
            )
        if params.cfg_normalize and not self.guidance_on(params):
            raise ValueError(f"cfg_normalize needs guidance: {self.no_guidance_reason(params)}")

    def call_kwargs(self, params) -> dict[str, Any]:
        kwargs = super().call_kwargs(params)
        del kwargs["width"], kwargs["height"]  # diffusers derives them from resolution (output_size)
        return {
            **kwargs,
            "layers": params.layers,
            "resolution": params.resolution,
            "cfg_normalize": params.cfg_normalize,
        }

    def image_kwargs(self, items: list[WorkItem]) -> dict[str, Any]:
        """``image``: each request's RGBA input image, paired with its prompt."""
        return {"image": [images.load_images(item.uploads, self.image_mode)[0] for item in items]}

    def output_rows(self, output: Any, batch_size: int) -> torch.Tensor:
        """diffusers returns one ``layers x 4 x H x W`` stack per prompt, but cut from the decoded
        layers in steps of ``layers + 1``: joined again, they are each request's layers in order."""
        layers_NCHW = torch.cat(list(output))
        return layers_NCHW.unflatten(0, (batch_size, layers_NCHW.shape[0] // batch_size))

    def image_files(self, path: Path, sample: torch.Tensor) -> list[tuple[Path, torch.Tensor]]:
        """One RGBA file per layer: ``<name>_layer0.<format>``, ``<name>_layer1.<format>``, ..."""
        return [(path.with_name(f"{path.stem}_layer{index}{path.suffix}"), layer) for index, layer in enumerate(sample)]

    def output_info(self, sample: torch.Tensor) -> dict[str, Any]:
        return {"layers": sample.shape[0]}
