"""Wan2.1 image-to-video (``WanImageToVideoPipeline``): I2V 14B 480P / 720P and Wan2.1 Fun 1.3B InP
(first and last frame), with the built-in tiny checkpoint ``tiny/wan2.1-i2v-14b-480p``.

The tiny checkpoint keeps the real structure of the released I2V 14B checkpoints: ``tiny/wan2.1-t2v``'s
VAE, UMT5 encoder and offline tokenizer, a ``WanTransformer3DModel`` taking 36 input channels (16
noise + 4 first/last-frame mask + 16 image latents) with image cross-attention (``image_dim``,
``added_kv_proj_dim``) fed by a ``CLIPVisionModel`` (its second-to-last hidden state, as diffusers
reads it) and a ``CLIPImageProcessor`` (transformers' PIL image processor: no torchvision needed),
and the flow UniPC scheduler. One tiny checkpoint serves every row: the released id picks the card
defaults (``WanFamily``).

Input images: ``image.0`` is the first frame; ``image.1``, where the release takes it (Fun InP, the
tiny checkpoint), the last frame (diffusers' ``last_image``). A model whose image embedder has no
first/last position embedding (every one here; FLF2V has one) is conditioned by CLIP on the first
frame only, as Wan-Fun's own pipeline does: diffusers would otherwise stack two CLIP embeddings per
video. Diffusers takes one first frame (and one last frame) for a whole call, so only requests
with the same images merge (``batch_shares_images``). Without a size, a request keeps its first
image's aspect ratio within the card's pixel count (the cards' ``max_area`` rule).

Defaults (Wan-AI's I2V release: its ``generate.py`` and card): 81 frames at 16 fps, 40 steps,
guidance 5, flow shift 3 at 480P and 5 at 720P; 832 x 480 pixels for 480P, 1280 x 720 for 720P. Fun
1.3B InP (VideoX-Fun's defaults, as FastVideo's ``Wan2_1_Fun_1_3B_InP_SamplingParam``): 81 frames at
832 x 480, 50 steps, guidance 6, the checkpoint's flow shift.
"""

from __future__ import annotations

import logging
from typing import Any

from tilecast.runtime.models.families import common, images, wan
from tilecast.runtime.models.families.common import TinyCheckpoint
from tilecast.runtime.models.families.wan import WanDefaults, WanFamily, WanI2VParams
from tilecast.runtime.pipeline import WorkItem

logger = logging.getLogger(__name__)

CLIP_DIM = 32
"""Hidden size of the tiny CLIP vision tower (the transformer's ``image_dim``)."""
CLIP_IMAGE_SIZE = 32
"""Side of the tiny CLIP's input crop (released: 224)."""


