"""FLUX's serving fast paths: tilecast's attention kernel and fused projections.

``install_fast_paths(transformer, backend=...)`` changes a loaded ``FluxTransformer2DModel`` in
place, keeping its weights and its function:

- every ``FluxAttention`` gets a ``FluxDenseAttnProcessor``: diffusers' ``FluxAttnProcessor``
  computation (projections, per-head RMS norms, joint text+image sequence, rotary embedding) with
  the attention itself from ``tilecast.kernels.attention``, so ``--attention-backend`` applies and
  ``auto`` picks the fastest kernel (cuDNN SDPA on Hopper; PyTorch's default SDPA there is its
  flash kernel, 0.6-0.7x as fast at FLUX's head dim 128);
- the query/key/value projections of each attention (and the text stream's) become one matrix
  multiply (diffusers' ``fuse_qkv_projections``); the separate weights are then dropped, so the
  model's memory does not grow;
- each feed-forward's first linear layer and the single blocks' MLP projection take their GELU
  into the matrix multiply (``tilecast.kernels.gelu_linear.GeluLinear``: cuBLASLt's epilogue on
  CUDA), so the widest activations of a block are written once, already activated, not written,
  read back and written again by a separate kernel;
- a single block's output projection reads the attention output and the MLP activations where
  they are (``ConcatInputLinear`` in ``single_block_forward``) instead of copying both into one
  concatenated tensor first: one product per part, the second accumulated onto the first in place
  (``linear_of_parts``; opaque to Inductor, whose ``addmm`` would copy the first product first);
- every modulation layer (the blocks' and ``norm_out``'s shifts, scales and gates, all projected from
  the same ``silu(temb)``) is one product per forward (``bank_modulation``, ``families.modulation``)
  instead of 77 short memory-bound ones, each with its own SiLU; in ``FluxPipeline``'s loop, one
  product per loop (``families.flux_plan``).

With ``quantize="fp8"`` (``--quantize fp8``, opt-in), the blocks' linear layers (fused QKV,
output, feed-forward and single-block projections) become ``tilecast.kernels.fp8.Fp8Linear``: FP8
tensor cores at about twice the bf16 rate, at the cost of a few percent of each layer's output
(see that module). The modulation layers (one row per image, memory-bound: FP8 compute gains
nothing there and their scales and gates steer every token), the embedders and the final
projection stay in the model's dtype.

``--compile`` is the families' own (``DiffusersBatchPipeline.install_fast_paths``), applied after
these: Inductor then fuses the norms, modulation, rotary embedding, GELU and gated residuals that
eager PyTorch runs as separate memory-bound kernels. The first call of a new shape pays the
compile; after the first recompile the batch dimension is dynamic.

Shapes: ``x_BSC`` (batch, tokens, channels), ``q_BSHD`` (batch, tokens, heads, head dim).
"""

from __future__ import annotations

import logging
import re
import types

import torch
import torch.nn.functional as F
from diffusers.models.activations import GELU
from diffusers.models.attention import FeedForward
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.normalization import RMSNorm
from diffusers.models.transformers.transformer_flux import (
    FluxAttention,
    FluxSingleTransformerBlock,
    _get_qkv_projections,
)

from tilecast.kernels import fp8
from tilecast.kernels.attention import attention, resolve_backend
from tilecast.kernels.gelu_linear import GeluLinear
from tilecast.kernels.qk_norm_rope import qk_norm_rope
from tilecast.runtime.config import check_quantize
from tilecast.runtime.models.families import modulation

logger = logging.getLogger(__name__)


