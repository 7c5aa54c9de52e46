"""Spatial-shard decode: one tile's K-VAE decode split by latent rows across a group.

Legend: ``latents_BCTHW`` (batch = tiles of a chunk, latent channels, latent frames, rows, cols);
``x_BCTHW`` a decoder feature map; ``video_BCFHW`` decoded pixels (frames F).

Each rank of the group decodes a contiguous band of latent rows (uneven bands such as 3/3/2 are
allowed, ``kernels.halo.split_sizes``) with diffusers' own ``Kandinsky6SRVAE.decode``; for the
duration of the call, :func:`sharded_decoder` swaps in forwards of the decoder modules that mix
rows, and restores them after:

- ``Kandinsky6SRCausalConv3d`` with a spatial kernel (``height_pad > 0``): the input gets
  ``height_pad`` halo rows from the neighbours (zero rows at the true top/bottom edges, exactly the
  layer's own zero padding), width is zero-padded as the layer does, and the layer's causal
  temporal logic runs unchanged on the halo-extended band (see ``_causal_conv_forward``).
  **Temporal cache**: diffusers stores in ``cache["padding"]`` the last frames of the *spatially
  padded* input. With halos the shard stores the last frames of its halo-extended input, i.e.
  exactly the matching rows of the serial cache (its halo rows are the neighbour's rows of those
  same frames, which is what a fresh exchange would deliver next segment). So the cache needs no
  exchange of its own and stays per shard, and the next segment lines up with it.
- ``Kandinsky6SRUpsample.spatial_conv`` (a plain ``Conv3d``, kernel ``(1, 3, 3)``, padding
  ``(0, 1, 1)``): one halo row, row padding set to 0 while sharded. Its preceding nearest x2
  upsample doubles every band, so bands stay aligned (row ``i`` of level ``s`` comes from latent
  row ``i // s`` of the same band).
- ``Kandinsky6SRSpatialNorm3D`` needs nothing: ``zq`` *is* the decoder input, i.e. this rank's
  latent band, and ``F.interpolate(size=...)`` nearest maps output row ``i`` to input row
  ``floor(i * h / (h * s)) = i // s`` for the power-of-two ``s`` here, the same source row as in
  the full-height call. RMS norms are per pixel; 1x1 convs and the temporal ``(k, 1, 1)`` convs
  (``height_pad == 0``) are row-local.

Any other decoder module with a row kernel larger than one makes :func:`sharded_decoder` refuse to
run, so a diffusers change cannot silently produce seams. The decoded bands are all-gathered (to
every rank) and concatenated. Not bit-exact with serial decode: the convolutions run on other
shapes, which changes fp rounding slightly (measured in ``tests/test_spatial_shard.py``).

A tile with fewer than ``MIN_ROWS_PER_SHARD`` latent rows per rank, or a group of one, decodes
replicated (every rank decodes the whole tile, no collectives).
"""

from __future__ import annotations

import contextlib
import logging
import math
import types
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kandinsky6_sr import (
    Kandinsky6SRCausalConv3d,
    Kandinsky6SRUpsample,
)
from torch import nn

from tilecast.kernels.halo import gather_rows, group_rank, group_size, halo_exchange, split_sizes

logger = logging.getLogger(__name__)

MIN_ROWS_PER_SHARD = 2
"""Fewest latent rows a rank must get for a tile to be split; shorter tiles decode replicated."""

ROW_DIM = 3
"""The row (height) dim of ``BCTHW`` / ``BCFHW`` tensors."""


def shard_sizes(num_rows: int, group) -> list[int] | None:
    """Latent rows per rank for a tile of ``num_rows`` rows, or ``None`` when it decodes replicated
    (a group of one, or fewer than ``MIN_ROWS_PER_SHARD`` rows for some rank)."""
    size = group_size(group)
    if size == 1 or num_rows // size < MIN_ROWS_PER_SHARD:
        return None
    return split_sizes(num_rows, size)


def _causal_conv_forward(module: Kandinsky6SRCausalConv3d, group) -> Callable:
    """A forward for ``module`` on a row band: halo rows instead of row zero padding.

    The temporal part is ``Kandinsky6SRCausalConv3d.forward`` verbatim (diffusers 0.42), on the
    halo-extended band; only the output height (the band's own rows) differs.
    """
    halo = module.height_pad

    def forward(self, hidden_states: torch.Tensor, cache: dict) -> torch.Tensor:
        batch_size, _, num_frames, height, width = hidden_states.shape
        hidden_states = halo_exchange(hidden_states, dim=ROW_DIM, halo=halo, group=group)
        hidden_states = F.pad(hidden_states, (self.width_pad, self.width_pad, 0, 0))

        if cache["padding"] is None:
            padding = hidden_states[:, :, :1].expand(-1, -1, self.time_pad, -1, -1)
        else:
            padding = cache["padding"]

        stride = self.time_stride
        output_frames = (num_frames + 1) // 2 if stride == 2 else num_frames
        output = torch.empty(
            (batch_size, self.conv.out_channels, output_frames, height, width),
            dtype=hidden_states.dtype,
            device=hidden_states.device,
        )
        offset_out = math.ceil(padding.size(2) / stride)
        offset_in = offset_out * stride - padding.size(2)
        if offset_out > 0:
            padded = torch.cat([padding, hidden_states[:, :, : offset_in + self.time_kernel_size - stride]], dim=2)
            output[:, :, :offset_out] = self.conv(padded)
        if offset_out < output_frames:
            output[:, :, offset_out:] = self.conv(hidden_states[:, :, offset_in:])

        pad_offset = offset_in + stride * math.trunc((num_frames - offset_in - self.time_kernel_size) / stride) + stride
        if pad_offset < 0:
            cache["padding"] = torch.cat([padding[:, :, pad_offset:], hidden_states], dim=2)
        else:
            cache["padding"] = hidden_states[:, :, pad_offset:].clone()
        return output

    return types.MethodType(forward, module)


