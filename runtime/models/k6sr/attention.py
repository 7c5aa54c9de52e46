"""Dense attention processor for the Kandinsky 6 SR transformer.

diffusers' ``Kandinsky6SRAttnProcessor`` runs NABLA sparse attention on the ``flex`` backend.
tilecast serves the dense path instead: this processor computes query/key/value, the per-head
RMS norms and the 3-D rotary embedding exactly as diffusers does, then calls the single
attention entry point ``tilecast.kernels.attention.attention`` (which picks the backend and
applies Ulysses/Ring parallelism). ``sparse_params`` is accepted and ignored.

Heads are unflattened with the head dimension taken from ``attn.query_norm`` (not
``attn.num_heads``), so a column-sharded (tensor-parallel) projection with fewer local heads
works unchanged.

Shapes: ``x_BSC`` (batch, tokens, channels); ``q_BSHD`` (batch, tokens, heads, head dim);
``rope_S1D22`` (tokens, 1, head dim / 2, 2, 2) rotation matrices.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from diffusers.models.transformers.transformer_kandinsky6_sr import Kandinsky6SRAttention, apply_rotary

from tilecast.kernels.attention import attention

logger = logging.getLogger(__name__)


class K6SRDenseAttnProcessor:
    """Drop-in processor for ``Kandinsky6SRAttention`` that computes dense attention.

    ``backend`` and ``parallel`` are passed through to ``tilecast.kernels.attention.attention``
    on every call; set them as attributes (``None`` lets the kernel choose).
    """

    def __init__(self, *, backend: str | None = None, parallel: Any = None) -> None:
        self.backend = backend
        """Attention backend name (``None``: the kernel's default)."""
        self.parallel = parallel
        """Sequence-parallel description for Ulysses/Ring (``None``: single rank)."""

    def __call__(
        self,
        attn: Kandinsky6SRAttention,
        hidden_states: torch.Tensor,
        rotary_emb: torch.Tensor,
        sparse_params: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        x_BSC = hidden_states
        head_dim = attn.query_norm.normalized_shape[-1]
        q_BSHD = attn.to_query(x_BSC).unflatten(-1, (-1, head_dim))
        k_BSHD = attn.to_key(x_BSC).unflatten(-1, (-1, head_dim))
        v_BSHD = attn.to_value(x_BSC).unflatten(-1, (-1, head_dim))
        q_BSHD = attn.query_norm(q_BSHD.float()).type_as(q_BSHD)
        k_BSHD = attn.key_norm(k_BSHD.float()).type_as(k_BSHD)
        q_BSHD = apply_rotary(q_BSHD, rotary_emb)
        k_BSHD = apply_rotary(k_BSHD, rotary_emb)
        out_BSHD, _lse_BHS = attention(q_BSHD, k_BSHD, v_BSHD, backend=self.backend, parallel=self.parallel)
        return attn.out_layer(out_BSHD.flatten(2, 3))


def install_dense_attention(transformer: torch.nn.Module, *, backend: str | None = None, parallel: Any = None) -> int:
    """Give every ``Kandinsky6SRAttention`` of ``transformer`` its own ``K6SRDenseAttnProcessor``.

    diffusers' ``set_processor`` accepts processors outside ``_available_processors`` (it only
    assigns the attribute), so the public API is used. Returns the number of layers replaced.
    """
    count = 0
    for module in transformer.modules():
        if isinstance(module, Kandinsky6SRAttention):
            module.set_processor(K6SRDenseAttnProcessor(backend=backend, parallel=parallel))
            count += 1
    if count == 0:
        raise ValueError(f"{type(transformer).__name__} has no Kandinsky6SRAttention layers to replace")
    logger.debug("installed dense attention (backend=%s) on %d layers", backend, count)
    return count


def dense_processors(transformer: torch.nn.Module) -> list[K6SRDenseAttnProcessor]:
    """The installed processors, e.g. to retarget ``backend``/``parallel`` after loading."""
    return [
        module.processor
        for module in transformer.modules()
        if isinstance(module, Kandinsky6SRAttention) and isinstance(module.processor, K6SRDenseAttnProcessor)
    ]
