"""HunyuanVideo and FastHunyuan text-to-video (``HunyuanVideoPipeline``) and the built-in tiny checkpoint
``tiny/hunyuanvideo``.

One declaration serves both releases, ``hunyuanvideo-community/HunyuanVideo`` (diffusers' layout of
Tencent's weights) and FastVideo's consistency-distilled ``FastVideo/FastHunyuan-diffusers``: the
same pipeline and networks; they differ in their sampling defaults only.

The tiny checkpoint keeps the real structure with every size shrunk: the causal 3D
``AutoencoderKLHunyuanVideo`` (8x spatial, 4x temporal, 16 latent channels, mid-block attention),
a ``HunyuanVideoTransformer3DModel`` (token refiner on the text, dual-stream then single-stream
blocks on 1x2x2 patches, guidance embedding, 3D rotary positions), a ``LlamaModel`` text encoder
whose third-to-last hidden state conditions the transformer (three layers here, so that is layer
1's output) and a ``CLIPTextModel`` whose pooled output is the second conditioning, and the
flow-matching Euler scheduler with the release's shift 7. The Llama tokenizer is built offline
(``tokenizers.llama3_tokenizer``): Llama 3's pre-tokenizer and byte-level alphabet with the words of
the pipeline's prompt template as whole tokens, so the template's system part is exactly the 95
tokens the pipeline crops (``crop_start``), as with the released Llama 3 tokenizer; the prompt's
own words fall back to bytes.

Defaults (per row, set at load from the model id, ``--model-id`` or the path's name):
HunyuanVideo 50 steps at ``guidance_scale`` 6.0 with the checkpoint's scheduler shift (7.0), as
Tencent's release and diffusers' example; FastHunyuan 6 steps at 6.0 with shift 17 (its model card:
"setting the shift to 17 and steps to 6"; FastVideo's and SGLang's FastHunyuan configs). Both: 256
text tokens (diffusers' default, the release's text length), 24 fps. ``guidance_scale`` is the
transformer's *embedded* guidance (HunyuanVideo is guidance-distilled): no classifier-free guidance
runs, so ``negative_prompt`` and ``true_cfg_scale`` are refused. SGLang's ``flow_shift`` sets the
scheduler's shift for the batch. ``num_frames`` must be ``4k + 1`` (the VAE's temporal factor).

Ranks: Ulysses and Ring run tilecast's plan (``hunyuan_video_cp_plan``; diffusers 0.42 ships none
for ``HunyuanVideoTransformer3DModel``): the token refiner runs on the whole text on every rank,
then the video tokens and the text are split over the ranks for the dual- and single-stream blocks
(joint ``[video, text]`` attention across the ranks, the text's padding masked) and the video
gathered after the output projection. 2 and 4 gloo ranks match one rank within 4e-6.
``--vae-config.use-parallel-decode`` splits the VAE decode by row bands across the decode group
(``hunyuan_decode``: halo rows for the causal convs, group-norm statistics combined across the
bands, the mid block's attention on the gathered map).
"""

from __future__ import annotations

import logging

from tilecast.runtime.models.families import common, flux, tokenizers
from tilecast.runtime.models.families.common import DiffusersBatchPipeline, T2VParams, TinyCheckpoint

logger = logging.getLogger(__name__)

TEXT_DIM = flux.TEXT_DIM
"""Hidden size of both tiny text encoders (the transformer's ``text_embed_dim`` and ``pooled_projection_dim``)."""
MAX_FRAMES = 257
"""Longest video a request may ask for."""
BASE_STEPS, BASE_GUIDANCE = 50, 6.0
"""HunyuanVideo's steps and embedded guidance (Tencent's release; diffusers' default guidance)."""
FAST_STEPS, FAST_GUIDANCE, FAST_SHIFT = 6, 6.0, 17.0
"""FastHunyuan's steps, embedded guidance and scheduler shift (its model card; FastVideo's config)."""
FAST_HINT = "fasthunyuan"
"""What names the FastHunyuan row in a model id or directory name (case-insensitive)."""


def prompt_template_words() -> list[str]:
    """The byte-level words of ``HunyuanVideoPipeline``'s default prompt template (the tiny Llama
    tokenizer keeps them whole)."""
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    return tokenizers.llama3_words(DEFAULT_PROMPT_TEMPLATE["template"].replace("{}", ""))


