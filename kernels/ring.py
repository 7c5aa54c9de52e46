"""Ring attention: K/V chunks travel around the ring, partial results merge in fp32 by log-sum-exp.

Legend: B batch, S local query length, C K/V chunk length, H heads, D head dim, R ring size.
Ring rank r holds query chunk r and K/V chunk r of the ring-level sequence (chunk r covers global
positions ``[r*C, (r+1)*C)``). Each of the R steps attends to one K/V chunk while the next one is
received with ``dist.batch_isend_irecv`` (works on gloo and NCCL). Keys at positions
``>= seq_len`` are padding: they are dropped before the kernel runs, and a chunk made only of
padding contributes ``lse = -inf`` and weight zero. A key mask over the whole ring-level sequence
(``key_mask_BK``, one row per batch element) drops keys anywhere, per batch row, the same way.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .backends import AttentionBackend, run_backend

logger = logging.getLogger(__name__)


def merge_partials(
    out_BSHD: torch.Tensor | None, lse_BHS: torch.Tensor | None, part_BSHD: torch.Tensor, part_lse_BHS: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint key sets, in fp32.

    ``out = sum_i exp(lse_i - lse) * out_i`` with ``lse = logaddexp(lse_1, lse_2)``; rows where
    both parts are empty (``lse = -inf``) stay zero with ``lse = -inf`` (no NaN).
    """
    part_BSHD, part_lse_BHS = part_BSHD.float(), part_lse_BHS.float()
    if out_BSHD is None:
        return part_BSHD, part_lse_BHS
    new_lse_BHS = torch.logaddexp(lse_BHS, part_lse_BHS)
    safe_BHS = torch.where(torch.isfinite(new_lse_BHS), new_lse_BHS, torch.zeros_like(new_lse_BHS))
    w_old_BSH1 = torch.exp(lse_BHS - safe_BHS).transpose(1, 2).unsqueeze(-1)
    w_new_BSH1 = torch.exp(part_lse_BHS - safe_BHS).transpose(1, 2).unsqueeze(-1)
    return out_BSHD * w_old_BSH1 + part_BSHD * w_new_BSH1, new_lse_BHS


def ring_attention(
    q_BSHD: torch.Tensor,
    k_BCHD: torch.Tensor,
    v_BCHD: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    backend: AttentionBackend,
    scale: float,
    seq_len: int | None = None,
    key_mask_BK: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the local queries to the keys of every ring rank; returns ``(out_BSHD, lse_BHS)``.

    ``seq_len`` is the true length of the ring-level sequence (``None``: no padding).
    ``key_mask_BK``: which keys of the ring-level sequence (``R * C`` positions) are attended
    (bool, ``None``: all of them).
    """
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    chunk = k_BCHD.shape[1]
    if key_mask_BK is not None and key_mask_BK.shape != (k_BCHD.shape[0], size * chunk):
        raise ValueError(
            f"key_mask_BK has shape {tuple(key_mask_BK.shape)}; the ring-level keys are ({k_BCHD.shape[0]}, {size * chunk})"
        )
    send_to = dist.get_global_rank(group, (rank + 1) % size)
    recv_from = dist.get_global_rank(group, (rank - 1) % size)
    k_cur, v_cur = k_BCHD.contiguous(), v_BCHD.contiguous()
    out_BSHD = lse_BHS = None
    for step in range(size):
        requests = []
        if step < size - 1:
            k_next, v_next = torch.empty_like(k_cur), torch.empty_like(v_cur)
            requests = dist.batch_isend_irecv(
                [
                    dist.P2POp(dist.isend, k_cur, send_to, group),
                    dist.P2POp(dist.isend, v_cur, send_to, group),
                    dist.P2POp(dist.irecv, k_next, recv_from, group),
                    dist.P2POp(dist.irecv, v_next, recv_from, group),
                ]
            )
        source = (rank - step) % size  # the ring rank whose K/V chunk is in hand
        kv_len = chunk if seq_len is None else max(0, min(chunk, seq_len - source * chunk))
        mask_BC = None if key_mask_BK is None else key_mask_BK[:, source * chunk : (source + 1) * chunk]
        part_BSHD, part_lse_BHS = run_backend(
            backend, q_BSHD, k_cur, v_cur, scale=scale, kv_len=kv_len, key_mask_BK=mask_BC
        )
        out_BSHD, lse_BHS = merge_partials(out_BSHD, lse_BHS, part_BSHD, part_lse_BHS)
        for request in requests:
            request.wait()
        if requests:
            k_cur, v_cur = k_next, v_next
    return out_BSHD.to(q_BSHD.dtype), lse_BHS
