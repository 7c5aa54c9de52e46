"""Parallel Wan VAE decode: each rank of the decode group decodes a band of rows (spatial shards).

Legend: ``latents_BCTHW`` (batch, latent channels, latent frames, rows, cols); ``x_BCTHW`` a
decoder feature map; ``x_NCHW`` the same with frames folded into the batch (``WanResample`` and
``WanAttentionBlock`` work per frame); ``video_BCFHW`` decoded pixels (frames F).

**Why spatial shards, not frame chunks.** ``AutoencoderKLWan._decode`` runs its decoder one latent
frame at a time; every causal 3D conv (``WanCausalConv3d``, temporal kernel 3) prepends the last
two frames of its own input from the previous call (the per-conv ``feat_cache``). A frame's output
therefore depends on earlier frames through every conv of the decoder: the temporal receptive
field is the sum of the convs' look-backs (two frames each, at their level's frame rate): some 37
latent frames for the released 1.3B VAE (``num_res_blocks=2``; 24 from the convs at the latent
rate alone), more than the whole of an 81-frame video (21 latent frames). Frame chunks decoded
with their true causal cache must wait for the chunk before (no parallelism); chunks that warm
their cache up on overlap frames instead are approximate and would redo nearly the whole prefix.
Rows have no such chain: each 3x3 conv needs one row of each neighbour, so a band decodes exactly
with one halo row per conv, and the feature cache stays per band. That is what this module does,
with diffusers' own ``vae.decode`` on the band; for the duration of the call,
:func:`sharded_wan_decoder` adds forward hooks (removed after) on the decoder modules that mix
rows:

- ``WanCausalConv3d`` with row padding (the 3x3x3 convs): the layer's row padding is set to 0 and
  a pre-hook gives its input one halo row from each neighbour (zero rows at the true top and bottom
  edges, exactly the layer's zero padding; ``kernels.halo.halo_exchange``). **Causal cache**: the
  callers store ``x[:, :, -2:]`` of the conv's input as the cache, i.e. on a band the band's rows
  of the serial cache; the layer prepends that cache to its input in time. The pre-hook exchanges
  the halo of ``cat([cache, x])`` (one exchange) and splits it back, so the halo rows of the cached
  frames are the neighbour's cached rows, which are the serial cache's rows there. The cache needs
  no exchange of its own; width and the causal time padding stay the layer's own.
- ``WanResample``'s ``Conv2d`` (3x3, row padding 1) after the nearest-exact x2 upsample: one halo
  row on ``x_NCHW``, row padding 0 meanwhile. Nearest-exact x2 maps output row ``i`` to input row
  ``floor((i + 0.5) / 2) = i // 2``, so each band upsamples to exactly its own doubled band.
- ``WanAttentionBlock`` (the mid block, at the lowest resolution): attention over a whole frame.
  A pre-hook all-gathers the band rows to the full frame (``kernels.halo.gather_rows``, uneven
  bands padded), diffusers' forward runs on the full frame, and a forward hook keeps this rank's
  rows. Every rank so repeats the mid block's attention (1.5% of the serial decode's time on an
  H200, below), in exchange for the same shapes, hence the same bits, as the serial attention.
- Row-local, nothing to do: ``WanRMS_norm`` (per pixel over channels), SiLU, the 1x1 convs
  (``conv_shortcut``, ``post_quant_conv``), ``time_conv`` (kernel ``(3, 1, 1)``), ``DupUp3D``, the
  clamp and ``unpatchify`` (Wan 2.2's patched VAE; tested on a narrow copy of its structure).

The decoder's modules are checked against that list before anything runs: a module of another
type, a row-mixing conv that is not stride 1 with zero "same" padding, or an upsample other than
nearest-exact x2 makes :func:`sharded_wan_decoder` refuse, so a diffusers change cannot silently produce seams. The
decoded bands are all-gathered to every rank (every rank returns the whole video, as the
replicated decode did). diffusers' VAE tiling (``vae.enable_tiling()``) tiles each band on its own
and is refused together with this decode.

**Numerics.** The halo-extended band carries exactly the values the serial decode has on those
rows (zero rows only at the true edges), and the attention runs on the gathered full frame, so
only the convolutions' shapes differ from serial: the kernels may sum in another order, which moves
fp rounding only. Measured on the tiny checkpoint's VAE in fp32 against serial ``vae.decode``
(``tests/test_wan_decode.py``, 2 ranks / 9 frames and 3 ranks 3/3/2 / 17 frames): float max
|diff| 2.1e-6, uint8 frames PSNR 92.6 / 93.1 dB with max diff 1/255.

**Cost** (one H200, released 1.3B VAE config with random weights, bf16, 81 frames at 480x832, i.e.
60 latent rows; a band decoded alone, so communication is not in these numbers): serial decode
1.82 s and 4.8 GiB peak; a 30-row band (a rank's share on 2 ranks) 0.93 s / 2.5 GiB, a 20-row band
(3 ranks) 0.65 s / 1.8 GiB, so the compute splits 1.95x and 2.82x. The halo messages are one row
to each neighbour per conv call, and the frame gather runs once per latent frame, at 1/64 of the
pixels. Not measured on several GPUs yet (only one-GPU machines were available).

**Settings** (:func:`install`, called by every Wan family: Wan2.1 T2V / I2V, Wan2.2 A14B with
Wan2.1's VAE, Wan2.2 TI2V 5B with its residual, patched VAE; and by Helios, whose pipelines decode
each chunk with ``vae.decode``; the settings, the driver and the stand-in are ``row_band_decode``'s,
shared with ``hunyuan_decode`` and ``ltx2_decode``): ``--vae-config.use-parallel-decode`` with
``--vae-config.parallel-decode-mode spatial_shard`` means here what it means for K6 SR: split
the height across the decode group with halo exchange, not bit-exact. For Wan the "tile" is the
whole frame (the Wan pipeline does not tile). The decode group is ``ctx.groups.decode_group``, the
ranks of one DP replica; with one rank per replica (``--num-gpus 2`` and no Ulysses, Ring or TP
degree) it has one rank and the setting has no effect (a warning says so).
``--vae-config.use-parallel-tiling`` (whole tiles) and ``--vae-config.fast-decode`` (K-VAE only)
have no meaning for Wan: the families' ``load`` refuses them with that reason
(``common.VIDEO_VAE_REASONS``), like every setting they do not honour.

Bands: latent rows split as evenly as possible (uneven 3/3/2 is fine,
``k6sr.spatial_shard.shard_sizes``); a video with fewer than ``MIN_ROWS_PER_SHARD`` latent rows per
rank, or a group of one, decodes replicated (no collectives).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from diffusers.models.autoencoders.autoencoder_kl_wan import (
    DupUp3D,
    WanAttentionBlock,
    WanCausalConv3d,
    WanDecoder3d,
    WanMidBlock,
    WanResample,
    WanResidualBlock,
    WanResidualUpBlock,
    WanRMS_norm,
    WanUpBlock,
    WanUpsample,
)
from torch import nn

from tilecast.kernels.halo import group_rank, halo_exchange
from tilecast.runtime.models.families import row_band_decode
from tilecast.runtime.models.families.row_band_decode import (
    MIN_ROWS_PER_SHARD,
    ROW_DIM,
    ShardedDecode,
    attribute_set,
    decode_group,
    decode_rows,
    gather_bands,
    refusal,
)

__all__ = [
    "MIN_ROWS_PER_SHARD",
    "ShardedWanDecode",
    "decode_group",
    "decode_spatial_shard",
    "install",
    "sharded_wan_decoder",
]

_ROW_LOCAL = (
    WanDecoder3d,
    WanMidBlock,
    WanResidualBlock,
    WanUpBlock,
    WanResidualUpBlock,
    WanRMS_norm,
    DupUp3D,
    nn.Sequential,
    nn.ModuleList,
    nn.Identity,
    nn.Dropout,
    nn.SiLU,
)
"""Decoder module types that only pass rows through, row by row (containers, per-pixel ops)."""


def _row_padding(module: nn.Module) -> int:
    """Rows of zero padding a conv adds above and below (its ``(k-1)/2``-halo)."""
    if isinstance(module, WanCausalConv3d):
        return module._padding[2]
    return module.padding[-2]


def _check_row_kernel(name: str, conv: nn.Module) -> None:
    kernel, padding = conv.kernel_size[-2], _row_padding(conv)
    stride = conv.stride[-2]
    if kernel > 1 and (kernel != 2 * padding + 1 or stride != 1 or conv.padding_mode != "zeros"):
        why = f"row kernel {kernel}, padding {padding}, stride {stride}, {conv.padding_mode} padding"
        raise refusal("Wan", name, conv, why)


def _causal_conv_hook(halo: int, group):
    """Pre-hook of a row-padded ``WanCausalConv3d`` (row padding set to 0): ``halo`` rows on
    ``cat([cache, x])`` in one exchange, split back into the two arguments the layer takes."""

    def hook(module, args, kwargs):
        x_BCTHW, *rest = args
        cache_BCTHW = rest[0] if rest else kwargs.get("cache_x")
        if cache_BCTHW is not None and module._padding[4] > 0:  # the layer prepends the cache in time
            cached = cache_BCTHW.shape[2]
            both = halo_exchange(
                torch.cat([cache_BCTHW.to(x_BCTHW.device), x_BCTHW], dim=2), dim=ROW_DIM, halo=halo, group=group
            )
            cache_BCTHW, x_BCTHW = both[:, :, :cached], both[:, :, cached:]
        else:
            x_BCTHW = halo_exchange(x_BCTHW, dim=ROW_DIM, halo=halo, group=group)
        return (x_BCTHW, cache_BCTHW), {}

    return hook


def _conv2d_hook(halo: int, group):
    """Pre-hook of ``WanResample``'s ``Conv2d`` (row padding set to 0): ``halo`` rows on ``x_NCHW``."""

    def hook(module, args):
        return (halo_exchange(args[0], dim=2, halo=halo, group=group),)

    return hook


