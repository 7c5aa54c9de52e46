"""SANA and SANA 1.5 text-to-image (``SanaPipeline``) and the built-in tiny checkpoint ``tiny/sana-1.5-1.6b``.

One declaration serves the six released ``SanaPipeline`` checkpoints: SANA 1.5 1.6B and 4.8B
(1024px), SANA 1600M and 600M at 1024px and at 512px. They share the pipeline, the text encoder,
the autoencoder, the scheduler and the sampling defaults; they differ in transformer size, in
SANA 1.5's q/k RMS norms, and in the resolution they were trained at, which each checkpoint
carries in its transformer config (``sample_size``: latent pixels per side, 32 or 16).

The tiny checkpoint keeps SANA 1.5 1.6B's structure with every size shrunk: a
``SanaTransformer2DModel`` on 1x1 patches of 32 latent channels (linear ReLU self-attention with
q/k RMS norms across heads, softmax cross-attention to the text, the Mix-FFN's 3x3 depthwise
convolution over the latent grid, no positional embedding), a deep-compression ``AutoencoderDC``
(32x: six stages, three ResBlock then three EfficientViT stages, as DC-AE f32c32), a
``Gemma2Model`` text encoder whose last hidden state conditions the transformer, with a
character-level ``GemmaTokenizer`` built offline (``tokenizers.gemma_tokenizer``: ``<bos>`` first,
right padding), and the flow DPM-Solver (``DPMSolverMultistepScheduler``, flow sigmas, shift 3).
``SanaPipeline`` prefixes every prompt with its complex human instruction (diffusers' default,
kept: as the release runs) and keeps ``<bos>`` plus the last ``max_sequence_length - 1`` tokens.

Defaults (the same for all six rows): 20 steps at ``guidance_scale`` 4.5, 300 text tokens, as the
SANA model cards' diffusers example and ``SanaPipeline.__call__``; classifier-free guidance with
each request's ``negative_prompt`` (default ``""``). A request without ``width``/``height`` gets
the checkpoint's own resolution, ``sample_size x 32`` from its transformer config (1024 or 512;
64 for the tiny one): the one place the rows differ. The requested size is generated as is
(multiples of 32): diffusers' aspect-ratio binning, which would generate at the nearest trained
shape and resize, is off, so a request's pixels are the ones denoised.

Ranks: ``cp_plan`` is None (DP only; Ulysses and Ring are refused at start-up). A token split
would need more than a plan's split and gather hooks: SANA's self-attention is linear (each
query reads sums over *all* keys, ``K^T V`` and ``sum K``: an all-reduce, neither Ulysses' head
exchange nor Ring's softmax merge, which tilecast's attention kernels run), and the Mix-FFN
unflattens the tokens to the full ``height x width`` grid for a 3x3 convolution, which on a shard
needs the neighbours' boundary rows (a halo exchange) and the shard's own height.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from tilecast.runtime.models.families import common, tokenizers
from tilecast.runtime.models.families.common import DiffusersBatchPipeline, T2IParams, TinyCheckpoint

logger = logging.getLogger(__name__)

TEXT_DIM = 32
"""Hidden size of the tiny Gemma 2 text encoder (the transformer's ``caption_channels``)."""
LATENT_CHANNELS = 32
"""DC-AE f32c32's latent channels, as released."""


def build_tiny_sana():
    """The tiny ``SanaPipeline`` in memory (call under a seed; ``TinyCheckpoint`` does)."""
    from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    tokenizer = tokenizers.gemma_tokenizer()
    text_encoder = Gemma2Model(
        Gemma2Config(
            vocab_size=tokenizers.GEMMA_VOCAB_SIZE,
            hidden_size=TEXT_DIM,
            intermediate_size=64,
            num_hidden_layers=2,  # one sliding-window and one global layer, as Gemma 2 alternates them
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            query_pre_attn_scalar=16,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    ).eval()
    heads, head_dim = common.TINY_DIT["num_attention_heads"], common.TINY_DIT["attention_head_dim"]
    transformer = SanaTransformer2DModel(
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        **common.TINY_DIT,
        num_cross_attention_heads=heads,
        cross_attention_head_dim=head_dim,
        cross_attention_dim=heads * head_dim,
        caption_channels=TEXT_DIM,
        sample_size=2,  # 2 latent pixels x 32: a 64-pixel default resolution (the releases: 32 or 16)
        patch_size=1,
        qk_norm="rms_norm_across_heads",  # SANA 1.5's (the 1.0 checkpoints have none)
    ).eval()
    stages = ("ResBlock",) * 3 + ("EfficientViTBlock",) * 3
    vae = AutoencoderDC(
        latent_channels=LATENT_CHANNELS,
        attention_head_dim=8,
        encoder_block_types=stages,
        decoder_block_types=stages,
        encoder_block_out_channels=(8, 8, 16, 16, 32, 32),
        decoder_block_out_channels=(8, 8, 16, 16, 32, 32),
        encoder_layers_per_block=(1,) * 6,
        decoder_layers_per_block=(1,) * 6,
        encoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)),
        decoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)),
        upsample_block_type="interpolate",
        downsample_block_type="Conv",
        decoder_norm_types=("batch_norm",) * 3 + ("rms_norm",) * 3,
        decoder_act_fns=("relu",) * 3 + ("silu",) * 3,
        scaling_factor=0.41407,
    ).eval()
    scheduler = DPMSolverMultistepScheduler(flow_shift=3.0, use_flow_sigmas=True, prediction_type="flow_prediction")
    return SanaPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=scheduler
    )


