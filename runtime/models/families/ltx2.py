"""LTX-2 and LTX-2.3 text- (and image-) to-video with audio (``LTX2Pipeline``), built-in tiny checkpoint ``tiny/ltx-2``.

One MP4 per request: H.264 video and the generated soundtrack as an AAC track (stereo, the
vocoder's rate: 24 kHz on the released checkpoints); ``info`` reports the frame count, the fps and
the audio's sample rate, samples and duration, exactly what the file holds.

The tiny checkpoint keeps the real structure of every component: ``AutoencoderKLLTX2Video`` with
LTX-2's four encoder blocks (spatial, temporal, two spatio-temporal downsamplings), three
spatio-temporal decoder blocks and 4x4 patches, so 32x spatial and 8x temporal compression as
released (its channels are the released ones / 32); ``AutoencoderKLLTX2Audio`` (mel spectrogram
latents, 4x in time and mel bins, 16 kHz / hop 160) and an ``LTX2Vocoder`` with the released
upsampling (6, 5, 2, 2, 2: 100 mel frames/s to 24 kHz stereo); the ``LTX2TextConnectors`` (learnable
registers in place of padding); an ``LTX2VideoTransformer3DModel`` of one audio-video block (video and
audio self-attention, text cross-attention, audio-to-video and video-to-audio cross-attention,
"split" rotary tables as released); a ``Gemma3ForConditionalGeneration`` text encoder (every hidden
state feeds the connectors) with a ``GemmaTokenizer`` built offline.

Defaults follow the model cards (768 x 512, 121 frames at 24 fps). LTX-2 and LTX-2.3 share the
diffusers class and differ in their checkpoints' configs; the family tells them apart at load by the
connectors' per-modality projections (LTX-2.3 only) and takes each card's recipe (``RECIPES``):
LTX-2 40 steps, classifier-free guidance 4.0 on video and audio, the legacy cross-modal timestep;
LTX-2.3 30 steps, guidance 3.0 on video and 7.0 on audio, spatio-temporal guidance 1.0 at block 28,
modality-isolation guidance 3.0, guidance rescale 0.7 (diffusers' recommended 2.3 values).
``guidance_scale`` <= 1 turns every guidance term off (the distilled checkpoints' way).

``num_frames`` must be ``8k + 1`` (the video VAE's 8x temporal compression; diffusers would round
otherwise), width and height multiples of 32 and at least 64 (the decoder pads each latent row and
column by reflection, which needs two of them). ``max_sequence_length`` (1024, the released
default) must be a multiple of the connectors' learnable registers (128 released, 8 tiny).

Image-to-video: a request may send the first frame as an image (upload ``image.0``, HTTP
``input_reference``); its batch runs diffusers' ``LTX2ImageToVideoPipeline`` over the same modules,
the image re-compressed at the card's H.264 CRF (33) as the released pipeline does.

Sequence parallelism: diffusers' ``_cp_plan`` of ``LTX2VideoTransformer3DModel`` splits the video
tokens and the video text (and gathers ``proj_out``), ``ltx2_cp_plan`` adds image-to-video's per-token
timestep; the audio stream stays whole on every rank.
``sp_attention.LTX2SequenceParallelProcessor`` runs each of the block's six attention kinds
accordingly (see there), cutting the video rotary tables the plan leaves whole ("split" layout,
cross-modal tables) to the rank's tokens. ``--vae-config.use-parallel-decode`` splits the video VAE's
decode by row bands across the decode group (``ltx2_decode``: halo rows with reflect padding at the
true edges); the audio VAE and vocoder decode replicated.
"""

from __future__ import annotations

import dataclasses
import logging

from tilecast.runtime.models.families import images, tokenizers
from tilecast.runtime.models.families.common import VIDEO_VAE_REASONS, DiffusersBatchPipeline, I2VParams, TinyCheckpoint

logger = logging.getLogger(__name__)

MAX_FRAMES = 257
"""Longest video a request may ask for (about 10 s at 24 fps, the cards' upper range)."""
TEXT_DIM = 32
"""Hidden size of the tiny Gemma 3 text encoder (the connectors' ``caption_channels``)."""
TEXT_LAYERS = 2
"""Its layers: the connectors read ``TEXT_LAYERS + 1`` hidden states per token."""
REGISTERS = 8
"""The tiny connectors' learnable registers (128 released)."""


