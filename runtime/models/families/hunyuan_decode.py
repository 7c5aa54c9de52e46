"""Parallel HunyuanVideo VAE decode: each rank of the decode group decodes a band of rows.

Legend: ``latents_BCTHW`` (batch, latent channels, latent frames, rows, cols); ``x_BCTHW`` a
decoder feature map; ``video_BCFHW`` decoded pixels (frames F).

The same split as Wan's (``wan_decode``: rows, not frames, because every causal conv looks back
through all earlier frames), for ``AutoencoderKLHunyuanVideo``. Its decoder runs on the whole clip
at once (diffusers' ``_temporal_tiled_decode`` cuts clips of more than 4 latent frames into
overlapping temporal tiles of 5 and blends them in time: per pixel, so per band), with no feature
cache. What mixes rows, and what :func:`sharded_hunyuan_decoder` does about it for the duration
of the call (forwards swapped on the instances, restored after, also after an error):

- ``HunyuanVideoCausalConv3d`` with a 3x3 spatial kernel: the layer pads time causally and rows
  and columns by one with *replicate* padding, then runs an unpadded ``Conv3d``. The row padding is
  set to 0 and the band gets one halo row from each neighbour (``kernels.halo.halo_pad``); at the
  true top and bottom edges the halo is the edge row itself, which is what replicate padding puts
  there (padding modes act per dim, so padding rows first and time / columns after gives the same
  corners as the layer's one ``F.pad``).
- ``GroupNorm`` (every resnet's two norms, ``conv_norm_out``): its statistics are over a group's
  channels and *all* frames, rows and columns. Each rank computes its band's per-group count, mean
  and sum of squared deviations in fp32; one ``all_gather`` of those (float64) and Chan's
  combination give the whole map's mean and variance on every rank, which normalise the band with
  the layer's affine weights (as xDiT's DistVAE ``PatchGroupNorm``, with a numerically stable
  combination). A bf16 map is upcast a chunk of groups at a time (``NORM_CHUNK_ELEMENTS``), so the
  norm needs no fp32 copy of the whole band, and rounds once, as PyTorch's kernel does.
- ``HunyuanVideoUpsampleCausal3D``: nearest x2 (integer factors) maps output row ``i`` to input row
  ``i // 2``, so each band upsamples to its own doubled band; its conv is one of the above.
- The mid block's ``Attention`` (a ``GroupNorm`` of its own, then one attention over every latent
  frame's every pixel with a frame-causal mask, at latent resolution): the band is all-gathered to
  the whole map (``kernels.halo.gather_rows``), which gives the norm and the keys and values; the
  rank computes the queries of its own rows only, with those rows of the mask (``_band_attention``,
  ``AttnProcessor2_0``'s steps written out; another processor is refused). The attention's work and
  its ``queries x keys`` mask (diffusers builds the whole ``N x N`` one: 10 GB in bf16 for a 720p
  temporal tile of 5 latent frames) split across the ranks.
- Row-local, nothing to do: SiLU, dropout, the 1x1 ``conv_shortcut`` and ``post_quant_conv``.

The decoder's modules are checked against that list before anything runs: another module type, a
row-mixing conv that is strided or pads on its own, or another padding mode makes
:func:`sharded_hunyuan_decoder` refuse (``RuntimeError`` naming the module), so a diffusers change
cannot silently produce seams. diffusers' spatial VAE tiling (``vae.enable_tiling()``) would tile
each band on its own and is refused together with this decode. The bands are all-gathered, so
every rank returns the whole video, as the replicated decode does.

**Numerics.** The halo rows carry the serial decode's values; the norms' statistics are the whole
map's up to fp rounding (combined in another order than the serial kernel's); the convolutions run
on band shapes. So not bit-exact: measured on the tiny checkpoint's VAE against serial
``vae.decode`` (``tests/test_hunyuan_decode.py``, 17 frames, 2 and 4 ranks): fp32 max |diff| 7.6e-6
(serial fp32 is itself 7.9e-6 from the float64 decode), uint8 frames PSNR 90 dB, max diff 1/255; in
float64 1.8e-14, i.e. the arithmetic is the serial decode's.

**Cost.** Everything splits by rows but the mid-block attention's group norm and key / value
projections, which every rank runs on the whole latent map (linear in it, at the lowest
resolution). Exchanged: per group norm call one ``all_gather`` of ``3 x batch x groups`` float64
values, per 3x3 conv call one halo row to each neighbour, per mid-block attention the latent map's
rows. Not measured on GPUs yet (no several-GPU machine was available).

Settings, bands and the driver are ``row_band_decode``'s, as for Wan:
``--vae-config.use-parallel-decode`` with the ``spatial_shard`` mode, the decode group of one DP
replica, latent rows split as evenly as possible (``k6sr.spatial_shard.shard_sizes``), replicated
decode for fewer than ``MIN_ROWS_PER_SHARD`` rows per rank or a group of one.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention, AttnProcessor2_0
from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import (
    HunyuanVideoCausalConv3d,
    HunyuanVideoDecoder3D,
    HunyuanVideoMidBlock3D,
    HunyuanVideoResnetBlockCausal3D,
    HunyuanVideoUpBlock3D,
    HunyuanVideoUpsampleCausal3D,
)
from torch import nn

from tilecast.kernels.halo import group_rank, group_size, halo_pad
from tilecast.runtime.models.families import row_band_decode
from tilecast.runtime.models.families.row_band_decode import (
    MIN_ROWS_PER_SHARD,
    ROW_DIM,
    ShardedDecode,
    attribute_set,
    decode_rows,
    forward_swapped,
    gather_bands,
    refusal,
    row_factor,
)

__all__ = ["MIN_ROWS_PER_SHARD", "ShardedHunyuanDecode", "decode_spatial_shard", "install", "sharded_hunyuan_decoder"]

_ROW_LOCAL = (
    HunyuanVideoDecoder3D,
    HunyuanVideoUpBlock3D,
    HunyuanVideoResnetBlockCausal3D,
    nn.ModuleList,
    nn.Dropout,
    nn.SiLU,
)
"""Decoder module types that only pass rows through (containers, per-pixel ops); their
submodules are checked on their own."""

PAD_MODES = ("replicate", "constant", "reflect")
"""Padding modes of ``HunyuanVideoCausalConv3d`` a band reproduces at the true edges (``halo_pad``)."""


_refuse = functools.partial(refusal, "HunyuanVideo")
"""``_refuse(name, module, why)``: the error for a decoder module this decode cannot shard."""


# ----------------------------------------------------------------------------------- row-mixing ops
def _causal_conv_forward(halo: int, group):
    """``HunyuanVideoCausalConv3d.forward`` (diffusers 0.42) on a band whose row padding is 0:
    ``halo`` neighbour rows first (the layer's padding mode at the true edges), then the layer's
    own time and column padding."""

    def forward(module, x_BCTHW: torch.Tensor) -> torch.Tensor:
        x_BCTHW = halo_pad(x_BCTHW, dim=ROW_DIM, halo=halo, group=group, mode=module.pad_mode)
        x_BCTHW = F.pad(x_BCTHW, module.time_causal_padding, mode=module.pad_mode)
        return module.conv(x_BCTHW)

    return forward


NORM_CHUNK_ELEMENTS = 1 << 26
"""Elements of a group norm's input upcast to fp32 at a time (256 MiB): a bf16 map is normalised
chunk by chunk of groups, never copied whole to fp32."""


def _group_chunks(x_BGN: torch.Tensor) -> list[slice]:
    """Slices of the group dim covering at most ``NORM_CHUNK_ELEMENTS`` elements each (one group at least)."""
    batch, groups, per_group = x_BGN.shape
    step = max(1, NORM_CHUNK_ELEMENTS // max(1, batch * per_group))
    return [slice(start, min(start + step, groups)) for start in range(0, groups, step)]


def _group_norm_forward(group):
    """``GroupNorm`` over a row-sharded map: the whole map's per-group statistics (module docstring).
    Statistics and normalisation run in fp32 (float64 stays float64), as PyTorch's kernel computes,
    chunk by chunk of groups; the result is rounded to the input's dtype once."""

    def forward(module, x: torch.Tensor) -> torch.Tensor:
        batch, channels = x.shape[:2]
        groups = module.num_groups
        compute = torch.promote_types(x.dtype, torch.float32)
        x_BGN = x.reshape(batch, groups, -1)
        chunks = _group_chunks(x_BGN)
        stats = [torch.var_mean(x_BGN[:, part].to(compute), dim=-1, correction=0) for part in chunks]
        variance_BG = torch.cat([variance for variance, _ in stats], dim=1)
        mean_BG = torch.cat([mean for _, mean in stats], dim=1)
        count = torch.full_like(mean_BG, x_BGN.shape[-1])
        local = torch.stack([count, mean_BG, variance_BG * count]).double()  # count, mean, M2
        parts = [local] if group_size(group) == 1 else [torch.empty_like(local) for _ in range(group_size(group))]
        if len(parts) > 1:
            dist.all_gather(parts, local.contiguous(), group=group)
        counts, means, m2s = torch.stack(parts).unbind(1)  # each (ranks, B, G)
        total = counts.sum(0)
        mean = (counts * means).sum(0) / total
        m2 = (m2s + counts * (means - mean) ** 2).sum(0)
        inv_std_BG = torch.rsqrt(m2 / total + module.eps).to(compute)
        mean_BG = mean.to(compute)
        out_BGN = torch.empty_like(x_BGN)
        per_group = channels // groups
        for part in chunks:
            normed = (x_BGN[:, part].to(compute) - mean_BG[:, part, None]) * inv_std_BG[:, part, None]
            if module.affine:  # per channel: the group's elements are its channels' maps, one after another
                normed = normed.unflatten(-1, (per_group, -1))
                weight = module.weight.to(compute).view(groups, per_group)[part, :, None]
                bias = module.bias.to(compute).view(groups, per_group)[part, :, None]
                normed = (normed * weight + bias).flatten(-2)
            out_BGN[:, part] = normed
        return out_BGN.view(x.shape)

    return forward


def _band_attention(attn: Attention, full_BCTHW: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """The mid block's attention (``AttnProcessor2_0``, diffusers 0.42, as the mid block calls it)
    for the queries of rows ``start .. start + rows`` of the whole map ``full_BCTHW``: the group
    norm, keys and values over the whole map, the frame-causal mask's rows of these queries (a
    token sees every token of its own and earlier frames). Returns those rows, ``x_BCTHW``."""
    batch, channels, frames, height, width = full_BCTHW.shape
    normed_BCTHW = full_BCTHW
    if attn.group_norm is not None:
        normed_BCTHW = attn.group_norm(full_BCTHW.flatten(2)).view_as(full_BCTHW)
    keys_BNC = normed_BCTHW.flatten(2).transpose(1, 2)
    queries_BnC = normed_BCTHW.narrow(ROW_DIM, start, rows).flatten(2).transpose(1, 2)
    query, key, value = attn.to_q(queries_BnC), attn.to_k(keys_BNC), attn.to_v(keys_BNC)
    head_dim = key.shape[-1] // attn.heads
    query, key, value = (t.view(batch, -1, attn.heads, head_dim).transpose(1, 2) for t in (query, key, value))
    frame_of_query = torch.arange(frames, device=query.device).repeat_interleave(rows * width)
    frame_of_key = torch.arange(frames, device=query.device).repeat_interleave(height * width)
    mask = torch.zeros((), dtype=query.dtype, device=query.device).masked_fill(
        frame_of_key[None, :] > frame_of_query[:, None], float("-inf")
    )
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask[None, None], dropout_p=0.0)
    out = out.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim).to(query.dtype)
    out = attn.to_out[1](attn.to_out[0](out))
    if attn.residual_connection:
        out = out + full_BCTHW.narrow(ROW_DIM, start, rows).flatten(2).transpose(1, 2)
    out = out / attn.rescale_output_factor
    return out.unflatten(1, (frames, rows, width)).permute(0, 4, 1, 2, 3)


