"""An attention implementation as one opaque PyTorch custom op (``tilecast::<name>``).

``torch.compile`` then sees a single node with a known output shape (the fake below) instead of
tracing into the implementation: hand-written kernels (Triton, cuDNN graphs) are launched as they
are, not recompiled or split by graph breaks, and CUDA graphs capture the call like any other op.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

AttentionImpl = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""``impl(q_BSHD, k_BKHD, v_BKHD, *, scale) -> (out_BSHD, lse_BHS)``, ``out`` in ``q``'s dtype and shape."""


def opaque_attention(name: str, impl: AttentionImpl) -> AttentionImpl:
    """``impl`` registered as the custom op ``tilecast::<name>``; returns the function that calls it."""

    @torch.library.custom_op(f"tilecast::{name}", mutates_args=())
    def op(
        q_BSHD: torch.Tensor, k_BKHD: torch.Tensor, v_BKHD: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return impl(q_BSHD, k_BKHD, v_BKHD, scale=scale)

    @op.register_fake
    def _(q_BSHD, k_BKHD, v_BKHD, scale):
        batch, num_q, heads, _ = q_BSHD.shape
        return torch.empty_like(q_BSHD), q_BSHD.new_empty(batch, heads, num_q, dtype=torch.float32)

    def call(q_BSHD: torch.Tensor, k_BKHD: torch.Tensor, v_BKHD: torch.Tensor, *, scale: float):
        return op(q_BSHD, k_BKHD, v_BKHD, scale)

    call.__name__ = name
    call.__doc__ = impl.__doc__
    return call
