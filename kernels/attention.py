"""The single attention entry point: backend registry + Ulysses / Ring / Ulysses × Ring.

Legend: B batch, S sequence (the local shard under sequence parallelism), H heads, D head dim.
q/k/v ``BSHD``; out ``BSHD`` in the input dtype; lse ``BHS`` fp32 (natural log, scaled scores).

Usage::

    out_BSHD, lse_BHS = attention(q, k, v)                                   # auto backend
    out_BSHD, lse_BHS = attention(q, k, v, backend="sdpa_math")
    par = AttentionParallel(ulysses_group=ug, ring_group=rg, seq_len=true_len)
    out_BSHD, lse_BHS = attention(q_shard, k_shard, v_shard, parallel=par)   # sequence-sharded

With ``parallel``, q/k/v are this rank's shards as cut by ``shard_sequence(x, 1, par)`` and the
results are the matching shards of the single-rank result. ``key_mask`` (bool ``(B, S)``, this
rank's keys, ``True`` = attend) masks keys anywhere in the sequence, per batch row: it travels with
the keys through the Ulysses exchange and around the ring, so a sequence made of several padded
segments (text and image shards) or one with padded prompts is attended exactly as on one rank::

    out_BSHD, lse_BHS = attention(q_shard, k_shard, v_shard, parallel=par, key_mask=mask_shard_BS)
"""

from __future__ import annotations

import logging
import math

import torch

from .backends import (
    FLASH_INSTALL_HINT,
    AttentionBackend,
    BackendUnavailableError,
    available_backends,
    backend_names,
    register_backend,
    resolve_backend,
    run_backend,
)
from .collectives import AttentionParallel, _all_gather_cat, gather_sequence, shard_sequence
from .ring import merge_partials, ring_attention
from .ulysses import check_heads, ulysses_attention

logger = logging.getLogger(__name__)

__all__ = [
    "FLASH_INSTALL_HINT",
    "AttentionBackend",
    "AttentionParallel",
    "BackendUnavailableError",
    "attention",
    "available_backends",
    "backend_names",
    "gather_sequence",
    "merge_partials",
    "register_backend",
    "resolve_backend",
    "shard_sequence",
]


def attention(
    q_BSHD: torch.Tensor,
    k_BSHD: torch.Tensor,
    v_BSHD: torch.Tensor,
    *,
    backend: str | None = None,
    parallel: AttentionParallel | None = None,
    scale: float | None = None,
    key_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention (no mask besides padding and ``key_mask``); returns ``(out_BSHD, lse_BHS)``.

    ``backend``: a registry name (see ``backend_names()``), ``"torch_sdpa"``, or ``None``/``"auto"``
    for the fastest available one. ``parallel``: Ulysses and/or Ring groups and the true global
    length (keys past it are padding). ``scale`` defaults to ``1/sqrt(D)``. ``key_mask``: bool
    ``(B, S_k)`` over this rank's keys, ``False`` keys get zero weight (a query whose every key is
    masked gets a zero output and ``lse = -inf``).
    """
    if q_BSHD.dim() != 4 or k_BSHD.dim() != 4 or v_BSHD.dim() != 4:
        raise ValueError(f"attention takes BSHD tensors, got shapes {q_BSHD.shape}, {k_BSHD.shape}, {v_BSHD.shape}")
    if k_BSHD.shape[:3] != v_BSHD.shape[:3] or q_BSHD.shape[-1] != k_BSHD.shape[-1]:
        raise ValueError(f"q/k/v shapes do not match: {q_BSHD.shape}, {k_BSHD.shape}, {v_BSHD.shape}")
    kernel = resolve_backend(backend, q_BSHD.device, q_BSHD.dtype)
    scale = 1.0 / math.sqrt(q_BSHD.shape[-1]) if scale is None else scale
    par = parallel or AttentionParallel()
    if key_mask is not None and key_mask.shape != k_BSHD.shape[:2]:
        raise ValueError(f"key_mask has shape {tuple(key_mask.shape)}; the keys are {tuple(k_BSHD.shape[:2])}")

    if not par.enabled:
        return run_backend(kernel, q_BSHD, k_BSHD, v_BSHD, scale=scale, kv_len=par.seq_len, key_mask_BK=key_mask)

    use_ring = par.ring_group is not None and par.ring_size > 1
    mask_BK = None
    if key_mask is not None:  # the keys' mask, laid out as the keys are after the exchange
        mask_BK = key_mask.to(torch.uint8)  # gloo has no bool collectives
        if par.ulysses_group is not None and par.ulysses_size > 1:
            mask_BK = _all_gather_cat(mask_BK, 1, par.ulysses_group)
        if use_ring:
            mask_BK = _all_gather_cat(mask_BK, 1, par.ring_group)
        mask_BK = mask_BK.to(torch.bool)

    def attend(q, k, v):  # on the Ulysses-exchanged (or original) tensors
        if use_ring:
            return ring_attention(
                q, k, v, group=par.ring_group, backend=kernel, scale=scale, seq_len=par.seq_len, key_mask_BK=mask_BK
            )
        return run_backend(kernel, q, k, v, scale=scale, kv_len=par.seq_len, key_mask_BK=mask_BK)

    if par.ulysses_group is not None and par.ulysses_size > 1:
        check_heads(q_BSHD.shape[2], par.ulysses_group)
        return ulysses_attention(q_BSHD, k_BSHD, v_BSHD, group=par.ulysses_group, attend=attend)
    return attend(q_BSHD, k_BSHD, v_BSHD)