class LTX2Params(I2VParams, forbid_unknown_fields=True, kw_only=True):
    """An LTX-2 request: ``T2VParams`` with the model cards' defaults, and optionally the first frame
    as an input image (upload ``image.0``; ``I2VParams``)."""

    width: int = 768
    """Output width in pixels (a multiple of 32, at least 64)."""
    height: int = 512
    """Output height in pixels (a multiple of 32, at least 64)."""
    num_frames: int = 121
    """Frames to generate (``8k + 1``)."""
    fps: int = 24
    """Frame rate: the model is conditioned on it (rotary positions, the soundtrack's length), so it
    is part of the batch key."""


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A model card's sampling recipe (the ``LTX2Pipeline`` arguments besides prompt, size and steps)."""

    version: str
    steps: int
    guidance: float
    """Video classifier-free guidance (``guidance_scale``)."""
    audio_guidance: float | None
    """Audio classifier-free guidance; ``None``: the video's."""
    stg_scale: float
    """Spatio-temporal guidance (0: off)."""
    stg_blocks: tuple[int, ...]
    modality_scale: float
    """Modality-isolation guidance (1: off)."""
    guidance_rescale: float
    use_cross_timestep: bool
    """LTX-2.3's cross-modal timestep (``False``: LTX-2's legacy behaviour)."""


RECIPES = {
    "LTX-2": Recipe("LTX-2", 40, 4.0, None, 0.0, (), 1.0, 0.0, False),
    "LTX-2.3": Recipe("LTX-2.3", 30, 3.0, 7.0, 1.0, (28,), 3.0, 0.7, True),
}
"""LTX-2: its card's diffusers recipe (40 steps, guidance 4.0). LTX-2.3: diffusers' documented
recommendation for 2.3 (30 steps, guidance 3.0, audio 7.0, STG 1.0 at block 28, modality 3.0,
rescale 0.7)."""


def ltx2_cp_plan() -> dict:
    """Diffusers' ``LTX2VideoTransformer3DModel._cp_plan`` plus the per-token video ``timestep``
    (``(B, S)``) that image-to-video passes (the conditioned first frame's tokens are at time 0): split
    with the video tokens. Text-to-video's ``(B,)`` timestep is not split (the plan names 2 dims)."""
    from diffusers import LTX2VideoTransformer3DModel
    from diffusers.models._modeling_parallel import ContextParallelInput

    plan = dict(LTX2VideoTransformer3DModel._cp_plan)
    plan[""] = {**plan[""], "timestep": ContextParallelInput(split_dim=1, expected_dims=2, split_output=False)}
    return plan


TINY_VAE_CONFIG = dict(
    latent_channels=8,
    block_out_channels=(8, 16, 32, 64),
    decoder_block_out_channels=(8, 16, 32),
    layers_per_block=(1, 1, 1, 1, 1),
    decoder_layers_per_block=(1, 1, 1, 1),
    spatial_compression_ratio=32,
    temporal_compression_ratio=8,
)
"""The tiny checkpoint's ``AutoencoderKLLTX2Video`` (32x in space, 8x in time, as released)."""