def build_tiny_hunyuan_video():
    """The tiny ``HunyuanVideoPipeline`` in memory (call under a seed; ``TinyCheckpoint`` does)."""
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideoPipeline,
        HunyuanVideoTransformer3DModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel

    words = prompt_template_words()
    tokenizer = tokenizers.llama3_tokenizer(words=words)
    text_encoder = LlamaModel(
        LlamaConfig(
            vocab_size=tokenizers.llama3_vocab_size(words),
            hidden_size=TEXT_DIM,
            intermediate_size=64,
            num_hidden_layers=3,  # the pipeline reads hidden_states[-3]: layer 1's output
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=2048,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    ).eval()
    clip_tokenizer = tokenizers.clip_tokenizer()
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=tokenizers.CLIP_VOCAB_SIZE,
            bos_token_id=clip_tokenizer.bos_token_id,
            eos_token_id=clip_tokenizer.eos_token_id,
            pad_token_id=clip_tokenizer.pad_token_id,
            **flux.TINY_OVERRIDES["text_encoder"],
            max_position_embeddings=77,
        )
    ).eval()
    transformer = HunyuanVideoTransformer3DModel(
        in_channels=16,
        out_channels=16,
        **common.TINY_DIT,
        num_single_layers=1,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        patch_size=2,
        patch_size_t=1,
        text_embed_dim=TEXT_DIM,
        pooled_projection_dim=TEXT_DIM,
        rope_axes_dim=common.TINY_ROPE_AXES,
    ).eval()
    vae = AutoencoderKLHunyuanVideo(
        latent_channels=16, block_out_channels=(8, 16, 16, 16), layers_per_block=1, norm_num_groups=8
    ).eval()
    return HunyuanVideoPipeline(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=clip,
        tokenizer_2=clip_tokenizer,
    )


TINY_HUNYUAN_VIDEO = TinyCheckpoint(
    name="tiny-hunyuanvideo-v1",
    seed=20250708,
    build=build_tiny_hunyuan_video,
    ref=f"{__name__}:TINY_HUNYUAN_VIDEO",
)


def hunyuan_video_cp_plan() -> dict:
    """``HunyuanVideoTransformer3DModel``'s context-parallel plan, in diffusers' ``_cp_plan`` form
    (diffusers 0.42 ships none). The token refiner runs on the whole text first; the video tokens
    and the refined text are split at the first dual-stream block, the rotary tables at every block,
    and the video tokens gathered after ``proj_out`` (the text's last state is not used). The
    attention layers join ``[video shard, text shard]`` across the ranks
    (``sp_attention.HunyuanVideoSequenceParallelProcessor``), the text's padding masked."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    tokens = ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)
    rope = (ContextParallelInput(split_dim=0, expected_dims=2, split_output=False),) * 2  # (cos, sin): (S, D)
    return {
        "transformer_blocks.0": {"hidden_states": tokens, "encoder_hidden_states": tokens},
        "transformer_blocks.*": {"freqs_cis": rope},
        "single_transformer_blocks.*": {"image_rotary_emb": rope},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


def _text_only_processor():
    """diffusers' ``AttnProcessor2_0`` under its own name, for the token refiner's self-attention on
    the text alone: under Ulysses / Ring it stays as it is (``sp_attention.ReplicatedAttnProcessor``)."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    class TextOnlyAttnProcessor(AttnProcessor2_0):
        pass

    return TextOnlyAttnProcessor()


class HunyuanVideoParams(T2VParams, forbid_unknown_fields=True, kw_only=True):
    """A HunyuanVideo request: ``T2VParams`` at the release's 24 fps."""

    fps: int = 24
    """Frame rate of the written video (HunyuanVideo and FastHunyuan are trained at 24 fps)."""