def _row_kernel(module: nn.Module) -> int:
    kernel = getattr(module, "kernel_size", None)
    if isinstance(module, nn.modules.conv._ConvNd) and kernel is not None and len(kernel) >= 2:
        return kernel[-2]
    return 1


@contextlib.contextmanager
def sharded_decoder(decoder: nn.Module, group) -> Iterator[None]:
    """Make ``decoder`` (a ``Kandinsky6SRDecoder3D``) decode this rank's latent row band of a tile.

    Swaps forwards (instance attributes) and row paddings of the row-mixing modules; restores them
    on exit, also after an error. Every call of the decoder inside is collective over ``group``.
    """
    handled: set[int] = set()
    swaps: list[tuple[nn.Module, tuple | None]] = []  # (module, original padding or None)
    try:
        for module in decoder.modules():
            if isinstance(module, Kandinsky6SRCausalConv3d):
                handled.add(id(module.conv))  # its own Conv3d is unpadded; the wrapper pads
                if module.height_pad > 0:
                    module.forward = _causal_conv_forward(module, group)
                    swaps.append((module, None))
            elif isinstance(module, Kandinsky6SRUpsample):
                conv = module.spatial_conv
                handled.add(id(conv))
                original_padding = conv.padding
                original_forward = conv.forward
                conv.padding = (original_padding[0], 0, original_padding[2])
                swaps.append((conv, original_padding))
                conv.forward = _spatial_conv_forward(conv, group, original_padding, original_forward)
        for name, module in decoder.named_modules():
            if id(module) not in handled and _row_kernel(module) > 1:
                raise RuntimeError(
                    f"spatial-shard decode does not know how to shard decoder module {name!r} "
                    f"({type(module).__name__}, row kernel {_row_kernel(module)}); use whole-tile decode"
                )
        yield
    finally:
        for module, padding in reversed(swaps):
            module.__dict__.pop("forward", None)
            if padding is not None:
                module.padding = padding


def _spatial_conv_forward(conv: nn.Conv3d, group, padding: tuple, original: Callable) -> Callable:
    """A forward for a row-padded ``Conv3d`` whose row padding is set to 0 meanwhile: halo rows first."""
    halo = padding[1]

    def forward(self, x_BCTHW: torch.Tensor) -> torch.Tensor:
        return original(halo_exchange(x_BCTHW, dim=ROW_DIM, halo=halo, group=group))

    return types.MethodType(forward, conv)


def decode_spatial_shard(
    decode: Callable[[torch.Tensor], torch.Tensor],
    decoder: nn.Module,
    latents_BCTHW: torch.Tensor,
    group,
) -> torch.Tensor:
    """Decode ``latents_BCTHW`` (the same full tile(s) on every rank) split by rows across ``group``.

    ``decode`` maps latents to pixels (e.g. ``stages.decode_latents`` bound to the components: any
    per-pixel pre/post-processing around ``vae.decode`` is fine); ``decoder`` is the VAE's decoder
    module it runs. Returns the full ``video_BCFHW`` on every rank. Falls back to a replicated
    ``decode(latents_BCTHW)`` (no collectives) when the tile is too short to split or the group has
    one rank.
    """
    num_rows = latents_BCTHW.shape[ROW_DIM]
    sizes = shard_sizes(num_rows, group)
    if sizes is None:
        logger.debug("spatial shard: %d latent rows on %d ranks decode replicated", num_rows, group_size(group))
        return decode(latents_BCTHW)
    index = group_rank(group)
    top = sum(sizes[:index])
    band_BCTHW = latents_BCTHW.narrow(ROW_DIM, top, sizes[index])
    with sharded_decoder(decoder, group):
        video_BCFHW = decode(band_BCTHW)
    factor, remainder = divmod(video_BCFHW.shape[ROW_DIM], sizes[index])
    assert remainder == 0, (video_BCFHW.shape, sizes)
    return gather_rows(video_BCFHW.contiguous(), dim=ROW_DIM, sizes=[rows * factor for rows in sizes], group=group)