def _mid_block_forward(sizes: list[int], group):
    """``HunyuanVideoMidBlock3D.forward`` (diffusers 0.42, inference branch) on a band: the resnets
    run on the band (their convs and norms are sharded), each attention gathers the whole map for
    its keys and computes this band's queries (:func:`_band_attention`)."""
    index = group_rank(group)

    def forward(module, x_BCTHW: torch.Tensor) -> torch.Tensor:
        x_BCTHW = module.resnets[0](x_BCTHW)
        for attn, resnet in zip(module.attentions, module.resnets[1:]):
            if attn is not None:
                factor = row_factor(x_BCTHW, sizes, group)
                full_BCTHW = gather_bands(x_BCTHW, sizes, group)
                x_BCTHW = _band_attention(attn, full_BCTHW, sum(sizes[:index]) * factor, sizes[index] * factor)
            x_BCTHW = resnet(x_BCTHW)
        return x_BCTHW

    return forward


# ----------------------------------------------------------------------------------- the plan
def _plan(decoder: nn.Module) -> list[tuple[str, nn.Module]]:
    """The decoder's modules that need a band forward, in order; ``RuntimeError`` for one it
    cannot shard."""
    plan: list[tuple[str, nn.Module]] = []
    attention: list[str] = []  # the mid block's attention layers run on the whole map as they are
    for name, module in decoder.named_modules():
        if any(name == block or name.startswith(f"{block}.") for block in attention):
            continue
        if isinstance(module, HunyuanVideoCausalConv3d):
            conv = module.conv
            kernel, pad = conv.kernel_size[1], module.time_causal_padding[2]
            if kernel > 1:
                if module.pad_mode not in PAD_MODES:
                    raise _refuse(name, module, f"{module.pad_mode} padding")
                if conv.stride[1] != 1 or conv.padding[1] != 0 or conv.dilation[1] != 1 or kernel != 2 * pad + 1:
                    raise _refuse(name, module, f"row kernel {kernel}, stride {conv.stride[1]}, padding {pad}")
                if module.time_causal_padding[3] != pad:
                    raise _refuse(name, module, f"row padding {module.time_causal_padding[2:4]}")
                plan.append((name, module))
        elif isinstance(module, nn.Conv3d):
            if module.kernel_size[1] > 1 and not _is_causal_conv_inner(decoder, name):
                raise _refuse(name, module, f"row kernel {module.kernel_size[1]}")  # (checked with its layer)
        elif isinstance(module, nn.GroupNorm):
            plan.append((name, module))
        elif isinstance(module, HunyuanVideoMidBlock3D):
            plan.append((name, module))
            for i, attn in enumerate(module.attentions):
                if attn is None:
                    continue
                attention.append(f"{name}.attentions.{i}")
                if not isinstance(attn, Attention) or type(attn.processor) is not AttnProcessor2_0:
                    raise _refuse(name, module, f"attention {i} is not diffusers' Attention with AttnProcessor2_0")
                if attn.spatial_norm is not None or attn.norm_q is not None or attn.norm_k is not None:
                    raise _refuse(name, module, f"attention {i} has a spatial, query or key norm")
        elif isinstance(module, HunyuanVideoUpsampleCausal3D):
            factors = tuple(module.upsample_factor)
            if any(int(f) != f or f < 1 for f in factors):
                raise _refuse(name, module, f"upsample factors {factors}")
        elif not isinstance(module, _ROW_LOCAL):
            raise _refuse(name, module, "an unknown decoder module")
    return plan