def tiny_clip():
    """The tiny ``CLIPVisionModel`` and its ``CLIPImageProcessor`` (released: ViT-H/14 at 224 px)."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(
        hidden_size=CLIP_DIM,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=CLIP_IMAGE_SIZE,
        patch_size=8,
        projection_dim=CLIP_DIM,
    )
    processor = CLIPImageProcessor(
        size={"shortest_edge": CLIP_IMAGE_SIZE},
        crop_size={"height": CLIP_IMAGE_SIZE, "width": CLIP_IMAGE_SIZE},
    )
    return CLIPVisionModel(config).eval(), processor


def tiny_i2v_transformer(*, image_dim: int | None):
    """A tiny image-to-video ``WanTransformer3DModel``: 36 input channels; with ``image_dim``, the
    image cross-attention of Wan2.1 I2V (added K/V projections)."""
    from diffusers import WanTransformer3DModel

    inner = common.TINY_DIT["num_attention_heads"] * common.TINY_DIT["attention_head_dim"]
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        **common.TINY_DIT,
        in_channels=36,
        out_channels=16,
        text_dim=wan.TEXT_DIM,
        freq_dim=32,
        ffn_dim=64,
        image_dim=image_dim,
        added_kv_proj_dim=inner if image_dim else None,
        rope_max_seq_len=1024,
    ).eval()


def build_tiny_wan_i2v():
    """The tiny ``WanImageToVideoPipeline`` in memory (call under a seed; ``TinyCheckpoint`` does)."""
    from diffusers import WanImageToVideoPipeline

    t2v = wan.build_tiny_wan()
    image_encoder, image_processor = tiny_clip()
    return WanImageToVideoPipeline(
        tokenizer=t2v.tokenizer,
        text_encoder=t2v.text_encoder,
        vae=t2v.vae,
        scheduler=t2v.scheduler,
        image_processor=image_processor,
        image_encoder=image_encoder,
        transformer=tiny_i2v_transformer(image_dim=CLIP_DIM),
    )


TINY_WAN_I2V = TinyCheckpoint(
    name="tiny-wan2.1-i2v-14b-480p-v1",
    seed=20250801,
    build=build_tiny_wan_i2v,
    ref=f"{__name__}:TINY_WAN_I2V",
    index_classes={"image_processor": ["transformers", "CLIPImageProcessor"]},  # as released
)


class WanI2VPipeline(WanFamily):
    """Wan2.1 I2V 480P / 720P and Wan2.1 Fun InP; a merged batch (same input images) is one
    ``WanImageToVideoPipeline`` call."""

    family = "wan2.1-i2v"
    task = "i2v"
    params_type = WanI2VParams
    upload_fields = ("image",)
    diffusers_class = "WanImageToVideoPipeline"
    checkpoint = TINY_WAN_I2V
    builtin_name = "tiny/wan2.1-i2v-14b-480p"
    min_images = 1
    max_images = 2
    batch_shares_images = True
    variants = {
        "Wan2.1-I2V-14B-480P": WanDefaults(
            width=832, height=480, num_frames=81, steps=40, flow_shift=3.0, max_images=1
        ),
        "Wan2.1-I2V-14B-720P": WanDefaults(
            width=1280, height=720, num_frames=81, steps=40, flow_shift=5.0, max_images=1
        ),
        "Wan2.1-Fun-1.3B-InP": WanDefaults(width=832, height=480, num_frames=81, guidance=6.0, max_images=2),
        "Wan2.1-Fun-V1.1-1.3B-InP": WanDefaults(width=832, height=480, num_frames=81, guidance=6.0, max_images=2),
    }
    fallback_variant = "Wan2.1-I2V-14B-480P"
    max_sequence_length = 512
    """Diffusers' Wan attention splits the image context from the text by a hard-coded text length
    of 512 (``WanAttnProcessor``): an image-conditioned transformer needs exactly 512 text tokens."""

    def __init__(self, pipe, ctx) -> None:
        super().__init__(pipe, ctx)
        transformer = pipe.transformer
        embedder = getattr(transformer.condition_embedder, "image_embedder", None)
        self.first_frame_clip = embedder is not None and embedder.pos_embed is None
        """CLIP sees the first frame only (no first/last position embedding to tell two apart)."""
        if self.first_frame_clip:
            encode = pipe.encode_image  # diffusers passes [image, last_image] when there is a last frame

            def encode_first_frame(image, device=None):
                return encode(image[0] if isinstance(image, (list, tuple)) else image, device)

            pipe.encode_image = encode_first_frame

    def validate(self, params) -> None:
        super().validate(params)
        length = params.max_sequence_length
        if self.pipe.transformer.config.image_dim is not None and length not in (None, 512):
            raise ValueError(
                f"max_sequence_length must be 512 for {self.family}: diffusers' Wan attention takes the last"
                f" 512 context tokens as the text and the rest as the image, got {length}"
            )

    def image_kwargs(self, items: list[WorkItem]) -> dict[str, Any]:
        """``image`` (the first frame) and, with a second image, ``last_image``: one set for the
        batch (``batch_shares_images``: the batch's requests sent the same images)."""
        frames = images.load_images(items[0].uploads)
        kwargs: dict[str, Any] = {"image": frames[0]}
        if len(frames) > 1:
            kwargs["last_image"] = frames[1]
        return kwargs