TINY_SANA = TinyCheckpoint(
    name="tiny-sana-1.5-1.6b-v1", seed=20250705, build=build_tiny_sana, ref=f"{__name__}:TINY_SANA"
)


class SanaT2IParams(T2IParams, forbid_unknown_fields=True, kw_only=True):
    """A SANA request: ``T2IParams`` whose size defaults to the checkpoint's own resolution."""

    width: int | None = None
    """Output width in pixels, a multiple of 32 (default: the checkpoint's resolution, 1024 or 512)."""
    height: int | None = None
    """Output height in pixels, a multiple of 32 (default: the checkpoint's resolution, 1024 or 512)."""


class SanaT2IPipeline(DiffusersBatchPipeline):
    """SANA / SANA 1.5 T2I; a merged batch is one ``SanaPipeline`` call (see ``families.common``)."""

    family = "sana"
    task = "t2i"
    params_type = SanaT2IParams
    diffusers_class = "SanaPipeline"
    checkpoint = TINY_SANA
    builtin_name = "tiny/sana-1.5-1.6b"
    model_id_hints = (
        "SANA1.5_1.6B_1024px",
        "SANA1.5_4.8B_1024px",
        "Sana_1600M_1024px",
        "Sana_600M_1024px",
        "Sana_1600M_512px",
        "Sana_600M_512px",
    )
    """The released checkpoints (``Efficient-Large-Model/<hint>_diffusers``), matched case-insensitively."""
    size_multiple = 32
    """DC-AE's 32x compression on 1x1 patches (every release)."""
    default_steps = 20
    default_guidance = 4.5
    max_sequence_length = 300
    """``SanaPipeline``'s text window after the complex human instruction (diffusers' default, as trained)."""

    def __init__(self, pipe, ctx) -> None:
        super().__init__(pipe, ctx)
        self.native_size = pipe.transformer.config.sample_size * pipe.vae_scale_factor
        """The checkpoint's own resolution: what a request without ``width``/``height`` gets."""

    @classmethod
    def install_fast_paths(cls, pipe, settings) -> None:
        """``--compile``: diffusers' regional compilation of the blocks (``SanaTransformer2DModel``
        declares no ``_repeated_blocks`` in diffusers 0.42; they are named here)."""
        pipe.transformer._repeated_blocks = ["SanaTransformerBlock"]
        super().install_fast_paths(pipe, settings)

    def prepare(self, params, uploads: dict[str, bytes]):
        sizes = {field: self.native_size for field in ("width", "height") if getattr(params, field) is None}
        return super().prepare(msgspec.structs.replace(params, **sizes) if sizes else params, uploads)

    def call_kwargs(self, params) -> dict[str, Any]:
        """The base arguments, with aspect-ratio binning off: the requested size is the generated one."""
        return {**super().call_kwargs(params), "use_resolution_binning": False}