class FluxDenseAttnProcessor:
    """Drop-in processor for ``FluxAttention``: diffusers' computation, tilecast's attention kernel.

    ``backend`` is passed to ``tilecast.kernels.attention.attention`` (``None``: the fastest available).
    """

    def __init__(self, *, backend: str | None = None) -> None:
        self.backend = backend

    def __call__(
        self,
        attn: FluxAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        if attention_mask is not None:
            raise ValueError("FluxDenseAttnProcessor computes unmasked attention; got an attention_mask")
        q_BSHD, k_BSHD, v_BSHD = flux_qkv(attn, hidden_states, encoder_hidden_states, image_rotary_emb)
        out_BSHD, _lse_BHS = attention(q_BSHD, k_BSHD, v_BSHD, backend=self.backend)
        return flux_output(attn, out_BSHD, encoder_hidden_states, dtype=q_BSHD.dtype)


def flux_qkv(
    attn: FluxAttention,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """diffusers' ``FluxAttnProcessor`` up to the attention: the per-head normed queries, keys and
    values (``BSHD``) of the joint ``[text, image]`` sequence (image only in single-stream blocks),
    with the rotary embedding applied. With fused projections (the served default) the norms, the
    rotation and the joining are one pass (``kernels.qk_norm_rope``)."""
    if _one_pass(attn, encoder_hidden_states, image_rotary_emb):
        segments = [(attn.to_qkv(hidden_states), attn.norm_q.weight, attn.norm_k.weight)]
        if encoder_hidden_states is not None:  # joint block: the text tokens go first
            segments.insert(
                0, (attn.to_added_qkv(encoder_hidden_states), attn.norm_added_q.weight, attn.norm_added_k.weight)
            )
        return qk_norm_rope(segments, *image_rotary_emb, heads=attn.heads, eps=attn.norm_q.eps)
    q_BSC, k_BSC, v_BSC, text_q_BSC, text_k_BSC, text_v_BSC = _get_qkv_projections(
        attn, hidden_states, encoder_hidden_states
    )
    q_BSHD = attn.norm_q(q_BSC.unflatten(-1, (-1, attn.head_dim)))
    k_BSHD = attn.norm_k(k_BSC.unflatten(-1, (-1, attn.head_dim)))
    v_BSHD = v_BSC.unflatten(-1, (-1, attn.head_dim))
    if attn.added_kv_proj_dim is not None:  # joint block: the text tokens go first
        q_BSHD = torch.cat([attn.norm_added_q(text_q_BSC.unflatten(-1, (-1, attn.head_dim))), q_BSHD], dim=1)
        k_BSHD = torch.cat([attn.norm_added_k(text_k_BSC.unflatten(-1, (-1, attn.head_dim))), k_BSHD], dim=1)
        v_BSHD = torch.cat([text_v_BSC.unflatten(-1, (-1, attn.head_dim)), v_BSHD], dim=1)
    if image_rotary_emb is not None:
        q_BSHD = apply_rotary_emb(q_BSHD, image_rotary_emb, sequence_dim=1)
        k_BSHD = apply_rotary_emb(k_BSHD, image_rotary_emb, sequence_dim=1)
    return q_BSHD, k_BSHD, v_BSHD


def _one_pass(attn: FluxAttention, encoder_hidden_states: torch.Tensor | None, image_rotary_emb) -> bool:
    """Whether ``qk_norm_rope`` computes this call: fused projections, a rotary embedding as
    ``(cos, sin)``, and weighted RMS norms (PyTorch's, as diffusers' FLUX has them, or diffusers'
    own without a bias), all with one given epsilon."""
    if not getattr(attn, "fused_projections", False) or not isinstance(image_rotary_emb, tuple):
        return False
    norms = [attn.norm_q, attn.norm_k]
    if encoder_hidden_states is not None:
        if attn.added_kv_proj_dim is None:
            return False
        norms += [attn.norm_added_q, attn.norm_added_k]
    return all(
        isinstance(norm, (torch.nn.RMSNorm, RMSNorm))
        and norm.weight is not None
        and getattr(norm, "bias", None) is None
        and norm.eps is not None
        and norm.eps == attn.norm_q.eps
        for norm in norms
    )


def flux_output(
    attn: FluxAttention, out_BSHD: torch.Tensor, encoder_hidden_states: torch.Tensor | None, *, dtype: torch.dtype
):
    """diffusers' ``FluxAttnProcessor`` after the attention: the heads merged (in ``dtype``), and in a
    joint block the image and text tokens split apart through their output projections (``(image, text)``)."""
    out_BSC = out_BSHD.flatten(2, 3).to(dtype)
    if encoder_hidden_states is None:
        return out_BSC
    text_BSC, image_BSC = out_BSC.split_with_sizes(
        [encoder_hidden_states.shape[1], out_BSC.shape[1] - encoder_hidden_states.shape[1]], dim=1
    )
    image_BSC = attn.to_out[1](attn.to_out[0](image_BSC.contiguous()))
    return image_BSC, attn.to_add_out(text_BSC.contiguous())


_UNFUSED = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")
"""Projections that ``fuse_projections`` concatenates into ``to_qkv`` / ``to_added_qkv``."""


def fuse_projections(transformer: torch.nn.Module) -> int:
    """Fuse every ``FluxAttention``'s q/k/v projections and drop the separate ones; returns how many."""
    count = 0
    for module in transformer.modules():
        if isinstance(module, FluxAttention) and not getattr(module, "fused_projections", False):
            module.fuse_projections()
            for name in _UNFUSED:
                if hasattr(module, name):
                    delattr(module, name)
            count += 1
    return count


def fuse_gelus(transformer: torch.nn.Module) -> int:
    """Each plain linear layer followed by FLUX's tanh GELU becomes a ``GeluLinear``: the
    feed-forwards' ``net[0]`` and the single blocks' ``proj_mlp`` (whose ``act_mlp`` becomes the
    identity). Layers already replaced (FP8) are left alone. Returns how many."""
    count = 0
    for module in transformer.modules():
        if isinstance(module, FeedForward) and isinstance(module.net[0], GELU):
            if module.net[0].approximate == "tanh" and type(module.net[0].proj) is torch.nn.Linear:
                module.net[0] = GeluLinear(module.net[0].proj)
                count += 1
        elif isinstance(module, FluxSingleTransformerBlock) and type(module.proj_mlp) is torch.nn.Linear:
            if isinstance(module.act_mlp, torch.nn.GELU) and module.act_mlp.approximate == "tanh":
                module.proj_mlp, module.act_mlp = GeluLinear(module.proj_mlp), torch.nn.Identity()
                count += 1
    return count


class ConcatInputLinear(torch.nn.Module):
    """``linear(torch.cat(parts, dim=-1))`` without the concatenation: the first part's product with
    its columns of the weight (and the bias), then each further part's accumulated onto it
    (``linear_of_parts``). ``sizes``: the parts' feature counts. Weight and bias are ``linear``'s."""

    def __init__(self, linear: torch.nn.Linear, sizes: list[int]) -> None:
        super().__init__()
        if sum(sizes) != linear.in_features:
            raise ValueError(f"parts of {sizes} features do not add up to the layer's {linear.in_features}")
        self.sizes, self.out_features = list(sizes), linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, *parts: torch.Tensor) -> torch.Tensor:
        parts_MK = [part.reshape(-1, part.shape[-1]) for part in parts]
        out_MN = linear_of_parts(parts_MK, list(self.weight.split(self.sizes, dim=1)), self.bias)
        return out_MN.reshape(*parts[0].shape[:-1], self.out_features)


@torch.library.custom_op("tilecast::linear_of_parts", mutates_args=())
def linear_of_parts(parts: list[torch.Tensor], weights: list[torch.Tensor], bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(cat(parts, -1), cat(weights, 1), bias)`` for 2-D ``parts``: the first part's product
    (with the bias), each further part's accumulated onto it in place (``addmm_``). An opaque op, so
    ``--compile`` keeps it in place: Inductor's out-of-place ``addmm`` would first copy the accumulator."""
    out_MN = F.linear(parts[0], weights[0], bias)
    for part_MK, weight_NK in zip(parts[1:], weights[1:]):
        out_MN.addmm_(part_MK, weight_NK.t())
    return out_MN


@linear_of_parts.register_fake
def _linear_of_parts_shape(parts, weights, bias):
    return parts[0].new_empty(parts[0].shape[0], weights[0].shape[0])


def single_block_forward(
    self: FluxSingleTransformerBlock,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``FluxSingleTransformerBlock.forward`` with the attention output and the MLP branch fed to a
    ``ConcatInputLinear`` output projection as two parts, not concatenated (see ``split_single_blocks``)."""
    text_seq_len = encoder_hidden_states.shape[1]
    hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    residual = hidden_states
    norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
    mlp_hidden_states = self.act_mlp(self.proj_mlp(norm_hidden_states))
    attn_output = self.attn(
        hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {})
    )
    hidden_states = residual + gate.unsqueeze(1) * self.proj_out(attn_output, mlp_hidden_states)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]


def split_single_blocks(transformer: torch.nn.Module) -> int:
    """Each single block whose ``proj_out`` is a plain linear layer runs ``single_block_forward``
    with a ``ConcatInputLinear`` output projection; returns how many."""
    count = 0
    for block in transformer.modules():
        if isinstance(block, FluxSingleTransformerBlock) and type(block.proj_out) is torch.nn.Linear:
            block.proj_out = ConcatInputLinear(block.proj_out, [block.attn.inner_dim, block.mlp_hidden_dim])
            block.forward = types.MethodType(single_block_forward, block)
            count += 1
    return count


def bank_modulation(transformer: torch.nn.Module) -> int:
    """Every modulation layer (each joint block's ``norm1`` and ``norm1_context``, each single
    block's ``norm``, ``norm_out``) computed by one ``modulation.ModulationBank`` product per forward,
    right after ``time_text_embed`` (the norms' own SiLU becomes the identity: the bank applies it);
    returns how many layers. Nothing is banked (0) unless all of them are plain linear layers (LoRA
    wraps them)."""
    layers = [(block.norm1, "linear") for block in transformer.transformer_blocks]
    layers += [(block.norm1_context, "linear") for block in transformer.transformer_blocks]
    layers += [(block.norm, "linear") for block in transformer.single_transformer_blocks]
    layers.append((transformer.norm_out, "linear"))
    if any(type(getattr(parent, name)) is not torch.nn.Linear for parent, name in layers):
        return 0
    modulation.install(transformer, layers, source=transformer.time_text_embed)
    for norm, _ in layers:  # the bank applies the SiLU once for all; a norm's own would be a wasted kernel
        norm.silu = torch.nn.Identity()
    return len(layers)


_BLOCKS = ("transformer_blocks.", "single_transformer_blocks.")
_MODULATION = re.compile(r"\.norm1?(_context)?\.linear$")
"""``AdaLayerNormZero(Single)``'s linear layer inside a block: ``norm1``, ``norm1_context``, ``norm``."""


def quantize_blocks(transformer: torch.nn.Module) -> int:
    """FP8 linear layers in the blocks, except the modulation layers (see the module doc); returns how many."""
    return fp8.quantize_linears(
        transformer, keep=lambda name: not name.startswith(_BLOCKS) or bool(_MODULATION.search(name))
    )


def install_fast_paths(
    transformer: torch.nn.Module, *, backend: str | None = None, quantize: str | None = None, fuse: bool = True
) -> None:
    """Dense attention processors, fused projections and GELUs (unless ``fuse`` is false: LoRA
    adapters target the separate q/k/v layers and the plain MLP layers) and, with ``quantize``,
    FP8 blocks; see the module doc.

    An unknown ``backend`` or ``quantize``, or one that cannot run on the model's device and dtype,
    raises here, at load, naming the problem (``ValueError`` / ``BackendUnavailableError``).
    """
    weight = next(transformer.parameters())
    resolve_backend(backend, weight.device, weight.dtype)
    check_quantize(quantize)
    if quantize is not None:
        fp8.check_supported(weight.device, weight.dtype)
    layers = 0
    for module in transformer.modules():
        if isinstance(module, FluxAttention):
            module.set_processor(FluxDenseAttnProcessor(backend=backend))
            layers += 1
    if layers == 0:
        raise ValueError(f"{type(transformer).__name__} has no FluxAttention layers")
    if fuse:
        fuse_projections(transformer)
    quantized = quantize_blocks(transformer) if quantize == "fp8" else 0
    gelus = fuse_gelus(transformer) if fuse else 0
    split = split_single_blocks(transformer) if fuse else 0
    banked = bank_modulation(transformer) if fuse else 0
    logger.info(
        "FLUX fast paths: attention backend %s on %d layers, %s projections, %d GELUs fused, "
        "%d single blocks unconcatenated, %d modulation layers banked%s",
        backend or "auto",
        layers,
        "fused" if fuse else "separate (LoRA)",
        gelus,
        split,
        banked,
        f", {quantized} FP8 linear layers" if quantized else "",
    )
