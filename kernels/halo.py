"""Row-sharded tensors across a process group: split sizes, halo exchange, gather.

Legend: a tensor is split along one ``dim`` (the rows) into contiguous shards, shard ``i`` on the
group's rank ``i``, top to bottom. Shards may be uneven (43/43/42): every function here issues the
same collectives in the same order on every rank whatever the sizes, so uneven heights can never
desynchronise a group.

- ``split_sizes(n, k)``: the row count of each shard (the first ``n % k`` shards get one more).
- ``halo_exchange``: every rank sends its first/last ``halo`` rows to the rank above/below and
  receives theirs (point-to-point). The true top and bottom edges get zero rows, exactly what a
  zero-padded convolution sees there, so ``conv(halo_exchange(x), padding=0 on dim)`` on each shard
  equals the rows of ``conv(x_full, padding=halo)``.
- ``halo_pad``: ``halo_exchange`` whose true edges are padded as a convolution's padding mode pads
  them (zeros, replicate: the edge row repeated, reflect: the rows after the edge, mirrored), so
  ``conv(halo_pad(x, mode=m), no row padding)`` equals the rows of a conv padding rows with ``m``.
- ``gather_rows``: all-gather uneven shards (padded to the largest, trimmed after) and concatenate.

Works on any backend with point-to-point and all_gather (gloo for CPU tensors, NCCL for CUDA
tensors); the group is passed explicitly (``None`` means the default group).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

__all__ = ["PAD_MODES", "gather_rows", "group_rank", "group_size", "halo_exchange", "halo_pad", "split_sizes"]


def group_size(group) -> int:
    """Ranks in ``group`` (1 when torch.distributed is not initialised)."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group) -> int:
    """This rank's index in ``group`` (0 when torch.distributed is not initialised)."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def split_sizes(num_rows: int, num_shards: int) -> list[int]:
    """Rows per shard, top to bottom: as even as possible, the first ``num_rows % num_shards`` get one more."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    base, extra = divmod(num_rows, num_shards)
    return [base + (1 if i < extra else 0) for i in range(num_shards)]


def _global_rank(group, index: int) -> int:
    return index if group is None else dist.get_global_rank(group, index)


def halo_exchange(x: torch.Tensor, *, dim: int, halo: int, group) -> torch.Tensor:
    """``x`` with ``halo`` rows of each neighbour's shard added before and after it along ``dim``.

    Rows beyond the true edges (above shard 0, below the last shard) are zeros. Every shard must
    have at least ``halo`` rows. Collective over ``group`` (point-to-point with the neighbours).
    """
    if halo < 0:
        raise ValueError(f"halo must be >= 0, got {halo}")
    if halo == 0:
        return x
    rows = x.shape[dim]
    if rows < halo:
        raise ValueError(f"a shard of {rows} rows cannot provide a halo of {halo} rows")
    size, index = group_size(group), group_rank(group)
    first = x.narrow(dim, 0, halo).contiguous()
    last = x.narrow(dim, rows - halo, halo).contiguous()
    above = torch.zeros_like(first)
    below = torch.zeros_like(last)
    ops = []
    if index > 0:
        peer = _global_rank(group, index - 1)
        ops += [dist.P2POp(dist.isend, first, peer, group), dist.P2POp(dist.irecv, above, peer, group)]
    if index < size - 1:
        peer = _global_rank(group, index + 1)
        ops += [dist.P2POp(dist.isend, last, peer, group), dist.P2POp(dist.irecv, below, peer, group)]
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return torch.cat([above, x, below], dim=dim)


PAD_MODES = ("zeros", "replicate", "reflect")
"""The padding modes ``halo_pad`` reproduces at the true edges (``F.pad``'s ``constant`` is ``zeros``)."""


def halo_pad(x: torch.Tensor, *, dim: int, halo: int, group, mode: str = "zeros") -> torch.Tensor:
    """``halo_exchange(x)``, except that the rows beyond the true edges are what padding ``mode``
    (``PAD_MODES``) puts there: zeros, the edge row repeated (replicate), or the ``halo`` rows
    after the edge in mirror order (reflect; an edge shard needs ``halo + 1`` rows). Padding modes act
    on each dim on its own, so padding the rows here and the other dims after gives the corners a
    padding of all dims at once gives."""
    mode = "zeros" if mode == "constant" else mode
    if mode not in PAD_MODES:
        raise ValueError(f"mode must be one of {', '.join(PAD_MODES)}, got {mode!r}")
    x_halo = halo_exchange(x, dim=dim, halo=halo, group=group)
    if mode == "zeros" or halo == 0:
        return x_halo
    rows, index, size = x.shape[dim], group_rank(group), group_size(group)
    if mode == "reflect" and rows <= halo and index in (0, size - 1):  # after the exchange: no peer waits
        raise ValueError(f"an edge shard of {rows} rows cannot reflect a halo of {halo} rows")
    above, below = x_halo.narrow(dim, 0, halo), x_halo.narrow(dim, halo + rows, halo)
    if index == 0:
        above = x.narrow(dim, 0, 1).expand_as(above) if mode == "replicate" else x.narrow(dim, 1, halo).flip(dim)
    if index == size - 1:
        if mode == "replicate":
            below = x.narrow(dim, rows - 1, 1).expand_as(below)
        else:
            below = x.narrow(dim, rows - 1 - halo, halo).flip(dim)
    return torch.cat([above, x, below], dim=dim)


def gather_rows(x: torch.Tensor, *, dim: int, sizes: list[int], group) -> torch.Tensor:
    """Concatenate every rank's shard along ``dim`` (shard ``i`` has ``sizes[i]`` rows), on every rank.

    One all_gather of shards padded to ``max(sizes)`` rows, whatever the sizes.
    """
    size, index = group_size(group), group_rank(group)
    if len(sizes) != size:
        raise ValueError(f"expected {size} shard sizes for the group, got {sizes}")
    if x.shape[dim] != sizes[index]:
        raise ValueError(f"this rank's shard has {x.shape[dim]} rows along dim {dim}, expected {sizes[index]}")
    if size == 1:
        return x
    longest = max(sizes)
    if x.shape[dim] < longest:
        pad_shape = list(x.shape)
        pad_shape[dim] = longest - x.shape[dim]
        x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat([part.narrow(dim, 0, rows) for part, rows in zip(parts, sizes)], dim=dim)
