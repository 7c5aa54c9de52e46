"""FP8 3-D convolutions on channels-last video: an implicit GEMM over shifted rows, in Triton.

The K-VAE decode is 82-85% convolutions, and its 3x3x3 convolutions with 256-2048 channels already
run at 750-836 TFLOP/s on cuDNN in bf16 (README, Performance): the decode gets faster only with
fewer bytes per multiply-add. This is the opt-in trade (``--vae-config.fp8-convs``): e4m3
operands on FP8 tensor cores, float32 accumulation, output in the activations' dtype.

Scales: a weight has one float32 scale per output channel (``fp8.quantize_rows`` over its
``KT KH KW C_in`` taps); an activation has one per tensor (its largest magnitude onto e4m3's 448),
because a row of the implicit GEMM mixes 27 input pixels, so a per-pixel scale would not factor
out of the sum. The activation scale stays on the device (no host synchronisation).

The layout that makes it one GEMM per tap: ``quantize_padded`` writes the input e4m3 with its
spatial zero padding, ``[B, T, H + 2 PH, W + 2 PW, C]``. Viewed as a matrix of padded pixels x
channels, output pixel ``(t, h, w)`` at padded row ``p = h Wp + w`` of frame ``t`` needs, for tap
``(kt, kh, kw)``, input row ``p + kt Hp Wp + kh Wp + kw``: for every tap, a block of ``BM``
consecutive output rows reads ``BM`` consecutive input rows. So each step of the reduction is a
plain 2-D tile load (a TMA descriptor; rows past the end read zeros) with no masks and no index
arithmetic per pixel. The outputs are computed on the padded width (``Wp - KW + 1`` of every ``Wp``
columns are real; 2 of 50 wasted at the latent grid's 48, 2 of 386 at 384) and stored with a mask.

A producer that can write that layout itself (the K-VAE's spatial norm,
``spatial_norm.norm_modulate_silu_e4m3``, with a scale it bounds without reading the activation)
hands it to ``conv_quantized`` and saves the reduction and the copy.

``fp8_conv`` computes ``F.conv3d`` without bias, stride 1, no temporal padding (the decoder's
causal buffers hold the frames in front), zero padding ``(PH, PW)`` in space, of the dequantized
operands (``reference``). Shape legend: ``B`` batch, ``T`` frames, ``H``/``W`` pixels, ``C`` channels.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import torch
import torch.nn.functional as F

from tilecast.kernels.fp8 import E4M3_MAX, quantize_rows, to_e4m3

ALIGNMENT = 16
"""TMA rows must be multiples of 16 bytes: output channel counts must be multiples of this."""
IN_ALIGNMENT = 32
"""An e4m3 tensor-core product reduces at least 32 values per step (``bk``): input channel counts
must be multiples of this."""
MIN_CUDA_CAPABILITY = (9, 0)
"""TMA descriptors and FP8 tensor cores: Hopper or newer."""


@dataclasses.dataclass(frozen=True)
class Tiling:
    """``bm`` output pixels x ``bn`` output channels per program, ``bk`` input channels per step,
    Triton's warps and pipeline stages."""

    bm: int = 128
    bn: int = 256
    bk: int = 128
    num_warps: int = 8
    num_stages: int = 3

    @classmethod
    def parse(cls, text: str) -> "Tiling":
        """``"128x256k128w8s3"`` (``ValueError`` naming the form)."""
        match = re.fullmatch(r"(\d+)x(\d+)k(\d+)w(\d+)s(\d+)", text.strip())
        if match is None:
            raise ValueError(f"fp8 conv tiling {text!r}: write it as BMxBNkBKwWARPSsSTAGES, e.g. 128x256k128w8s3")
        tiling = cls(*(int(group) for group in match.groups()))
        for name in ("bm", "bn", "bk"):
            value = getattr(tiling, name)
            if value & (value - 1) or value < 16:
                raise ValueError(f"fp8 conv tiling {text!r}: {name} must be a power of two of at least 16, got {value}")
        if tiling.bk < IN_ALIGNMENT:
            raise ValueError(f"fp8 conv tiling {text!r}: e4m3 products need bk of at least {IN_ALIGNMENT}")
        return tiling

    def fit(self, in_channels: int, out_channels: int) -> "Tiling":
        """This tiling with ``bk`` at most ``in_channels`` (it must divide them) and ``bn`` no wider
        than the output channels need."""
        bk = min(self.bk, in_channels & -in_channels)  # the largest power of two dividing C_in
        bn = min(self.bn, max(16, 1 << (out_channels - 1).bit_length()))
        return dataclasses.replace(self, bk=bk, bn=bn)

    def __str__(self) -> str:
        return f"{self.bm}x{self.bn}k{self.bk}w{self.num_warps}s{self.num_stages}"


