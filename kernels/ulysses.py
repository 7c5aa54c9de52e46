"""Ulysses sequence parallelism: all-to-all between the sequence and head dimensions.

Legend: B batch, S sequence, H heads, D head dim, P Ulysses group size. Inputs arrive
sequence-sharded ``(B, S/P, H, D)``; attention runs on ``(B, S, H/P, D)`` (full sequence, a head
shard), and the result goes back to ``(B, S/P, H, D)``. The local head count must divide by P.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``attend(q_BSHD, k_BSHD, v_BSHD) -> (out_BSHD, lse_BHS)`` on the head-sharded tensors."""


def check_heads(num_heads: int, group: dist.ProcessGroup) -> None:
    """``ValueError`` unless ``num_heads`` divides by the Ulysses group size."""
    size = dist.get_world_size(group)
    if num_heads % size:
        raise ValueError(
            f"{num_heads} local attention heads do not divide by the Ulysses group size {size}; "
            "choose a Ulysses degree (times the TP degree) that divides the model's head count"
        )


def ulysses_attention(
    q_BSHD: torch.Tensor, k_BSHD: torch.Tensor, v_BSHD: torch.Tensor, *, group: dist.ProcessGroup, attend: AttendFn
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence-sharded q/k/v in, sequence-sharded ``(out_BSHD, lse_BHS)`` out."""
    for t in (q_BSHD, k_BSHD, v_BSHD):
        check_heads(t.shape[2], group)
    out_BSHD, lse_BHS = attend(*(seq_to_head_all_to_all(t, group) for t in (q_BSHD, k_BSHD, v_BSHD)))
    out_BSHD = head_to_seq_all_to_all(out_BSHD, group)
    # The lse goes through the same exchange as a (B, S, H, 1) tensor.
    lse_BSH1 = head_to_seq_all_to_all(lse_BHS.transpose(1, 2).unsqueeze(-1).contiguous(), group)
    return out_BSHD, lse_BSH1.squeeze(-1).transpose(1, 2).contiguous()


def seq_to_head_all_to_all(x_BSHD: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Ulysses forward: ``(B, S/P, H, D)`` sequence-sharded → ``(B, S, H/P, D)`` head-sharded."""
    size = dist.get_world_size(group)
    batch, seq, heads, head_dim = x_BSHD.shape
    if heads % size:
        raise ValueError(f"{heads} local attention heads do not divide by the Ulysses group size {size}")
    send_PBSHD = x_BSHD.reshape(batch, seq, size, heads // size, head_dim).permute(2, 0, 1, 3, 4).contiguous()
    recv_PBSHD = torch.empty_like(send_PBSHD)
    dist.all_to_all_single(recv_PBSHD, send_PBSHD, group=group)
    # recv[p] holds sequence shard p for this rank's heads.
    return recv_PBSHD.permute(1, 0, 2, 3, 4).reshape(batch, size * seq, heads // size, head_dim)


def head_to_seq_all_to_all(x_BSHD: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Ulysses backward: ``(B, S, H/P, D)`` head-sharded → ``(B, S/P, H, D)`` sequence-sharded."""
    size = dist.get_world_size(group)
    batch, seq, heads, head_dim = x_BSHD.shape
    assert seq % size == 0, (seq, size)
    send_PBSHD = x_BSHD.reshape(batch, size, seq // size, heads, head_dim).transpose(0, 1).contiguous()
    recv_PBSHD = torch.empty_like(send_PBSHD)
    dist.all_to_all_single(recv_PBSHD, send_PBSHD, group=group)
    # recv[p] holds head shard p for this rank's sequence shard.
    return recv_PBSHD.permute(1, 2, 0, 3, 4).reshape(batch, seq // size, size * heads, head_dim)