def _is_causal_conv_inner(decoder: nn.Module, name: str) -> bool:
    parent = decoder.get_submodule(name.rpartition(".")[0]) if "." in name else decoder
    return isinstance(parent, HunyuanVideoCausalConv3d)


@contextlib.contextmanager
def sharded_hunyuan_decoder(decoder: nn.Module, sizes: list[int], group) -> Iterator[None]:
    """Make ``decoder`` (a ``HunyuanVideoDecoder3D``) decode this rank's band of ``sizes`` latent rows.

    Refuses (``RuntimeError`` naming the module) a decoder with a module it does not know how to
    shard. Swaps band forwards in on the row-mixing modules (module docstring) and restores them on
    exit, also after an error. Every decoder call inside is collective over ``group``.
    """
    plan = _plan(decoder)
    with contextlib.ExitStack() as restore:
        for _, module in plan:
            if isinstance(module, HunyuanVideoCausalConv3d):
                halo = module.time_causal_padding[2]
                pad = list(module.time_causal_padding)
                pad[2] = pad[3] = 0
                restore.enter_context(attribute_set(module, "time_causal_padding", tuple(pad)))
                forward = _causal_conv_forward(halo, group)
            elif isinstance(module, nn.GroupNorm):
                forward = _group_norm_forward(group)
            else:
                forward = _mid_block_forward(sizes, group)
            restore.enter_context(forward_swapped(module, forward))
        yield


def decode_spatial_shard(vae, latents_BCTHW: torch.Tensor, group) -> torch.Tensor:
    """``vae.decode(latents_BCTHW)`` (an ``AutoencoderKLHunyuanVideo``) split by rows across
    ``group``: the whole ``video_BCFHW`` on every rank (``row_band_decode.decode_rows``: replicated
    for a group of one or too few rows, ``ValueError`` with diffusers' spatial VAE tiling)."""
    return decode_rows(vae, latents_BCTHW, group, family="HunyuanVideo", sharded_decoder=sharded_hunyuan_decoder)


class ShardedHunyuanDecode(ShardedDecode):
    """Stands in for ``vae.decode`` on an ``AutoencoderKLHunyuanVideo``, so diffusers'
    ``HunyuanVideoPipeline`` decodes through :func:`decode_spatial_shard`."""

    decode_rows = staticmethod(decode_spatial_shard)


def install(vae, ctx, family: str = "hunyuanvideo") -> bool:
    """Make ``vae.decode`` a :class:`ShardedHunyuanDecode` over the decode group when the settings
    ask for it (``row_band_decode.install``); returns whether it did."""
    return row_band_decode.install(vae, ctx, family, ShardedHunyuanDecode)
