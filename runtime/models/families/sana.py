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

Ranks: ``sana_cp_plan`` splits the image tokens over the Ulysses x Ring ranks at the first block
and gathers them after ``proj_out``; the text stays whole on every rank. Two parts of a SANA block
need more than a plan's split and gather: the self-attention is linear, so each query reads sums
over *all* keys (``K^T V`` and ``sum K``): ``sp_attention.SanaLinearSequenceParallelProcessor``
all-reduces them (neither Ulysses' head exchange nor Ring's softmax merge); and the Mix-FFN
reshapes the tokens to the ``height x width`` grid for a 3x3 depthwise convolution, so on a shard
it needs the rows around its tokens: ``install_sequence_parallel_ffn`` fetches the neighbouring
shards' edge tokens (two rows' worth, one all-gather each way) and convolves the shard's rows
plus one row above and below (shards of two rows or less gather the whole sequence instead).
Cross-attention runs on the local queries. Padded tokens (token counts that do not divide the
degree) add nothing to the sums and are outside every convolution. The Ulysses and Ring degrees
only size the group here; the Ulysses degree must still divide the heads, as for every family
(70 on the 1.6B and 4.8B transformers, 36 on the 600M). Not measured on GPUs: the all-gathers
of edge rows are small, the all-reduce is ``heads x (D+1) x D`` per attention layer.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import msgspec
import torch

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


def sana_cp_plan() -> dict:
    """``SanaTransformer2DModel``'s context-parallel plan, in diffusers' ``_cp_plan`` form (diffusers
    ships none for SANA): the image tokens are split entering the first block and gathered after
    the output projection (the smallest tensor). It runs with ``install_sequence_parallel_ffn``
    (the Mix-FFN's convolution) and SANA's processors in ``sp_attention`` (see the module docstring)."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    return {
        "transformer_blocks.0": {
            "hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)
        },
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


def install_sequence_parallel_ffn(transformer, state) -> None:
    """Make every block's Mix-FFN run on this rank's token shard (``state``: the transformer's
    ``SequenceState``). Each block's ``height``/``width`` arguments become ``1 x shard length`` (the
    block reshapes its shard with them) and its ``ff`` learns the true grid from them; the ``ff``'s
    own forward then runs on the rows around the shard (``_shard_ffn``)."""
    for block in transformer.transformer_blocks:
        grid: dict[str, int] = {}

        def pre_hook(module, args, kwargs, grid=grid):
            args = list(args)
            local_len = (args[0] if args else kwargs["hidden_states"]).shape[1]
            for index, name, value in ((5, "height", 1), (6, "width", local_len)):
                if name in kwargs:
                    grid[name], kwargs[name] = kwargs[name], value
                else:
                    grid[name], args[index] = args[index], value
            return tuple(args), kwargs

        block.register_forward_pre_hook(pre_hook, with_kwargs=True)
        block.ff.forward = functools.partial(_shard_ffn, block.ff, grid, state)


def _shard_ffn(ff, grid: dict[str, int], state, x_BC1L: torch.Tensor) -> torch.Tensor:
    """``ff`` (``GLUMBConv``: 1x1, depthwise 3x3, 1x1 convolutions) on this rank's ``L`` tokens of
    the ``height x width`` grid, given as ``(B, C, 1, L)``. Runs ``ff``'s own forward on the full
    rows from one above the shard's first token to one below its last (zero rows at the image's
    edges, as the convolution's padding), then keeps the shard's tokens; padded tokens get zeros."""
    height, width = grid["height"], grid["width"]
    tokens_BLC = x_BC1L.flatten(2).transpose(1, 2)
    batch, local_len, _ = tokens_BLC.shape
    window_BWC, window_start = _window(tokens_BLC, width, state)
    start, true_len = state.parallel.sp_rank * local_len, height * width
    real = max(0, min(local_len, true_len - start))
    out_BLC = tokens_BLC.new_zeros(batch, local_len, ff.conv_point.out_channels)
    if real:
        first_row, last_row = max(start // width - 1, 0), min((start + real - 1) // width + 1, height - 1)
        rows_BLC = window_BWC[:, first_row * width - window_start : (last_row + 1) * width - window_start]
        rows_BCHW = rows_BLC.unflatten(1, (last_row - first_row + 1, width)).permute(0, 3, 1, 2)
        done_BLC = type(ff).forward(ff, rows_BCHW).flatten(2).transpose(1, 2)
        offset = start - first_row * width
        out_BLC[:, :real] = done_BLC[:, offset : offset + real]
    return out_BLC.transpose(1, 2).unsqueeze(2)


def _window(tokens_BLC: torch.Tensor, width: int, state) -> tuple[torch.Tensor, int]:
    """This rank's tokens with up to two rows of the neighbouring shards' tokens on each side, and
    the global index of the first. Every rank issues the same all-gathers (shard lengths are equal)."""
    from tilecast.kernels.collectives import gather_sequence

    parallel, local_len = state.parallel, tokens_BLC.shape[1]
    num, rank, edge = parallel.sp_size, parallel.sp_rank, min(tokens_BLC.shape[1], 2 * width)
    heads_BNC = gather_sequence(tokens_BLC[:, :edge], 1, parallel, num * edge)
    if edge == local_len:  # shards of at most two rows: the heads are the whole sequence
        return heads_BNC, 0
    tails_BNC = gather_sequence(tokens_BLC[:, local_len - edge :], 1, parallel, num * edge)
    before = tails_BNC[:, (rank - 1) * edge : rank * edge] if rank > 0 else tokens_BLC[:, :0]
    after = heads_BNC[:, (rank + 1) * edge : (rank + 2) * edge] if rank < num - 1 else tokens_BLC[:, :0]
    return torch.cat([before, tokens_BLC, after], dim=1), rank * local_len - before.shape[1]


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
    cp_plan = f"{__name__}:sana_cp_plan"

    @classmethod
    def load(cls, model_path: str, ctx) -> "SanaT2IPipeline":
        """The base ``load``; under Ulysses / Ring the Mix-FFN also learns to run on a token shard."""
        pipeline = super().load(model_path, ctx)
        state = getattr(pipeline.pipe.transformer, "_tilecast_sequence_parallel", None)
        if state is not None:
            install_sequence_parallel_ffn(pipeline.pipe.transformer, state)
        return pipeline

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