@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A ``[C_out, C_in, KT, KH, KW]`` convolution weight in e4m3 for ``fp8_conv``."""

    q_NK: torch.Tensor
    """``[C_out, KT KH KW C_in]`` e4m3: output channel, then tap ``(kt, kh, kw)`` and input channel."""
    scale_N: torch.Tensor
    """float32, one per output channel: ``weight ~ q * scale``."""
    in_channels: int
    kernel_size: tuple[int, int, int]

    @property
    def out_channels(self) -> int:
        return self.q_NK.shape[0]


def channels_fit(in_channels: int, out_channels: int) -> bool:
    """Whether ``fp8_conv`` takes these channel counts (multiples of ``IN_ALIGNMENT`` and ``ALIGNMENT``)."""
    return in_channels % IN_ALIGNMENT == 0 and out_channels % ALIGNMENT == 0


def check_channels(in_channels: int, out_channels: int) -> None:
    """Raise ``ValueError`` naming channel counts that ``channels_fit`` refuses."""
    if not channels_fit(in_channels, out_channels):
        raise ValueError(
            f"fp8 conv: input channels must be multiples of {IN_ALIGNMENT} and output channels of "
            f"{ALIGNMENT}, got {in_channels} -> {out_channels}"
        )


def pack_weight(weight: torch.Tensor) -> PackedWeight:
    """``weight`` quantized for ``fp8_conv`` (made once per layer)."""
    out_channels, in_channels, kt, kh, kw = weight.shape
    check_channels(in_channels, out_channels)
    q_NK, scale_N1 = quantize_rows(weight.detach().permute(0, 2, 3, 4, 1).reshape(out_channels, -1))
    return PackedWeight(q_NK.contiguous(), scale_N1.view(-1).contiguous(), in_channels, (kt, kh, kw))


def activation_scale(x: torch.Tensor) -> torch.Tensor:
    """float32 one-element tensor: ``x``'s largest magnitude over 448 (tiny for an all-zero ``x``), on ``x``'s device."""
    low, high = torch.aminmax(x)
    return (torch.maximum(-low, high).float() / E4M3_MAX).clamp(min=1e-12).reshape(1)


def dequantize_weight(weight: PackedWeight) -> torch.Tensor:
    """``[C_out, C_in, KT, KH, KW]`` float32 weight that ``weight`` stands for."""
    kt, kh, kw = weight.kernel_size
    dense = weight.q_NK.float() * weight.scale_N[:, None]
    return dense.view(weight.out_channels, kt, kh, kw, weight.in_channels).permute(0, 4, 1, 2, 3)


def reference(x_BTHWC: torch.Tensor, weight: PackedWeight, padding_hw: tuple[int, int]) -> torch.Tensor:
    """What ``fp8_conv`` computes, in float32: the convolution of the dequantized operands, ``BTHWC``
    (TF32 off: it would round them)."""
    scale = activation_scale(x_BTHWC)
    x_q = to_e4m3(x_BTHWC, scale).float() * scale
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        y_BCTHW = F.conv3d(x_q.permute(0, 4, 1, 2, 3), dequantize_weight(weight), None, 1, (0, *padding_hw))
    return y_BCTHW.permute(0, 2, 3, 4, 1).contiguous()


@functools.cache
def _kernels():
    """The Triton kernels, imported on first use: importing this module needs no Triton."""
    from tilecast.kernels import fp8_conv_triton as kernels

    return kernels.quantize, kernels.conv


def quantize_padded(x_BTHWC: torch.Tensor, padding_hw: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``x`` in e4m3 with its spatial zero padding, ``[B, T, H + 2 PH, W + 2 PW, C]``,
    and its float32 per-tensor scale (``activation_scale``)."""
    import triton

    x_BTHWC = x_BTHWC.contiguous()
    batch, frames, height, width, channels = x_BTHWC.shape
    ph, pw = padding_hw
    q = x_BTHWC.new_empty(batch, frames, height + 2 * ph, width + 2 * pw, channels, dtype=torch.float8_e4m3fn)
    scale = activation_scale(x_BTHWC)
    block = min(4096, triton.next_power_of_2(q.shape[3] * channels))
    grid = (batch * frames * q.shape[2], triton.cdiv(q.shape[3] * channels, block))
    _kernels()[0][grid](
        x_BTHWC, q, scale, height, width, q.shape[2], q.shape[3], ph, pw, C=channels, BLOCK=block, enable_fp_fusion=True
    )
    return q, scale


