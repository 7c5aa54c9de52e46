"""The row-band ("spatial_shard") VAE decode the video families share: each rank of the decode group
decodes a band of latent rows, the bands are all-gathered.

Legend: ``latents_BCTHW`` (batch, latent channels, latent frames, rows, cols); ``x_BCTHW`` a
decoder feature map; ``video_BCFHW`` decoded pixels (frames F).

A family's module says how its decoder's modules split by rows (why rows and not frames, and the
numerics: ``wan_decode``, ``hunyuan_decode``, ``ltx2_decode``), as a context manager
``sharded_decoder(decoder, sizes, group)`` that makes the decoder decode this rank's band of
``sizes`` latent rows. This module has what they share:

- :func:`decode_group`: the group a family's decode splits over, from ``--vae-config.*``;
- :func:`decode_rows`: the driver. It refuses diffusers' VAE tiling (it would tile each band on its
  own), splits the latent rows as evenly as possible (``k6sr.spatial_shard.shard_sizes``; a group
  of one, or fewer than ``MIN_ROWS_PER_SHARD`` latent rows per rank, decodes replicated), decodes
  this rank's band with the VAE's own ``decode`` under the family's context manager and
  all-gathers the bands, so every rank returns the whole video, as the replicated decode does;
- :class:`ShardedDecode`: the stand-in for ``vae.decode`` (an instance attribute) that a diffusers
  pipeline calls; :func:`install` puts it in place when the settings ask for it;
- small pieces of the families' band forwards: :func:`gather_bands`, :func:`refusal`,
  :func:`attribute_set` and :func:`forward_swapped` (what a context manager changes on a module,
  restored on exit, also after an error).
"""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from diffusers.models.autoencoders.vae import DecoderOutput
from torch import nn

from tilecast.kernels.halo import gather_rows, group_rank, group_size
from tilecast.runtime.models.k6sr.spatial_shard import MIN_ROWS_PER_SHARD, shard_sizes
from tilecast.runtime.models.k6sr.tile_parallel import select_decode_mode

logger = logging.getLogger(__name__)

__all__ = [
    "MIN_ROWS_PER_SHARD",
    "ROW_DIM",
    "ShardedDecode",
    "attribute_set",
    "decode_group",
    "decode_rows",
    "forward_swapped",
    "gather_bands",
    "install",
    "refusal",
    "row_factor",
]

ROW_DIM = 3
"""The row dim of ``BCTHW`` tensors."""

ShardedDecoder = Callable[[nn.Module, list[int], Any], AbstractContextManager[None]]
"""A family's ``sharded_decoder(decoder, sizes, group)``: the decoder decodes this rank's band."""


def decode_group(ctx, family: str):
    """The group a family's spatial-shard VAE decode splits over: ``ctx.groups.decode_group`` (the
    ranks of one DP replica) when ``--vae-config.use-parallel-decode`` asks for it and the group
    has more than one rank, else None. Reads ``ctx.settings.vae`` (the other ``--vae-config.*``
    settings are refused by the family's ``load`` before this runs); warns (rank 0, naming
    ``family``) when the decode group has one rank. Raises ``ValueError`` for a decode mode other
    than ``spatial_shard``."""
    vae_settings = ctx.settings.vae
    group = ctx.groups.decode_group if ctx.groups is not None else None
    num_ranks = group_size(group) if group is not None else 1
    mode = select_decode_mode(vae_settings, num_ranks)
    if ctx.rank == 0:
        if vae_settings.use_parallel_decode and mode == "serial":
            logger.warning(
                "%s: --vae-config.use-parallel-decode has no effect: the decode group (the ranks of one "
                "data-parallel replica) has one rank; give a replica several ranks with --ulysses-degree, "
                "--ring-degree or --tp-size",
                family,
            )
    return group if mode == "spatial_shard" else None


def row_factor(x_BCTHW: torch.Tensor, sizes: list[int], group) -> int:
    """How many rows of ``x_BCTHW`` (this rank's band) each of its latent rows has become."""
    factor, remainder = divmod(x_BCTHW.shape[ROW_DIM], sizes[group_rank(group)])
    assert remainder == 0, (tuple(x_BCTHW.shape), sizes)
    return factor