class HunyuanVideoT2VPipeline(DiffusersBatchPipeline):
    """HunyuanVideo / FastHunyuan T2V; a merged batch is one ``HunyuanVideoPipeline`` call (see
    ``families.common``). The class defaults are HunyuanVideo's; FastHunyuan's replace them at load."""

    family = "hunyuanvideo"
    task = "t2v"
    num_frames_rule = (4, 1)
    params_type = HunyuanVideoParams
    diffusers_class = "HunyuanVideoPipeline"
    checkpoint = TINY_HUNYUAN_VIDEO
    builtin_name = "tiny/hunyuanvideo"
    model_id_hints = ("FastHunyuan", "HunyuanVideo")
    """``FastVideo/FastHunyuan-diffusers`` and ``hunyuanvideo-community/HunyuanVideo``, case-insensitively."""
    cp_plan = f"{__name__}:hunyuan_video_cp_plan"
    size_multiple = 16
    """The VAE's 8x on 2x2 patches."""
    default_steps = BASE_STEPS
    default_guidance = BASE_GUIDANCE
    max_sequence_length = 256
    """Llama tokens after the template's cropped system part (diffusers' default, the release's)."""
    output_kind = "video"
    per_request_fields = DiffusersBatchPipeline.per_request_fields + ("fps",)
    """``fps`` only stamps the written file, so requests with different rates still merge."""
    honoured_settings = DiffusersBatchPipeline.honoured_settings | {
        "vae.use_parallel_decode",
        "vae.parallel_decode_mode",
    }
    """Also the parallel decode settings (``hunyuan_decode.install`` reads them)."""
    unsupported_reasons = common.VIDEO_VAE_REASONS

    @classmethod
    def install_fast_paths(cls, pipe, settings) -> None:
        """The token refiner's attention layers get ``TextOnlyAttnProcessor`` (the same computation),
        which Ulysses / Ring leave as it is; then the base ``--compile``."""
        for module in pipe.transformer.context_embedder.modules():
            if hasattr(module, "set_processor"):
                module.set_processor(_text_only_processor())
        super().install_fast_paths(pipe, settings)

    @classmethod
    def load(cls, model_path: str, ctx) -> "HunyuanVideoT2VPipeline":
        """The base ``load``; a FastHunyuan checkpoint (named so by ``--model-id`` or its path) takes
        FastHunyuan's defaults and scheduler shift."""
        pipeline = super().load(model_path, ctx)
        name = getattr(ctx.settings, "model_id", None) or model_path
        if FAST_HINT in str(name).lower():
            pipeline.use_fast_hunyuan_defaults()
        return pipeline

    def __init__(self, pipe, ctx) -> None:
        from tilecast.runtime.models.families import hunyuan_decode  # imports diffusers' HunyuanVideo VAE

        super().__init__(pipe, ctx)
        self.parallel_decode = hunyuan_decode.install(pipe.vae, ctx, self.family)
        """Whether the VAE decode is split by rows across the decode group (``hunyuan_decode``)."""
        self.row = "HunyuanVideo"
        """Which release's defaults this instance serves (``HunyuanVideo`` or ``FastHunyuan``)."""

    def use_fast_hunyuan_defaults(self) -> None:
        """FastHunyuan's 6 steps at embedded guidance 6.0, on the scheduler with shift 17."""
        scheduler = self.pipe.scheduler
        self.pipe.scheduler = type(scheduler).from_config(scheduler.config, shift=FAST_SHIFT)
        self.default_steps, self.default_guidance, self.row = FAST_STEPS, FAST_GUIDANCE, "FastHunyuan"

    flow_shift_field = "shift"
    """SGLang's ``flow_shift`` is the flow-matching Euler scheduler's ``shift`` here."""

    def guidance_on(self, params) -> bool:
        return False  # guidance-distilled: guidance_scale is an embedding, not CFG

    def no_guidance_reason(self, params) -> str:
        return f"{self.row} is guidance-distilled (guidance_scale is embedded) and runs no classifier-free guidance"

    def validate(self, params) -> None:
        if not 1 <= params.num_frames <= MAX_FRAMES or (params.num_frames - 1) % 4:
            raise ValueError(f"num_frames must be 4k+1 in 1..{MAX_FRAMES} for {self.family}, got {params.num_frames}")
        if not 1 <= params.fps <= 120:
            raise ValueError(f"fps must be in 1..120, got {params.fps}")

    def call_kwargs(self, params) -> dict:
        return {**super().call_kwargs(params), "num_frames": params.num_frames}