def fp8_conv(
    x_BTHWC: torch.Tensor,
    weight: PackedWeight,
    padding_hw: tuple[int, int],
    tiling: Tiling | None = None,
) -> torch.Tensor:
    """The convolution of ``x`` (any float dtype, ``BTHWC``) by ``weight`` in e4m3, as ``BTHWC`` in
    ``x``'s dtype: ``reference`` within float32 accumulation and the output's rounding."""
    _check_input(x_BTHWC.shape, weight)  # before quantizing: bad input is named, not half run
    q, x_scale = quantize_padded(x_BTHWC, padding_hw)
    return conv_quantized(q, x_scale, weight, x_BTHWC.dtype, tiling)


def _check_input(shape_BTHWC: tuple[int, ...], weight: PackedWeight) -> None:
    """Raise ``ValueError`` naming an input ``weight`` cannot convolve (channels, or too few frames)."""
    frames, in_channels = shape_BTHWC[1], shape_BTHWC[-1]
    if in_channels != weight.in_channels:
        raise ValueError(f"fp8 conv: the input has {in_channels} channels, the weight takes {weight.in_channels}")
    if frames < weight.kernel_size[0]:
        raise ValueError(f"fp8 conv: {frames} input frames for a kernel {weight.kernel_size[0]} frames deep")


def conv_quantized(
    q_BTHWC: torch.Tensor,
    x_scale: torch.Tensor,
    weight: PackedWeight,
    out_dtype: torch.dtype,
    tiling: Tiling | None = None,
) -> torch.Tensor:
    """``fp8_conv`` of an input its producer already wrote in e4m3 with its spatial zero padding
    (``quantize_padded``'s layout, ``x ~ q * x_scale``; e.g. ``spatial_norm.norm_modulate_silu_e4m3``):
    ``BTHWC`` in ``out_dtype``, over the positions where the kernel fits inside the padded grid."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    batch, frames, padded_height, padded_width, in_channels = q_BTHWC.shape
    kt, kh, kw = weight.kernel_size
    _check_input(q_BTHWC.shape, weight)
    tiling = (tiling or Tiling()).fit(in_channels, weight.out_channels)
    out_frames, out_height, out_width = frames - kt + 1, padded_height - kh + 1, padded_width - kw + 1
    out = q_BTHWC.new_empty(batch, out_frames, out_height, out_width, weight.out_channels, dtype=out_dtype)
    x_desc = TensorDescriptor.from_tensor(q_BTHWC.contiguous().view(-1, in_channels), [tiling.bm, tiling.bk])
    w_desc = TensorDescriptor.from_tensor(weight.q_NK, [tiling.bn, tiling.bk])
    rows_per_frame = out_height * padded_width  # the padded width's columns of every output row
    grid = (-(-rows_per_frame // tiling.bm), -(-weight.out_channels // tiling.bn), batch * out_frames)
    _kernels()[1][grid](
        x_desc,
        w_desc,
        out,
        x_scale,
        weight.scale_N,
        frames,
        out_frames,
        padded_height,
        padded_width,
        out_height,
        out_width,
        weight.out_channels,
        *out.stride()[:3],
        C=in_channels,
        KT=kt,
        KH=kh,
        KW=kw,
        BM=tiling.bm,
        BN=tiling.bn,
        BK=tiling.bk,
        num_warps=tiling.num_warps,
        num_stages=tiling.num_stages,
        enable_fp_fusion=True,
    )
    return out


def check_supported(device: torch.device) -> None:
    """Raise ``ValueError`` naming why ``fp8_conv`` cannot run on ``device`` (a CUDA GPU of compute
    capability ``MIN_CUDA_CAPABILITY`` or newer, with Triton installed)."""
    import importlib.util

    if device.type != "cuda":
        raise ValueError(f"--vae-config.fp8-convs runs on a CUDA GPU (Hopper or newer), not {device.type}")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CUDA_CAPABILITY:
        raise ValueError(
            f"--vae-config.fp8-convs needs TMA and FP8 tensor cores (compute capability >= 9.0); "
            f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}"
        )
    if importlib.util.find_spec("triton") is None:
        raise ValueError("--vae-config.fp8-convs needs Triton, which is not installed")
