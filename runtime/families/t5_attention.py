"""T5 encoder attention on a fused kernel: FLUX's (and Wan's) prompt encoder, same function.

T5 adds a learned relative-position bias to every attention score. transformers' SDPA path hands
that bias to ``scaled_dot_product_attention`` as a float mask, and on CUDA PyTorch then ran its
math backend (seen in a kernel profile of FLUX.1-dev's T5-XXL on an H200): the full
batch x heads x length x length score matrix is written, biased, soft-maxed and read back, once
per layer. ``biased_sdpa`` passes the same bias, in the query's dtype, to the memory-efficient
kernel, which adds it inside the fused attention (the math backend stays the fallback where that
kernel cannot run).

``install(model)`` registers it with transformers' ``AttentionInterface`` (and SDPA's padding-mask
builder under the same name, so a padded batch is masked as before) and switches a loaded T5
encoder to it. Shapes: ``q_BHSD`` (batch, heads, tokens, head dim), bias ``1HSS`` or ``BHSS``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

NAME = "tilecast_biased_sdpa"
"""The attention implementation's name in transformers' registry."""
BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""Kernels allowed, in order: the fused one that takes an additive bias, then the reference."""


def biased_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                is_causal: bool | None = None, position_bias: torch.Tensor | None = None, **kwargs):
    """transformers' attention-function signature; returns ``(out_BSHD, None)``."""
    if kwargs.get("output_attentions"):
        raise ValueError(f"{NAME} computes no attention weights; output_attentions must be off")
    if is_causal if is_causal is not None else getattr(module, "is_causal", False):
        raise ValueError(f"{NAME} serves encoders (no causal mask); {type(module).__name__} is causal")
    bias = position_bias
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            bias = attention_mask if bias is None else torch.where(attention_mask, bias, torch.finfo(query.dtype).min)
        else:
            bias = attention_mask if bias is None else bias + attention_mask
    if bias is not None and bias.dtype != torch.bool:
        bias = bias.to(query.dtype)
    with sdpa_kernel(BACKENDS):
        out_BHSD = F.scaled_dot_product_attention(query, key, value, attn_mask=bias, dropout_p=dropout, scale=scaling)
    return out_BHSD.transpose(1, 2).contiguous(), None


def install(model: torch.nn.Module) -> None:
    """Switch a loaded transformers T5 / UMT5 encoder to ``biased_sdpa``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, biased_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