def build_tiny_ltx2():
    """The tiny ``LTX2Pipeline`` in memory (call under a seed; ``TinyCheckpoint`` does)."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    tokenizer = tokenizers.gemma_tokenizer(model_max_length=1024)
    text = Gemma3TextConfig(
        vocab_size=tokenizers.GEMMA_VOCAB_SIZE,
        hidden_size=TEXT_DIM,
        intermediate_size=64,
        num_hidden_layers=TEXT_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=16,
        max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    vision = SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4)
    text_encoder = Gemma3ForConditionalGeneration(config).eval()
    transformer = LTX2VideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        audio_in_channels=8,
        audio_out_channels=8,
        audio_num_attention_heads=2,
        audio_attention_head_dim=8,
        audio_cross_attention_dim=16,
        num_layers=1,
        caption_channels=TEXT_DIM,
        rope_type="split",
    ).eval()
    connectors = LTX2TextConnectors(
        caption_channels=TEXT_DIM,
        text_proj_in_factor=TEXT_LAYERS + 1,
        video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=16,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=REGISTERS,
        audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=16,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=REGISTERS,
        rope_type="split",
    ).eval()
    vae = AutoencoderKLLTX2Video(**TINY_VAE_CONFIG).eval()
    # base_channels = latent_channels x mel_bins / 4: the latents' normalisation statistics
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=8, ch_mult=(1, 2, 4), num_res_blocks=1, latent_channels=2, mel_bins=16, resolution=32
    ).eval()
    vocoder = LTX2Vocoder(
        in_channels=2 * 16, hidden_channels=64, out_channels=2, resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]]
    ).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(  # the released scheduler config
        use_dynamic_shifting=True,
        base_shift=0.95,
        max_shift=2.05,
        base_image_seq_len=1024,
        max_image_seq_len=4096,
        shift_terminal=0.1,
        time_shift_type="exponential",
    )
    return LTX2Pipeline(
        scheduler=scheduler,
        vae=vae,
        audio_vae=audio_vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        connectors=connectors,
        transformer=transformer,
        vocoder=vocoder,
    )


TINY_LTX2 = TinyCheckpoint(name="tiny-ltx-2-v1", seed=20250705, build=build_tiny_ltx2, ref=f"{__name__}:TINY_LTX2")


class LTX2T2VPipeline(DiffusersBatchPipeline):
    """LTX-2 / LTX-2.3 text-to-video with audio; a merged batch is one ``LTX2Pipeline`` call."""

    family = "ltx-2"
    task = "t2v"
    num_frames_rule = (8, 1)
    params_type = LTX2Params
    diffusers_class = "LTX2Pipeline"
    model_id_hints = ("LTX-2",)
    """``Lightricks/LTX-2``, ``diffusers/LTX-2.3-Diffusers`` and renamed copies (``LTX-2.3`` contains it)."""
    checkpoint = TINY_LTX2
    builtin_name = "tiny/ltx-2"
    cp_plan = f"{__name__}:ltx2_cp_plan"
    upload_fields = ("image",)
    max_images = 1
    """An optional first frame: a batch with one runs ``LTX2ImageToVideoPipeline`` over the same
    components (each request its own image; only requests that all have one, or all have none, merge:
    ``image_sizes`` is in the batch key)."""
    size_multiple = 32
    default_steps = RECIPES["LTX-2"].steps
    default_guidance = RECIPES["LTX-2"].guidance
    max_sequence_length = 1024
    max_sequence_length_limit = 1024
    output_kind = "video"
    output_audio = True
    honoured_settings = DiffusersBatchPipeline.honoured_settings | {
        "vae.use_parallel_decode",
        "vae.parallel_decode_mode",
    }
    """Also the parallel decode settings (``ltx2_decode.install`` reads them)."""
    unsupported_reasons = VIDEO_VAE_REASONS

    def __init__(self, pipe, ctx) -> None:
        from tilecast.runtime.models.families import ltx2_decode  # imports diffusers' LTX-2 video VAE

        super().__init__(pipe, ctx)
        self.parallel_decode = ltx2_decode.install(pipe.vae, ctx, self.family)
        """Whether the video VAE decode is split by rows across the decode group (``ltx2_decode``)."""
        self.recipe = RECIPES[self.version_of(pipe)]
        """The card recipe of the loaded checkpoint."""
        self.default_steps = self.recipe.steps
        self.default_guidance = self.recipe.guidance
        self.audio_sample_rate = int(pipe.vocoder.config.output_sampling_rate)
        self.registers = pipe.connectors.config.video_connector_num_learnable_registers or 1
        """Text lengths must be multiples of this (the connectors replace padding by these registers)."""
        self.min_side = 2 * pipe.vae_spatial_compression_ratio
        """Smallest width and height: two latent rows and columns (the decoder's reflection padding)."""
        from diffusers import LTX2ImageToVideoPipeline
        from diffusers.pipelines.ltx2.utils import resolve_default_image_crf

        self.i2v = LTX2ImageToVideoPipeline(**pipe.components)
        """Image-to-video over the same modules (no second copy of any weight)."""
        self.i2v.set_progress_bar_config(disable=True)
        self.image_crf = resolve_default_image_crf(pipe.text_encoder)
        """The H.264 CRF an input image is re-compressed at, as in training (33 with Gemma 3)."""

    @staticmethod
    def version_of(pipe) -> str:
        """``LTX-2.3`` when the connectors project per modality (LTX-2.3's text path), else ``LTX-2``."""
        return "LTX-2.3" if pipe.connectors.config.get("per_modality_projections", False) else "LTX-2"

    def validate(self, params) -> None:
        if not 1 <= params.num_frames <= MAX_FRAMES or (params.num_frames - 1) % 8:
            raise ValueError(f"num_frames must be 8k+1 in 1..{MAX_FRAMES} for {self.family}, got {params.num_frames}")
        if not 1 <= params.fps <= 120:
            raise ValueError(f"fps must be in 1..120, got {params.fps}")
        for field in ("width", "height"):
            if getattr(params, field) < self.min_side:
                raise ValueError(
                    f"{field} must be at least {self.min_side} for {self.family}, got {getattr(params, field)}"
                )
        length = params.max_sequence_length
        if length is not None and length % self.registers:
            raise ValueError(
                f"max_sequence_length must be a multiple of {self.registers} for {self.family} (its text "
                f"connectors' learnable registers), got {length}"
            )

    def pipe_for(self, items):
        return self.i2v if items[0].params.image_sizes else self.pipe

    def image_kwargs(self, items) -> dict:
        """Each request's first frame, re-compressed at the card's CRF here (diffusers does it only
        for a single image), as a list the image-to-video pipeline pairs with the prompts."""
        if not items[0].params.image_sizes:
            return {}
        import numpy as np
        from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf
        from PIL import Image

        frames = [images.load_images(item.uploads)[0].convert("RGB") for item in items]
        frames = [Image.fromarray(apply_image_conditioning_crf(np.array(f), self.image_crf)) for f in frames]
        return {"image": frames, "image_crf": 0}

    def health_request(self):
        """One denoising step of the smallest video (the card's default size would take long)."""
        return {
            "prompt": "health check",
            "num_inference_steps": 1,
            "seed": 0,
            "width": self.min_side,
            "height": self.min_side,
            "num_frames": 9,
        }, {}

    def guidance_kwargs(self, params) -> dict:
        """The recipe's guidance arguments; all off when ``guidance_scale`` <= 1."""
        recipe = self.recipe
        if not self.guidance_on(params):
            return dict(
                guidance_scale=1.0,
                audio_guidance_scale=1.0,
                stg_scale=0.0,
                audio_stg_scale=0.0,
                modality_scale=1.0,
                audio_modality_scale=1.0,
                guidance_rescale=0.0,
                audio_guidance_rescale=0.0,
                spatio_temporal_guidance_blocks=None,
            )
        return dict(
            guidance_scale=params.guidance_scale,
            audio_guidance_scale=recipe.audio_guidance if recipe.audio_guidance is not None else params.guidance_scale,
            stg_scale=recipe.stg_scale,
            audio_stg_scale=recipe.stg_scale,
            modality_scale=recipe.modality_scale,
            audio_modality_scale=recipe.modality_scale,
            guidance_rescale=recipe.guidance_rescale,
            audio_guidance_rescale=recipe.guidance_rescale,
            spatio_temporal_guidance_blocks=list(recipe.stg_blocks) or None,
        )

    def card_kwargs(self, params) -> dict:
        """Every ``LTX2Pipeline`` argument this family sets beyond size, steps, text length and
        output type: frames, frame rate, the recipe (what a direct diffusers call needs to match)."""
        return dict(
            num_frames=params.num_frames,
            frame_rate=float(params.fps),
            use_cross_timestep=self.recipe.use_cross_timestep,
            **self.guidance_kwargs(params),
        )

    def call_kwargs(self, params) -> dict:
        return {**super().call_kwargs(params), **self.card_kwargs(params)}