def _attention_hooks(sizes: list[int], group):
    """Pre-hook gathering the whole frame's rows, forward hook keeping this rank's band (``sizes``:
    every rank's latent rows; the block may run at any power-of-two multiple of them)."""
    index = group_rank(group)

    def gather(module, args):
        return (gather_bands(args[0], sizes, group),)

    def keep_band(module, args, output_BCTHW):
        factor, remainder = divmod(output_BCTHW.shape[ROW_DIM], sum(sizes))
        assert remainder == 0, (tuple(output_BCTHW.shape), sizes)
        return output_BCTHW.narrow(ROW_DIM, sum(sizes[:index]) * factor, sizes[index] * factor)

    return gather, keep_band


@contextlib.contextmanager
def sharded_wan_decoder(decoder: nn.Module, sizes: list[int], group) -> Iterator[None]:
    """Make ``decoder`` (a ``WanDecoder3d``) decode this rank's band of ``sizes`` latent rows.

    Refuses (``RuntimeError`` naming the module) a decoder with a module it does not know how to
    shard. Adds hooks and sets row paddings to 0 on the row-mixing modules (module docstring);
    removes and restores them on exit, also after an error. Every decoder call inside is
    collective over ``group``.
    """
    plan: list[nn.Module] = []  # the row-mixing modules, in decoder order
    full_frame: list[str] = []  # attention blocks: their submodules see the gathered whole frame
    for name, module in decoder.named_modules():
        if any(name.startswith(f"{block}.") for block in full_frame):
            continue
        if isinstance(module, (WanCausalConv3d, nn.Conv2d)):
            _check_row_kernel(name, module)
            if module.kernel_size[-2] > 1:
                plan.append(module)
        elif isinstance(module, WanAttentionBlock):
            plan.append(module)
            full_frame.append(name)
        elif isinstance(module, WanUpsample):
            if module.mode != "nearest-exact" or tuple(module.scale_factor) != (2.0, 2.0):
                raise RuntimeError(
                    f"Wan spatial-shard decode expects a nearest-exact x2 upsample at {name!r}, "
                    f"got {module.mode} x{module.scale_factor}"
                )
        elif isinstance(module, WanResample):
            if module.mode not in ("upsample2d", "upsample3d"):
                raise RuntimeError(f"Wan spatial-shard decode cannot shard a {module.mode} resample at {name!r}")
        elif not isinstance(module, _ROW_LOCAL):
            raise RuntimeError(
                f"Wan spatial-shard decode does not know decoder module {name!r} ({type(module).__name__}); "
                "decode without --vae-config.use-parallel-decode"
            )
    with contextlib.ExitStack() as restore:
        for module in plan:
            if isinstance(module, WanAttentionBlock):
                gather, keep_band = _attention_hooks(sizes, group)
                restore.callback(module.register_forward_pre_hook(gather).remove)
                restore.callback(module.register_forward_hook(keep_band).remove)
                continue
            halo = _row_padding(module)
            if isinstance(module, WanCausalConv3d):
                pad = list(module._padding)
                pad[2] = pad[3] = 0
                restore.enter_context(attribute_set(module, "_padding", tuple(pad)))
                hook = module.register_forward_pre_hook(_causal_conv_hook(halo, group), with_kwargs=True)
            else:
                restore.enter_context(attribute_set(module, "padding", (0, module.padding[1])))
                hook = module.register_forward_pre_hook(_conv2d_hook(halo, group))
            restore.callback(hook.remove)
        yield


def decode_spatial_shard(vae, latents_BCTHW: torch.Tensor, group) -> torch.Tensor:
    """``vae.decode(latents_BCTHW)`` (an ``AutoencoderKLWan``) split by rows across ``group``: the
    whole clamped ``video_BCFHW`` on every rank (``row_band_decode.decode_rows``: replicated for a
    group of one or too few rows, ``ValueError`` with diffusers' VAE tiling)."""
    return decode_rows(vae, latents_BCTHW, group, family="Wan", sharded_decoder=sharded_wan_decoder)


class ShardedWanDecode(ShardedDecode):
    """Stands in for ``vae.decode`` on an ``AutoencoderKLWan``, so diffusers' ``WanPipeline`` decodes
    through :func:`decode_spatial_shard`."""

    decode_rows = staticmethod(decode_spatial_shard)


def install(vae, ctx, family: str = "wan") -> bool:
    """Make ``vae.decode`` a :class:`ShardedWanDecode` over the decode group when the settings ask
    for it (``row_band_decode.install``); returns whether it did."""
    return row_band_decode.install(vae, ctx, family, ShardedWanDecode)
