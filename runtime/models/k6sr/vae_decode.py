"""tilecast's K-VAE decode: diffusers' weights and arithmetic, laid out for speed.

diffusers' ``Kandinsky6SRVAE.decode`` spends most of a tile's time outside its convolutions
(the profile is in the README, Performance): every ``Kandinsky6SRSpatialNorm3D`` nearest-upsamples
the 64-channel latent ``zq`` to the full feature grid before two 1x1 convolutions, every causal
convolution pads, concatenates and copies its input and its output, cuDNN converts each NCDHW
activation to channels-last and back, and the fp32 RMS norm, modulation, SiLU and residual adds
each make their own pass over memory.

``ChannelsLastDecoder`` computes the same function with:

- **channels-last activations** (``x_BTHWC``, viewed as channels-last NCDHW for ``F.conv3d``):
  cuDNN runs its NHWC kernels with no layout conversions (3x3x3 weights are made channels-last
  in place once; a 1x1x1 convolution is an ``F.linear`` over the channel axis);
- **``zq`` convolved at latent resolution**: ``conv_y``/``conv_b`` are per-pixel linear maps, so
  they commute with nearest upsampling; the spatial upsampling then happens by broadcasting inside
  the normalisation, never materialised (the temporal one is a gather on the small latent grid);
- **causal convolutions read one buffer**: whatever computes a convolution's input (a spatial
  norm, a frame repeat) writes it into a buffer with room in front for the causal frames (the
  carried ones, or the first frame repeated), so nothing is concatenated; the spatial zero padding
  is the convolution's own;
- **one kernel per spatial norm** on CUDA: RMS norm, modulation and SiLU fused in Triton
  (``kernels/spatial_norm.py``; elsewhere the same ops in PyTorch), writing straight into the
  next causal convolution's input buffer;
- **no bias passes**: 3-D convolutions run without bias; it is added in a pass made anyway (the
  next spatial norm, or the residual add, ``kernels/channel_bias.py``). PyTorch would add it in a
  broadcast pass of its own, 10% of a tile's decode on channels-last video;
- **frame repeats** (the upsamplers' frame doubling, the first segment's repeated first frame)
  copy whole channel rows in Triton (``kernels/upsample.py``), not PyTorch's generic strided copy;
- **spatial upsampling by phases** (``PhasedUpsample``): diffusers doubles every pixel, convolves the
  doubled grid 1x3x3, adds the doubled input and applies a 1x1 linear. Each of the four output
  phases (even/odd row, even/odd column) of that is a 2x2 convolution of the *undoubled* input,
  with the 3x3 taps summed that land on the same source pixel, the linear folded into the weights
  and the residual into the centre tap. One 2x2 convolution with four phases' output channels
  replaces a 3x3 and a 1x1 on a four times larger grid: 16 multiply-adds per pixel and channel
  pair instead of 40 (the spatial convolutions were 19% of a tile's FLOPs), and the doubled grid
  is written once, by the interleave that adds the bias.

Segments are diffusers' (the first segment one latent frame longer, ``SEGMENT_FRAMES`` pixel
frames after it) and each causal convolution carries the same frames across them, so peak memory
is bounded the same way and the result does not depend on the segmentation. Not bit-exact with
diffusers (other kernels sum in other orders): float32 within 1e-5 of it on the tiny checkpoint
(``tests/test_vae_decode.py``); bf16 on the GPU in ``tests/test_cuda_fast_paths.py``.

Spatial-shard decode (``spatial_shard.py``) swaps the forwards of diffusers' modules and so keeps
diffusers' decode; so does a VAE streamed layer by layer (its hooks sit on those forwards).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Callable

import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kandinsky6_sr import (
    SEGMENT_FRAMES,
    Kandinsky6SRCausalConv3d,
    Kandinsky6SRResnetBlock3D,
    Kandinsky6SRSpatialNorm3D,
    Kandinsky6SRUpsample,
)
from torch import nn
from torch.profiler import record_function

from tilecast.kernels import fp8_conv, narrow_conv
from tilecast.kernels.channel_bias import add_bias_
from tilecast.kernels.spatial_norm import e4m3_scale, norm_modulate_silu, norm_modulate_silu_e4m3
from tilecast.kernels.upsample import interleave_phases, repeat_frames
from tilecast.kernels.upsample import output_shape as upsample_shape


def _as_ncdhw(x_BTHWC: torch.Tensor) -> torch.Tensor:
    """The channels-last NCDHW view of a ``BTHWC`` tensor (no copy)."""
    return x_BTHWC.permute(0, 4, 1, 2, 3)


def conv(
    x_BTHWC: torch.Tensor, layer: nn.Conv3d, padding: tuple[int, int, int] | None = None, *, bias: bool = True
) -> torch.Tensor:
    """``layer`` applied to a ``BTHWC`` tensor (``padding`` overrides the layer's own). ``bias=False``
    leaves the bias out, for the caller to add in a pass it makes anyway (``add_bias_``, or the
    next spatial norm)."""
    if layer.kernel_size == (1, 1, 1) and layer.stride == (1, 1, 1):
        return F.linear(x_BTHWC, layer.weight.flatten(1), layer.bias if bias else None)
    y_BCTHW = F.conv3d(
        _as_ncdhw(x_BTHWC),
        layer.weight,
        layer.bias if bias else None,
        layer.stride,
        layer.padding if padding is None else padding,
    )
    return y_BCTHW.permute(0, 2, 3, 4, 1).contiguous()


def nearest_index(size_in: int, size_out: int, device) -> torch.Tensor:
    """Source index of every output position of PyTorch's ``nearest`` resize (float32 scale)."""
    scale = torch.tensor(size_in, dtype=torch.float32) / size_out
    index = (torch.arange(size_out, dtype=torch.float32) * scale).floor().long().clamp(max=size_in - 1)
    return index.to(device)


@functools.cache  # asked by every spatial norm of every segment, for a handful of sizes
def _repeat_factor(size_in: int, size_out: int) -> int | None:
    """``r`` when nearest resizing ``size_in`` -> ``size_out`` repeats every element ``r`` times."""
    if size_out % size_in:
        return None
    r = size_out // size_in
    expected = torch.arange(size_out) // r
    return r if torch.equal(nearest_index(size_in, size_out, "cpu"), expected) else None


class ChannelsLastDecoder:
    """Decodes latents with a ``Kandinsky6SRVAE``'s decoder weights (see the module docstring).

    ``decode`` takes what ``Kandinsky6SRVAE.decode`` takes (latents already divided by the scaling
    factor, ``BCTHW``) and returns what it returns (the ``BCTHW`` video tensor).

    ``narrow_convs``: run the causal convolutions with at most ``NARROW_CHANNELS`` output channels
    (the full-resolution level's) on ``kernels/narrow_conv.py``'s Triton kernels instead of cuDNN,
    at ``fastest_tiling`` (2.1-2.3x cuDNN per layer on an H100; ``tilecast bench narrow-conv
    --decode``). ``None`` (the default): on where the decoder's weights are on a CUDA device and
    Triton is installed. ``True`` needs Triton (a GPU, or its interpreter on the CPU). A call whose
    activations are not on the device the weights were packed on (an offloaded VAE) runs those
    convolutions on PyTorch's.

    ``fp8_convs`` (opt-in, ``--vae-config.fp8-convs``): the causal and upsampling convolutions with
    more than ``NARROW_CHANNELS`` input and output channels in FP8 (``kernels/fp8_conv.py``: e4m3
    weights scaled per output channel, activations per tensor, float32 accumulation); a resnet
    block's spatial norm writes its convolution's input in e4m3 itself (``_norm_silu_conv``). Needs
    Triton (Hopper, or its interpreter on the CPU); the output moves (``tilecast bench fp8-conv``)."""

    NARROW_CHANNELS = 16

    def __init__(self, vae: nn.Module, *, narrow_convs: bool | None = None, fp8_convs: bool = False) -> None:
        self.decoder = vae.decoder
        self.temporal_ratio = int(vae.temporal_compression_ratio)
        self._carried: dict[int, torch.Tensor] = {}
        self._alive: Callable[[], None] | None = None
        self._latents: torch.Tensor | None = None  # the whole decode's, while it runs (``_e4m3_scale``)
        self._e4m3_scales: dict[int, torch.Tensor] = {}
        self._indices: dict[tuple, torch.Tensor | None] = {}
        self._check_modules()
        self._channels_last_weights()
        if fp8_convs and importlib.util.find_spec("triton") is None:
            raise ValueError("ChannelsLastDecoder(fp8_convs=True) needs Triton, which is not installed")
        self._phased = {
            id(module): PhasedUpsample(module, fp8=fp8_convs and self._wide(module.spatial_conv))
            for module in self.decoder.modules()
            if isinstance(module, Kandinsky6SRUpsample)
        }
        self._fp8 = {
            id(module): fp8_conv.pack_weight(module.conv.weight)
            for module in self.decoder.modules()
            if fp8_convs and isinstance(module, Kandinsky6SRCausalConv3d) and self._wide(module.conv)
        }
        if narrow_convs is None:
            on_cuda = next(self.decoder.parameters()).is_cuda
            narrow_convs = on_cuda and importlib.util.find_spec("triton") is not None
        self._narrow = self._pack_narrow_convs() if narrow_convs else {}

    @classmethod
    def _wide(cls, layer: nn.Conv3d) -> bool:
        """Whether ``fp8_convs`` takes ``layer``: more than ``NARROW_CHANNELS`` channels in and out,
        counts ``fp8_conv`` takes."""
        channels = (layer.in_channels, layer.out_channels)
        return min(channels) > cls.NARROW_CHANNELS and fp8_conv.channels_fit(*channels)

    def _check_modules(self) -> None:
        for name, module in self.decoder.named_modules():
            if isinstance(module, Kandinsky6SRCausalConv3d) and module.time_stride != 1:
                raise ValueError(f"ChannelsLastDecoder: decoder module {name} has temporal stride {module.time_stride}")

    def _channels_last_weights(self) -> None:
        """Make every 3x3x3 / 1x3x3 / 3x1x1 kernel channels-last in place (cuDNN's NHWC kernels take
        them as they are; a contiguous weight would be converted on every call)."""
        for module in self.decoder.modules():
            if isinstance(module, nn.Conv3d) and module.kernel_size != (1, 1, 1):
                module.weight.data = module.weight.data.contiguous(memory_format=torch.channels_last_3d)

    def _pack_narrow_convs(self) -> dict:
        """``id(causal conv) -> (PackedWeight, Tiling)`` for the 3x3x3 convolutions with few output
        channels (padded by 1 in height and width, as every K-VAE 3x3x3 convolution is)."""
        if importlib.util.find_spec("triton") is None:
            raise ValueError("ChannelsLastDecoder(narrow_convs=True) needs Triton, which is not installed")
        packed = {}
        for module in self.decoder.modules():
            if (
                isinstance(module, Kandinsky6SRCausalConv3d)
                and module.conv.out_channels <= self.NARROW_CHANNELS
                and module.conv.kernel_size == (3, 3, 3)
                and (module.height_pad, module.width_pad) == (1, 1)
            ):
                tiling = narrow_conv.fastest_tiling(module.conv.in_channels)
                packed[id(module)] = narrow_conv.pack_weight(module.conv.weight.detach(), tiling.bk), tiling
        return packed

    # ------------------------------------------------------------------ public
    @torch.no_grad()
    def decode(self, z_BCTHW: torch.Tensor, *, alive: Callable[[], None] | None = None) -> torch.Tensor:
        """Video ``BCTHW`` of latents ``z_BCTHW`` (divided by the scaling factor), in diffusers' segments.
        ``alive()`` is called after every resnet block and upsampler of every segment (the stuck
        watchdog's heartbeat: a long decode is one stage with no other progress)."""
        latent_segment = SEGMENT_FRAMES // self.temporal_ratio
        num_latent_frames = z_BCTHW.shape[2]
        if num_latent_frames == 1:
            lengths = [1]
        else:
            lengths = [latent_segment] * ((num_latent_frames - 1) // latent_segment)
            if (num_latent_frames - 1) % latent_segment:
                lengths.append((num_latent_frames - 1) % latent_segment)
            lengths[0] += 1
        z_BTHWC = z_BCTHW.permute(0, 2, 3, 4, 1)
        self._carried, self._alive, self._latents, self._e4m3_scales = {}, alive, z_BTHWC, {}
        try:
            segments = [
                self._segment(part.contiguous(), first=index == 0)
                for index, part in enumerate(torch.split(z_BTHWC, lengths, dim=1))
            ]
        finally:
            self._carried, self._alive, self._latents, self._e4m3_scales = {}, None, None, {}
        return torch.cat(segments, dim=1).permute(0, 4, 1, 2, 3).contiguous()

    # ------------------------------------------------------------------ layers
    def _segment(self, z_BTHWC: torch.Tensor, *, first: bool) -> torch.Tensor:
        """One segment's decode; the profiler sees each part as a named range (``bench k6sr --profile``)."""
        decoder = self.decoder
        with record_function("k-vae: conv_in + mid"):
            h = add_bias_(self._causal_conv(decoder.conv_in, z_BTHWC, first), decoder.conv_in.conv.bias)
            h = self._beat(self._resnet(decoder.mid.block_1, h, z_BTHWC, first))
            h = self._beat(self._resnet(decoder.mid.block_2, h, z_BTHWC, first))
        for level in reversed(range(len(decoder.up))):
            up = decoder.up[level]
            with record_function(f"k-vae: level {level} ({up.block[-1].out_channels} channels)"):
                for block in up.block:
                    h = self._beat(self._resnet(block, h, z_BTHWC, first))
            if hasattr(up, "upsample"):
                with record_function(f"k-vae: level {level} upsample"):
                    h = self._beat(self._upsample(up.upsample, h, first))
        with record_function("k-vae: norm_out + conv_out"):
            out = self._norm_silu_conv(decoder.norm_out, decoder.conv_out, h, z_BTHWC, first)
            return add_bias_(out, decoder.conv_out.conv.bias)

    def _beat(self, h_BTHWC: torch.Tensor) -> torch.Tensor:
        """``h`` unchanged, after telling ``decode``'s ``alive`` that a block is done."""
        if self._alive is not None:
            self._alive()
        return h_BTHWC

    def _causal_input(
        self, layer: Kandinsky6SRCausalConv3d, like: torch.Tensor, shape: tuple[int, ...] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(buffer, body)``: an empty input of ``layer`` for a ``BTHWC`` tensor of ``shape`` (default
        ``like``'s), ``layer.time_pad`` causal frames in front of ``body``. Whoever computes that
        tensor writes it into ``body`` (no concatenation)."""
        batch, frames, height, width, channels = like.shape if shape is None else shape
        buffer = like.new_empty(batch, layer.time_pad + frames, height, width, channels)
        return buffer, buffer[:, layer.time_pad :]

    def _causal_conv_buffer(self, layer: Kandinsky6SRCausalConv3d, buffer: torch.Tensor, first: bool) -> torch.Tensor:
        """Convolve a filled ``_causal_input`` buffer: causal along time (the first segment repeats its
        first frame, later ones take the frames the previous segment left), zero padded in space.
        Without the bias (``layer.conv.bias``): the caller adds it (``conv(bias=False)``)."""
        self._causal_frames(layer, buffer, first)
        fp8 = self._fp8.get(id(layer))
        if fp8 is not None and fp8.q_NK.device == buffer.device:
            return fp8_conv.fp8_conv(buffer, fp8, (layer.height_pad, layer.width_pad))
        packed, tiling = self._narrow.get(id(layer), (None, None))
        if packed is not None and packed.packed.device == buffer.device:
            return narrow_conv.triton_conv(buffer, packed, (layer.height_pad, layer.width_pad), tiling)
        return conv(buffer, layer.conv, padding=(0, layer.height_pad, layer.width_pad), bias=False)

    def _causal_frames(self, layer: Kandinsky6SRCausalConv3d, buffer: torch.Tensor, first: bool) -> None:
        """Fill a ``_causal_input`` buffer's ``layer.time_pad`` causal frames (the first segment repeats
        its first frame, later ones take the frames the previous segment left) and keep its last ones."""
        pad = layer.time_pad
        if not pad:
            return
        if not first:
            buffer[:, :pad] = self._carried[id(layer)]
        elif buffer.dtype == torch.float8_e4m3fn:  # two frames, once per decode: a plain copy
            buffer[:, :pad] = buffer[:, pad : pad + 1]
        else:
            repeat_frames(buffer[:, pad : pad + 1], pad, out=buffer[:, :pad])
        self._carried[id(layer)] = buffer[:, -pad:].clone()

    def _causal_conv(self, layer: Kandinsky6SRCausalConv3d, x_BTHWC: torch.Tensor, first: bool) -> torch.Tensor:
        """``_causal_conv_buffer`` of a copy of ``x`` (without the bias)."""
        buffer, body = self._causal_input(layer, x_BTHWC)
        body.copy_(x_BTHWC)
        return self._causal_conv_buffer(layer, buffer, first)

    def _norm_silu_conv(
        self,
        norm: Kandinsky6SRSpatialNorm3D,
        layer: Kandinsky6SRCausalConv3d,
        h_BTHWC: torch.Tensor,
        zq_BTHWC: torch.Tensor,
        first: bool,
        h_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``layer(silu(norm(h + h_bias, zq)))`` without ``layer``'s bias, the norm written straight into
        the convolution's input: in e4m3 with its zero padding where ``layer`` runs in FP8."""
        fp8 = self._fp8.get(id(layer))
        if fp8 is None or fp8.q_NK.device != h_BTHWC.device:
            buffer, body = self._causal_input(layer, h_BTHWC)
            self._spatial_norm_silu(norm, h_BTHWC, zq_BTHWC, first, out=body, h_bias=h_bias)
            return self._causal_conv_buffer(layer, buffer, first)
        batch, frames, height, width, channels = h_BTHWC.shape
        padding = (layer.height_pad, layer.width_pad)
        shape = (batch, layer.time_pad + frames, height + 2 * padding[0], width + 2 * padding[1], channels)
        buffer = h_BTHWC.new_empty(shape, dtype=torch.float8_e4m3fn)
        y, b, rh, rw = self._modulation(norm, h_BTHWC, zq_BTHWC, first)
        scale = self._e4m3_scale(norm)
        rms = norm.norm_layer
        norm_modulate_silu_e4m3(
            h_BTHWC,
            rms.scale,
            rms.gamma.view(-1),
            y,
            b,
            rh,
            rw,
            out=buffer[:, layer.time_pad :],
            out_scale=scale,
            padding_hw=padding,
            h_bias_C=h_bias,
        )
        self._causal_frames(layer, buffer, first)
        return fp8_conv.conv_quantized(buffer, scale, fp8, h_BTHWC.dtype)

    def _e4m3_scale(self, norm: Kandinsky6SRSpatialNorm3D) -> torch.Tensor:
        """``spatial_norm.e4m3_scale`` of ``norm`` over the whole decode's latents, made once per decode:
        every segment's convolution input (and the frames it carries into the next) shares it."""
        if id(norm) not in self._e4m3_scales:
            latents = self._latents.contiguous()
            y, b = conv(latents, norm.conv_y), conv(latents, norm.conv_b)
            self._e4m3_scales[id(norm)] = e4m3_scale(norm.norm_layer.scale, norm.norm_layer.gamma.view(-1), y, b)
        return self._e4m3_scales[id(norm)]

    def _spatial_norm_silu(
        self,
        norm: Kandinsky6SRSpatialNorm3D,
        h_BTHWC: torch.Tensor,
        zq_BTHWC: torch.Tensor,
        first: bool,
        out: torch.Tensor | None = None,
        h_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``silu(norm(h, zq))`` with ``zq``'s 1x1 convolutions at latent resolution."""
        y, b, rh, rw = self._modulation(norm, h_BTHWC, zq_BTHWC, first)
        rms = norm.norm_layer
        return norm_modulate_silu(h_BTHWC, rms.scale, rms.gamma.view(-1), y, b, rh, rw, out=out, h_bias_C=h_bias)

    def _modulation(
        self, norm: Kandinsky6SRSpatialNorm3D, h_BTHWC: torch.Tensor, zq_BTHWC: torch.Tensor, first: bool
    ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """``(y, b, rh, rw)``: ``norm``'s two 1x1 convolutions of ``zq`` at latent resolution, on ``h``'s
        frames, and the factors that repeat their pixels onto ``h``'s grid."""
        _, frames, height, width, _ = h_BTHWC.shape
        zq_frames, zq_height, zq_width = zq_BTHWC.shape[1:4]
        time_index = self._index(("time", zq_frames, frames, first), zq_BTHWC.device)
        if time_index is not None:
            zq_BTHWC = zq_BTHWC[:, time_index]
        rh, rw = _repeat_factor(zq_height, height), _repeat_factor(zq_width, width)
        if rh is None or rw is None:  # not a plain repeat: gather the rows and columns (never at released sizes)
            zq_BTHWC = zq_BTHWC[:, :, self._index(("space", zq_height, height), zq_BTHWC.device)]
            zq_BTHWC = zq_BTHWC[:, :, :, self._index(("space", zq_width, width), zq_BTHWC.device)]
            rh = rw = 1
        return conv(zq_BTHWC, norm.conv_y), conv(zq_BTHWC, norm.conv_b), rh, rw

    def _index(self, key: tuple, device: torch.device) -> torch.Tensor | None:
        """A gather index on ``device``, made once per shape (a host-to-device copy waits for the
        GPU, so one per norm would stall the launch queue); None for the identity.

        ``("time", zq_frames, frames, first)``: the zq frame of every feature frame. The first
        segment maps its first frame to zq's first and resizes zq[1:] onto the rest (diffusers'
        rule; one latent frame broadcasts). ``("space", size_in, size_out)``: nearest rows/columns."""
        cache_key = (*key, device)
        if cache_key not in self._indices:
            if key[0] == "space":
                index = nearest_index(key[1], key[2], "cpu").tolist()
                size_in = key[1]
            else:
                _, size_in, frames, first = key
                if not first:
                    index = nearest_index(size_in, frames, "cpu").tolist()
                elif size_in == 1 or frames == 1:
                    index = [0] * frames
                else:
                    index = [0] + (1 + nearest_index(size_in - 1, frames - 1, "cpu")).tolist()
            identity = index == list(range(size_in))
            self._indices[cache_key] = None if identity else torch.tensor(index, device=device)
        return self._indices[cache_key]

    def _resnet(self, block: Kandinsky6SRResnetBlock3D, x_BTHWC: torch.Tensor, zq_BTHWC: torch.Tensor, first: bool):
        h = self._norm_silu_conv(block.norm1, block.conv1, x_BTHWC, zq_BTHWC, first)
        h = self._norm_silu_conv(block.norm2, block.conv2, h, zq_BTHWC, first, h_bias=block.conv1.conv.bias)
        residual = conv(x_BTHWC, block.nin_shortcut) if block.in_channels != block.out_channels else x_BTHWC
        return add_bias_(h, block.conv2.conv.bias, residual)

    def _upsample(self, upsample: Kandinsky6SRUpsample, x_BTHWC: torch.Tensor, first: bool) -> torch.Tensor:
        if upsample.compress_time:  # T + 1 frames -> 2T + 1: repeat every frame, the first segment drops one copy
            drop = 1 if first else 0
            shape = upsample_shape(x_BTHWC, 2, drop)
            buffer, body = self._causal_input(upsample.temporal_conv, x_BTHWC, shape)
            repeat_frames(x_BTHWC, 2, drop, out=body)
            x_BTHWC = self._causal_conv_buffer(upsample.temporal_conv, buffer, first)
            x_BTHWC = add_bias_(x_BTHWC, upsample.temporal_conv.conv.bias, body)
        return self._phased[id(upsample)](x_BTHWC)


class PhasedUpsample:
    """``linear(up(x) + spatial_conv(up(x)))`` of a ``Kandinsky6SRUpsample`` (``up``: nearest 2x in
    height and width), computed on ``x``'s own grid: one 2x2 convolution with ``4 C`` output channels,
    one ``C``-channel group per output phase, then an interleave that adds the bias.

    Output pixel ``(2i + a, 2j + b)`` of the 3x3 convolution (zero padded by 1) reads doubled rows
    ``2i + a - 1 .. 2i + a + 1``, which are source rows ``i - 1, i, i`` for ``a = 0`` and
    ``i, i, i + 1`` for ``a = 1`` (columns alike). So phase ``(a, b)`` is a 2x2 convolution over
    source rows ``i + a - 1, i + a`` and columns ``j + b - 1, j + b``, whose taps sum the 3x3 taps
    that read the same source pixel (``SUMS``); the zero padding of the doubled grid is the zero
    padding of the source grid. One 2x2 convolution padded by 1 computes all four phases at once:
    phase ``(a, b)`` of source pixel ``(i, j)`` is its output ``(i + a, j + b)``, channels
    ``(2a + b) C .. (2a + b + 1) C``. The linear ``L`` distributes over the sum (``L (x + W * x) =
    L x + (L W) * x``): its product with the taps is the weight, ``L`` itself joins the tap that
    reads ``(i, j)`` (row ``1 - a``, column ``1 - b``), and the bias is ``L b_spatial + b_linear``.
    The weights are combined once, in float32 (float64 for a float64 layer), and rounded to the layer's
    dtype. ``fp8``: the 2x2 convolution in FP8 (``kernels/fp8_conv.py``), from the rounded weights."""

    SUMS = ((1, 0, 0), (0, 1, 1)), ((1, 1, 0), (0, 0, 1))
    """``SUMS[a][r][k]``: 1 where tap ``r`` of phase ``a``'s 2x2 kernel sums row ``k`` of the 3x3 kernel
    (columns alike)."""

    def __init__(self, upsample: Kandinsky6SRUpsample, *, fp8: bool = False) -> None:
        spatial, linear = upsample.spatial_conv, upsample.linear
        if spatial.kernel_size != (1, 3, 3) or spatial.padding != (0, 1, 1) or spatial.stride != (1, 1, 1):
            raise ValueError(
                f"PhasedUpsample: spatial_conv is {spatial}, expected a 1x3x3 convolution padded (0, 1, 1)"
            )
        dtype = spatial.weight.dtype
        work = torch.promote_types(dtype, torch.float32)  # float32, or float64 for a float64 layer
        lin = linear.weight.detach().flatten(1).to(work)  # (out, in)
        taps = torch.einsum("po,oikl->pikl", lin, spatial.weight.detach()[:, :, 0].to(work))  # (out, in, 3, 3)
        sums = torch.tensor(self.SUMS, dtype=work, device=taps.device)
        phases = []
        for a in (0, 1):
            for b in (0, 1):
                kernel = torch.einsum("rk,sl,oikl->oirs", sums[a], sums[b], taps)
                kernel[:, :, 1 - a, 1 - b] += lin  # the doubled input's residual, through the linear
                phases.append(kernel)
        weight = torch.cat(phases).unsqueeze(2).to(dtype)  # (4 C, C, 1, 2, 2)
        self.weight = weight.contiguous(memory_format=torch.channels_last_3d)
        bias = lin @ spatial.bias.detach().to(work) if spatial.bias is not None else lin.new_zeros(lin.shape[0])
        if linear.bias is not None:
            bias = bias + linear.bias.detach().to(work)
        self.bias = bias.to(dtype)
        self.fp8 = fp8_conv.pack_weight(self.weight) if fp8 else None

    def __call__(self, x_BTHWC: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None and self.fp8.q_NK.device == x_BTHWC.device:
            return interleave_phases(fp8_conv.fp8_conv(x_BTHWC, self.fp8, (1, 1)), self.bias)
        y_BCTHW = F.conv3d(_as_ncdhw(x_BTHWC), self.weight, None, 1, (0, 1, 1))
        return interleave_phases(y_BCTHW.permute(0, 2, 3, 4, 1), self.bias)  # (B, T, H + 1, W + 1, 4 C) -> 2x grid
