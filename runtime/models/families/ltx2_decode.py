"""Parallel LTX-2 video VAE decode: each rank of the decode group decodes a band of rows.

Legend: ``latents_BCTHW`` (batch, latent channels, latent frames, rows, cols); ``x_BCTHW`` a
decoder feature map; ``video_BCFHW`` decoded pixels (frames F).

The same split as Wan's and HunyuanVideo's (``wan_decode``, ``hunyuan_decode``), for
``AutoencoderKLLTX2Video``'s decoder, which runs on the whole clip at once without a feature cache
(diffusers' temporal and spatial tiling are off unless enabled; enabled tiling is refused here).
Its modules, and what :func:`sharded_ltx2_decoder` does about them while it decodes (forwards
swapped on the instances, restored after, also after an error):

- ``LTX2VideoCausalConv3d`` with a 3x3 spatial kernel: its ``Conv3d`` pads rows and columns by one
  with the decoder's ``spatial_padding_mode`` (``reflect`` as released) after the layer's own time
  padding (causal or symmetric, by repeating the edge frames). The band forward repeats the time
  padding as diffusers writes it, gives the band one halo row from each neighbour with the padding
  mode at the true edges (``kernels.halo.halo_pad``: reflect mirrors the rows after the edge), pads
  the columns with the same mode and runs the convolution without padding.
- Row-local, nothing to do: ``PerChannelRMSNorm`` (per pixel over channels), the resnets' channel
  ``LayerNorm`` and 1x1 shortcut, SiLU, dropout, the timestep conditioning (one vector per video),
  ``LTX2VideoUpsampler3d`` (a depth-to-space upsample: output row ``i`` comes from input row
  ``i // s`` of the convolution's output) and the final unpatchify (4x4 patches). The decoder has no
  attention and no group norm.
- Refused: noise injection (``decoder_inject_noise``: each resnet draws ``(rows, cols)`` noise from
  the global generator per call, which no band split can reproduce), any other module type, a
  strided or dilated row kernel, another padding mode.

The decoded bands are all-gathered, so every rank returns the whole video. LTX-2's audio VAE and
vocoder decode the soundtrack replicated, as before (a small share of the decode).

**Numerics.** The halo rows carry the serial decode's values and every other op is per pixel, so
only the convolutions' shapes differ from serial (fp rounding). Measured on the tiny checkpoint's
VAE against serial ``vae.decode`` (``tests/test_ltx2_decode.py``, 9 frames of 256 x 64 px, 2 and 4
ranks): fp32 max |diff| 3.8e-6, uint8 frames PSNR 95 dB, max diff 1/255; float64 5.4e-15 or 0.
Per 3x3 conv call one halo row goes to each neighbour; nothing else is exchanged until the bands
are gathered. Not measured on GPUs yet (no several-GPU machine was available).

Settings, bands and the driver are ``row_band_decode``'s, as for Wan
(``--vae-config.use-parallel-decode``, the decode group of one DP replica,
``k6sr.spatial_shard.shard_sizes``, replicated decode for fewer than ``MIN_ROWS_PER_SHARD`` latent
rows per rank). With LTX-2's 32x spatial compression a 512-pixel-high video has 16 latent rows: 8
ranks at most split it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl_ltx2 import (
    LTX2VideoCausalConv3d,
    LTX2VideoDecoder3d,
    LTX2VideoMidBlock3d,
    LTX2VideoResnetBlock3d,
    LTX2VideoUpBlock3d,
    LTX2VideoUpsampler3d,
    PerChannelRMSNorm,
)
from torch import nn

from tilecast.kernels.halo import PAD_MODES, halo_pad
from tilecast.runtime.models.families import row_band_decode
from tilecast.runtime.models.families.row_band_decode import (
    MIN_ROWS_PER_SHARD,
    ROW_DIM,
    ShardedDecode,
    decode_rows,
    forward_swapped,
    refusal,
)

__all__ = ["MIN_ROWS_PER_SHARD", "ShardedLTX2Decode", "decode_spatial_shard", "install", "sharded_ltx2_decoder"]

_ROW_LOCAL = (
    LTX2VideoDecoder3d,
    LTX2VideoMidBlock3d,
    LTX2VideoUpBlock3d,
    LTX2VideoResnetBlock3d,
    LTX2VideoUpsampler3d,
    PerChannelRMSNorm,
    nn.LayerNorm,
    nn.ModuleList,
    nn.Dropout,
    nn.SiLU,
)
"""Decoder module types that only pass rows through (containers, per-pixel ops); their
submodules are checked on their own."""


_refuse = functools.partial(refusal, "LTX-2")
"""``_refuse(name, module, why)``: the error for a decoder module this decode cannot shard."""


def _causal_conv_forward(group):
    """``LTX2VideoCausalConv3d.forward`` (diffusers 0.42) on a band: the time padding verbatim, then
    halo rows (the padding mode at the true edges), the columns padded, an unpadded convolution."""

    def forward(module, hidden_states: torch.Tensor, causal: bool = True) -> torch.Tensor:
        time_kernel_size = module.kernel_size[0]
        if causal:
            pad_left = hidden_states[:, :, :1, :, :].repeat((1, 1, time_kernel_size - 1, 1, 1))
            hidden_states = torch.concatenate([pad_left, hidden_states], dim=2)
        else:
            pad_left = hidden_states[:, :, :1, :, :].repeat((1, 1, (time_kernel_size - 1) // 2, 1, 1))
            pad_right = hidden_states[:, :, -1:, :, :].repeat((1, 1, (time_kernel_size - 1) // 2, 1, 1))
            hidden_states = torch.concatenate([pad_left, hidden_states, pad_right], dim=2)
        conv = module.conv
        _, row_pad, col_pad = conv.padding
        mode = conv.padding_mode
        hidden_states = halo_pad(hidden_states, dim=ROW_DIM, halo=row_pad, group=group, mode=mode)
        hidden_states = F.pad(
            hidden_states, (col_pad, col_pad, 0, 0, 0, 0), mode="constant" if mode == "zeros" else mode
        )
        return F.conv3d(hidden_states, conv.weight, conv.bias, conv.stride, 0, conv.dilation, conv.groups)

    return forward


def _plan(decoder: nn.Module) -> list[tuple[str, nn.Module]]:
    """The decoder's convs that need a band forward, in order; ``RuntimeError`` for a module it
    cannot shard."""
    plan: list[tuple[str, nn.Module]] = []
    skip: list[str] = []  # timestep embedders: one vector per video, nothing spatial
    for name, module in decoder.named_modules():
        if any(name == prefix or name.startswith(f"{prefix}.") for prefix in skip):
            continue
        if name.endswith("time_embedder"):
            skip.append(name)
        elif isinstance(module, LTX2VideoCausalConv3d):
            conv = module.conv
            kernel, pad = conv.kernel_size[1], conv.padding[1]
            if kernel > 1:
                if conv.padding_mode not in PAD_MODES:
                    raise _refuse(name, module, f"{conv.padding_mode} padding")
                if conv.stride[1] != 1 or conv.dilation[1] != 1 or kernel != 2 * pad + 1 or conv.stride[2] != 1:
                    raise _refuse(name, module, f"row kernel {kernel}, stride {conv.stride[1]}, padding {pad}")
                plan.append((name, module))
        elif isinstance(module, nn.Conv3d):
            parent = decoder.get_submodule(name.rpartition(".")[0]) if "." in name else decoder
            if module.kernel_size[1] > 1 and not isinstance(parent, LTX2VideoCausalConv3d):
                raise _refuse(name, module, f"row kernel {module.kernel_size[1]}")
        elif isinstance(module, LTX2VideoResnetBlock3d) and (
            module.per_channel_scale1 is not None or module.per_channel_scale2 is not None
        ):
            raise _refuse(
                name, module, "noise injection draws each call's (rows, cols) noise from the global generator"
            )
        elif not isinstance(module, _ROW_LOCAL):
            raise _refuse(name, module, "an unknown decoder module")
    return plan


@contextlib.contextmanager
def sharded_ltx2_decoder(decoder: nn.Module, group) -> Iterator[None]:
    """Make ``decoder`` (an ``LTX2VideoDecoder3d``) decode this rank's band of rows: the row-mixing
    convs get band forwards (module docstring), restored on exit, also after an error. Refuses
    (``RuntimeError`` naming the module) a decoder with a module it does not know how to shard.
    Every decoder call inside is collective over ``group``."""
    plan = _plan(decoder)
    with contextlib.ExitStack() as restore:
        for _, module in plan:
            restore.enter_context(forward_swapped(module, _causal_conv_forward(group)))
        yield


def decode_spatial_shard(vae, latents_BCTHW: torch.Tensor, group, temb=None, causal=None) -> torch.Tensor:
    """``vae.decode(latents_BCTHW, temb, causal)`` (an ``AutoencoderKLLTX2Video``) split by rows
    across ``group``: the whole ``video_BCFHW`` on every rank (``row_band_decode.decode_rows``:
    replicated for a group of one or too few rows, ``ValueError`` with diffusers' VAE tiling or
    framewise decoding, which would tile each band on its own)."""
    return decode_rows(
        vae,
        latents_BCTHW,
        group,
        temb,
        causal,
        family="LTX-2",
        sharded_decoder=lambda decoder, sizes, group: sharded_ltx2_decoder(decoder, group),
        tiling=("use_tiling", "use_framewise_decoding"),
        tiling_names="vae.enable_tiling / framewise decoding",
    )


class ShardedLTX2Decode(ShardedDecode):
    """Stands in for ``vae.decode`` on an ``AutoencoderKLLTX2Video``, so diffusers' LTX-2 pipelines
    decode through :func:`decode_spatial_shard` (``temb`` and ``causal`` pass through)."""

    decode_rows = staticmethod(decode_spatial_shard)


def install(vae, ctx, family: str = "ltx-2") -> bool:
    """Make ``vae.decode`` a :class:`ShardedLTX2Decode` over the decode group when the settings ask
    for it (``row_band_decode.install``); returns whether it did."""
    return row_band_decode.install(vae, ctx, family, ShardedLTX2Decode)