def gather_bands(x_BCTHW: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Every rank's band (this rank's: ``x_BCTHW``, its ``sizes`` latent rows at any power-of-two
    multiple) all-gathered to the whole map, on every rank (uneven bands padded for the gather)."""
    factor = row_factor(x_BCTHW, sizes, group)
    return gather_rows(x_BCTHW.contiguous(), dim=ROW_DIM, sizes=[rows * factor for rows in sizes], group=group)


def decode_rows(
    vae,
    latents_BCTHW: torch.Tensor,
    group,
    *decode_args: Any,
    family: str,
    sharded_decoder: ShardedDecoder,
    tiling: tuple[str, ...] = ("use_tiling",),
    tiling_names: str = "vae.enable_tiling",
) -> torch.Tensor:
    """``vae.decode(latents_BCTHW, *decode_args)`` (the same latents on every rank) split by rows
    across ``group``: the whole ``video_BCFHW`` on every rank.

    ``family`` names the family in the log line and the error; ``sharded_decoder`` is its context
    manager. Decodes replicated (the VAE's ``decode`` on every rank, no collectives) when ``group``
    has one rank or the latents have fewer than ``MIN_ROWS_PER_SHARD`` rows per rank. Raises
    ``ValueError`` when one of the VAE's ``tiling`` flags is on (``tiling_names``: what sets them).
    """
    decode = type(vae).decode  # the class's method: an instance's ShardedDecode must not recurse
    if any(getattr(vae, flag, False) for flag in tiling):
        raise ValueError(f"{family} parallel VAE decode does not combine with diffusers' VAE tiling ({tiling_names})")
    num_rows = latents_BCTHW.shape[ROW_DIM]
    sizes = shard_sizes(num_rows, group)
    if sizes is None:
        logger.debug("%s decode: %d latent rows on %d ranks decode replicated", family, num_rows, group_size(group))
        return decode(vae, latents_BCTHW, *decode_args, return_dict=False)[0]
    index = group_rank(group)
    band_BCTHW = latents_BCTHW.narrow(ROW_DIM, sum(sizes[:index]), sizes[index])
    with sharded_decoder(vae.decoder, sizes, group):
        video_BCFHW = decode(vae, band_BCTHW, *decode_args, return_dict=False)[0]
    return gather_bands(video_BCFHW, sizes, group)


class ShardedDecode:
    """Stands in for ``vae.decode`` (an instance attribute), so a diffusers pipeline decodes through
    the family's ``decode_spatial_shard`` (``decode_rows``, set by the family's subclass) on
    ``group``; the VAE's ``decode`` arguments after the latents pass through, and the return types
    are ``decode``'s (``return_dict`` by keyword, as diffusers' pipelines pass it)."""

    decode_rows: Callable[..., torch.Tensor]

    def __init__(self, vae, group) -> None:
        self.vae, self.group = vae, group

    def __call__(self, z: torch.Tensor, *args: Any, return_dict: bool = True, **kwargs: Any):
        video_BCFHW = self.decode_rows(self.vae, z, self.group, *args, **kwargs)
        return DecoderOutput(sample=video_BCFHW) if return_dict else (video_BCFHW,)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(group of {group_size(self.group)} ranks)"


def install(vae, ctx, family: str, stand_in: type[ShardedDecode]) -> bool:
    """Make ``vae.decode`` a ``stand_in`` over the decode group (:func:`decode_group`) when
    ``--vae-config.use-parallel-decode`` asks for it and the group has more than one rank; returns
    whether it did. ``family`` names the family in the log lines."""
    group = decode_group(ctx, family)
    if group is None:
        return False
    vae.decode = stand_in(vae, group)
    logger.info("%s: VAE decode split by rows across the decode group of %d ranks", family, group_size(group))
    return True


# ----------------------------------------------------------------------------------- for the families
def refusal(family: str, name: str, module: nn.Module, why: str) -> RuntimeError:
    """The error a family's ``sharded_decoder`` raises for decoder module ``name`` it cannot shard."""
    return RuntimeError(
        f"{family} spatial-shard decode cannot shard {name!r} ({type(module).__name__}: {why}); "
        "decode without --vae-config.use-parallel-decode"
    )


@contextlib.contextmanager
def attribute_set(module: nn.Module, name: str, value: Any) -> Iterator[None]:
    """``module.<name>`` is ``value`` inside, its old value again on exit."""
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


@contextlib.contextmanager
def forward_swapped(module: nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """``forward(module, ...)`` is the instance's forward inside; on exit the class's (or the one
    the instance had) again."""
    saved = vars(module).get("forward")
    module.forward = types.MethodType(forward, module)
    try:
        yield
    finally:
        if saved is None:
            del module.forward
        else:
            module.forward = saved
