"""Sequence-parallel layout and the collectives shared by Ulysses, Ring and the DiT hooks.

Legend: B batch, S sequence (local shard unless noted), H heads, D head dim.

Layout: the sequence-parallel (SP) ranks are the product of the ring and Ulysses axes. The padded
global sequence is cut into ``ring_size * ulysses_size`` equal shards and SP rank
``ring_rank * ulysses_size + ulysses_rank`` holds shard number ``sp_rank`` — ring-major, so that a
Ulysses all-to-all over a ring rank's Ulysses group yields one contiguous ring chunk. Padding is
appended at the end of the global sequence; ``AttentionParallel.seq_len`` carries the true length
so attention gives padded keys zero weight.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

logger = logging.getLogger(__name__)

ProcessGroup = dist.ProcessGroup


@dataclass(frozen=True, kw_only=True)
class AttentionParallel:
    """How one ``attention()`` call is spread over ranks; passed explicitly by the caller."""

    ulysses_group: ProcessGroup | None = None
    """Ranks that exchange sequence shards for head shards by all-to-all (``None``: no Ulysses).
    The local head count must divide by its size."""
    ring_group: ProcessGroup | None = None
    """Ranks that pass K/V chunks around a ring and merge partial results by log-sum-exp
    (``None``: no Ring). With Ulysses too, Ring runs on the head-sharded tensors."""
    seq_len: int | None = None
    """True (unpadded) length of the global sequence; keys at positions ``>= seq_len`` are padding
    and get zero weight. ``None``: the global sequence is not padded."""

    def __post_init__(self) -> None:
        if self.seq_len is not None and self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")

    @property
    def ulysses_size(self) -> int:
        return _size(self.ulysses_group)

    @property
    def ring_size(self) -> int:
        return _size(self.ring_group)

    @property
    def sp_size(self) -> int:
        """Number of sequence shards (``ring_size * ulysses_size``)."""
        return self.ring_size * self.ulysses_size

    @property
    def sp_rank(self) -> int:
        """Index of this rank's shard in the global sequence."""
        return _rank(self.ring_group) * self.ulysses_size + _rank(self.ulysses_group)

    @property
    def enabled(self) -> bool:
        return self.sp_size > 1

    def with_seq_len(self, seq_len: int | None) -> AttentionParallel:
        return replace(self, seq_len=seq_len)


def _size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group: ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def _as_parallel(group: ProcessGroup | AttentionParallel | None) -> AttentionParallel:
    if isinstance(group, AttentionParallel):
        return group
    return AttentionParallel(ulysses_group=group)


def shard_sequence(
    x: torch.Tensor, dim: int, group: ProcessGroup | AttentionParallel | None
) -> tuple[torch.Tensor, int]:
    """This rank's shard of the full sequence ``x`` along ``dim``, and the padding appended.

    ``group`` is one SP process group, or an ``AttentionParallel`` for Ulysses × Ring (ring-major
    layout, see the module docstring). The sequence is zero-padded at the end to a multiple of the
    number of shards; pass ``seq_len=x.shape[dim]`` to attention so the padding is masked.
    """
    par = _as_parallel(group)
    num_shards = par.sp_size
    full_len = x.shape[dim]
    pad = (-full_len) % num_shards
    if pad:
        dim = dim % x.dim()
        widths = [0, 0] * (x.dim() - dim - 1) + [0, pad]
        x = F.pad(x, widths)
    shard_len = x.shape[dim] // num_shards
    return x.narrow(dim, par.sp_rank * shard_len, shard_len), pad


def gather_sequence(
    local: torch.Tensor, dim: int, group: ProcessGroup | AttentionParallel | None, full_len: int
) -> torch.Tensor:
    """Inverse of ``shard_sequence``: all-gather the shards along ``dim`` and drop the padding."""
    par = _as_parallel(group)
    x = _all_gather_cat(local, dim, par.ulysses_group)
    x = _all_gather_cat(x, dim, par.ring_group)
    if x.shape[dim] < full_len:
        raise ValueError(f"gathered length {x.shape[dim]} along dim {dim} is shorter than full_len={full_len}")
    return x.narrow(dim, 0, full_len)


def _all_gather_cat(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    size = _size(group)
    if size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)
