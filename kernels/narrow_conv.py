"""A 3-D convolution with few output channels on channels-last video, as an implicit GEMM in Triton.

The K-VAE decoder's full-resolution level convolves 256 -> 16, 16 -> 16 and 16 -> 3 channels with
3x3x3 kernels. cuDNN has no fast kernel for so few output channels: on an H100 these ran at 110,
46-53 and 9 TFLOP/s, where its 256-2048 channel convolutions run at 750-836, so the level costs
about 0.15 s of a large tile's 1.42 s decode for 1% of its FLOPs (README, Performance).

``triton_conv`` computes ``F.conv3d`` without bias, stride 1, no temporal padding (the decoder's
causal buffers already hold the frames in front) and zero padding ``(ph, pw)`` in space, on a
``BTHWC`` input whose channel rows are contiguous. One program computes a patch of ``BH`` x ``BW``
output pixels of one frame, all output channels (padded to 16, tensor cores' smallest width),
as a GEMM over the kernel's taps: for each time tap ``kt`` and row tap ``kh`` the ``KW`` column taps
of a pixel read ``KW * C_in`` consecutive input values (``w - pw`` .. ``w - pw + KW - 1``, whole
channel rows), so the reduction runs along that contiguous run in blocks of ``BK``; pixels outside
the frame read zeros. When ``BK`` divides ``C_in`` (the decoder's 16 and 256) each block lies in one
column tap and needs one mask per pixel, and all ``27 C_in / BK`` steps run as one flat loop that
Triton can pipeline; otherwise the mask is computed per value. The weights are packed once
(``pack_weight``) to match: ``[KT, KH, KP, NP]``, ``KP`` the run padded to ``BK`` and ``NP`` the
output channels padded, with zeros. Accumulation is float32, the output in the input's dtype.

Every input value is read 27 times (once per tap), from L2 after the first: with 16 output
channels that is 16 multiply-adds per value read (likely what holds cuDNN to 110 TFLOP/s at
256 -> 16; not measured). The reuse kernel (``Tiling(reuse=True)``, one row of pixels per program)
reads each block of input once for the three column taps of a 3x3 kernel: three products into
three accumulators, which are shifted by one and two pixels (``tl.gather``) and summed once at the
end; 9 reads per value instead of 27. Both are one Triton kernel (``REUSE`` picks the loop at
compile time); the pointer set-up and the store are shared.

``reference`` is ``F.conv3d`` on the same channels-last view (what the decoder runs today).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import torch
import torch.nn.functional as F

MIN_WIDTH = 16
"""Tensor cores' smallest GEMM width: output channels are padded to it."""


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Output patch ``bh`` x ``bw`` pixels per program, ``bk`` reduction values per step, Triton's
    warps and pipeline stages."""

    bh: int = 2
    bw: int = 64
    bk: int = 64
    num_warps: int = 4
    num_stages: int = 3
    reuse: bool = False
    """Load each input block once for the three column taps (``bh`` 1; ``bw`` input pixels give
    ``bw - 2`` outputs): a third of the input reads, three products per load."""

    @classmethod
    def parse(cls, text: str) -> "Tiling":
        """``"2x64k64w4s3"``: ``bh`` x ``bw``, ``k`` reduction block, warps, stages, and ``r`` at the end
        for ``reuse`` (``ValueError`` naming the form)."""
        match = re.fullmatch(r"(\d+)x(\d+)k(\d+)w(\d+)s(\d+)(r?)", text.strip())
        if match is None:
            raise ValueError(
                f"narrow conv tiling {text!r}: write it as BHxBWkBKwWARPSsSTAGES[r], e.g. 2x64k64w4s3 or 1x128k64w4s3r"
            )
        tiling = cls(*(int(group) for group in match.groups()[:5]), reuse=bool(match.group(6)))
        for name in ("bh", "bw", "bk"):
            value = getattr(tiling, name)
            if value & (value - 1):
                raise ValueError(f"narrow conv tiling {text!r}: {name} must be a power of two, got {value}")
        if tiling.bh * tiling.bw < 16 or tiling.bk < 16:
            raise ValueError(f"narrow conv tiling {text!r}: a patch needs at least 16 pixels and BK at least 16")
        if tiling.reuse and tiling.bh != 1:
            raise ValueError(f"narrow conv tiling {text!r}: reuse ('r') takes one row per program (BH 1)")
        return tiling

    def __str__(self) -> str:
        return f"{self.bh}x{self.bw}k{self.bk}w{self.num_warps}s{self.num_stages}{'r' if self.reuse else ''}"


def default_tiling(in_channels: int) -> Tiling:
    """The tiling ``triton_conv`` uses unless told: a reduction block that wastes nothing on a run
    of ``3 * in_channels`` values when the channels are few."""
    return Tiling(bk=16 if in_channels < 64 else 64)


def reuse_tiling(in_channels: int) -> Tiling:
    """The reuse kernel's counterpart of ``default_tiling``: rows of 128 input pixels (126 outputs)."""
    return dataclasses.replace(default_tiling(in_channels), bh=1, bw=128, reuse=True)


def fastest_tiling(in_channels: int) -> Tiling:
    """The tiling measured fastest for a 3x3x3 convolution padded by 1 in height and width
    (``tilecast bench narrow-conv`` on an H100, one K-VAE segment of 512 x 768 pixels): the reuse
    kernel where its 64-channel reduction block divides the input channels (256 -> 16: 5.5 ms, the
    plain kernel 12.2, cuDNN 12.4), the plain one otherwise (16 -> 16: 0.75 ms, reuse 0.76, cuDNN 1.61)."""
    return reuse_tiling(in_channels) if in_channels % 64 == 0 else default_tiling(in_channels)


@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A ``[C_out, C_in, KT, KH, KW]`` convolution weight laid out for ``triton_conv``."""

    packed: torch.Tensor
    """``[KT, KH, KP, NP]``: tap ``(kt, kh)``, reduction index ``kw * C_in + c``, output channel; zero padded."""
    out_channels: int
    in_channels: int
    kernel_size: tuple[int, int, int]
    bk: int


def pack_weight(weight: torch.Tensor, bk: int) -> PackedWeight:
    """``weight`` packed for ``triton_conv`` with reduction block ``bk`` (made once per layer)."""
    out_channels, in_channels, kt, kh, kw = weight.shape
    run = kw * in_channels
    kp = -(-run // bk) * bk
    np_ = max(MIN_WIDTH, 1 << (out_channels - 1).bit_length())
    packed = weight.new_zeros(kt, kh, kp, np_)
    packed[:, :, :run, :out_channels] = weight.permute(2, 3, 4, 1, 0).reshape(kt, kh, run, out_channels)
    return PackedWeight(packed.contiguous(), out_channels, in_channels, (kt, kh, kw), bk)


def reference(x_BTHWC: torch.Tensor, weight: torch.Tensor, padding_hw: tuple[int, int]) -> torch.Tensor:
    """``F.conv3d`` (no bias, no temporal padding) on the channels-last view, as ``BTHWC``."""
    y_BCTHW = F.conv3d(x_BTHWC.permute(0, 4, 1, 2, 3), weight, None, 1, (0, *padding_hw))
    return y_BCTHW.permute(0, 2, 3, 4, 1).contiguous()


def exact(
    x_BTHWC: torch.Tensor, weight: torch.Tensor, padding_hw: tuple[int, int], frames_per_call: int = 4
) -> torch.Tensor:
    """The float32 convolution others are measured against, as ``BTHWC``: TF32 off, the input made
    ``NCDHW``, ``frames_per_call`` output frames per convolution (bounded workspace). Without cuDNN
    (``cudnn.flags()`` disables it unless told ``enabled=True``) PyTorch convolves by an im2col
    copy 27 times the input's size: 162 GiB for a decoder segment at 256 channels."""
    weight = weight.float().contiguous()
    kt = weight.shape[2]
    parts = []
    for start in range(0, x_BTHWC.shape[1] - kt + 1, frames_per_call):
        x_BCTHW = x_BTHWC[:, start : start + frames_per_call + kt - 1].float().permute(0, 4, 1, 2, 3).contiguous()
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
            parts.append(F.conv3d(x_BCTHW, weight, None, 1, (0, *padding_hw)))
    return torch.cat(parts, dim=2).permute(0, 2, 3, 4, 1).contiguous()


@functools.cache
def _triton_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def narrow_conv_kernel(
        x_ptr,
        w_ptr,
        y_ptr,
        height,
        width,
        out_channels,
        stride_xb,
        stride_xt,
        stride_xh,
        stride_yb,
        stride_yt,
        stride_yh,
        CIN: tl.constexpr,
        KT: tl.constexpr,
        KH: tl.constexpr,
        KW: tl.constexpr,
        KP: tl.constexpr,
        NP: tl.constexpr,
        PH: tl.constexpr,
        PW: tl.constexpr,
        BH: tl.constexpr,
        BW: tl.constexpr,
        BK: tl.constexpr,
        PRECISION: tl.constexpr,
        REUSE: tl.constexpr,
    ):
        t = tl.program_id(1).to(tl.int64)
        b = tl.program_id(2).to(tl.int64)
        frame = x_ptr + b * stride_xb + t * stride_xt  # time tap 0
        n = tl.arange(0, NP)
        c = tl.arange(0, BK)
        if REUSE:
            # A 3-wide kernel padded by one column; one row of BW input pixels (columns w0 - 1 ..) per
            # program gives BW - 2 outputs. Input pixel i feeds output i through column tap 0, output
            # i - 1 through tap 1 and i - 2 through tap 2: three accumulators, shifted once at the end.
            tiles_w = tl.cdiv(width, BW - 2)
            i = tl.arange(0, BW)
            h = tl.program_id(0) // tiles_w + tl.zeros([BW], dtype=tl.int32)  # one per pixel, for the masks
            w0 = (tl.program_id(0) % tiles_w) * (BW - 2)
            column = w0 - 1 + i
            column_ok = (column >= 0) & (column < width)
            acc0 = tl.zeros([BW, NP], dtype=tl.float32)
            acc1 = tl.zeros([BW, NP], dtype=tl.float32)
            acc2 = tl.zeros([BW, NP], dtype=tl.float32)
            for step in range(KT * KH * (CIN // BK)):
                c0 = (step % (CIN // BK)) * BK
                row_tap = step // (CIN // BK)  # kt * KH + kh
                row = h + (row_tap % KH - 1)
                ok = column_ok & (row >= 0) & (row < height)
                pixel = frame + (row_tap // KH) * stride_xt + row.to(tl.int64) * stride_xh + column.to(tl.int64) * CIN
                a = tl.load(pixel[:, None] + (c0 + c)[None, :], mask=ok[:, None], other=0.0)
                taps = w_ptr + (row_tap * 3 * CIN + c0 + c)[:, None] * NP + n[None, :]  # packed [KT, KH, 3 CIN, NP]
                acc0 = tl.dot(a, tl.load(taps), acc0, input_precision=PRECISION)
                acc1 = tl.dot(a, tl.load(taps + CIN * NP), acc1, input_precision=PRECISION)
                acc2 = tl.dot(a, tl.load(taps + 2 * CIN * NP), acc2, input_precision=PRECISION)
            rows = i[:, None] + tl.zeros([BW, NP], dtype=tl.int32)
            acc = acc0 + tl.gather(acc1, tl.minimum(rows + 1, BW - 1), 0)
            acc += tl.gather(acc2, tl.minimum(rows + 2, BW - 1), 0)
            w = w0 + i
            valid = i < BW - 2
        else:
            tiles_w = tl.cdiv(width, BW)
            pixels = tl.arange(0, BH * BW)
            h = (tl.program_id(0) // tiles_w) * BH + pixels // BW
            w = (tl.program_id(0) % tiles_w) * BW + pixels % BW
            valid = h < height
            acc = tl.zeros([BH * BW, NP], dtype=tl.float32)
            if CIN % BK == 0:
                # Every block lies in one column tap: one mask per pixel. One flat loop over (tap, block),
                # so Triton pipelines the loads of the next steps under the current product.
                for step in range(KT * KH * KW * (CIN // BK)):
                    c0 = (step % (CIN // BK)) * BK
                    tap = step // (CIN // BK)  # (kt * KH + kh) * KW + kw
                    row = h + ((tap // KW) % KH - PH)
                    column = w + (tap % KW - PW)
                    ok = (row >= 0) & (row < height) & (column >= 0) & (column < width)
                    pixel = frame + (tap // (KW * KH)) * stride_xt + row.to(tl.int64) * stride_xh
                    pixel += column.to(tl.int64) * CIN
                    a = tl.load(pixel[:, None] + (c0 + c)[None, :], mask=ok[:, None], other=0.0)
                    taps = tl.load(w_ptr + (tap * CIN + c0 + c)[:, None] * NP + n[None, :])  # KP == KW * CIN here
                    acc = tl.dot(a, taps, acc, input_precision=PRECISION)
            else:  # blocks straddle column taps (few or odd channels): a mask per value
                for kt in range(KT):
                    for kh in range(KH):
                        row = h + (kh - PH)
                        row_ok = (row >= 0) & (row < height)
                        start = frame + kt * stride_xt + row.to(tl.int64) * stride_xh + (w - PW).to(tl.int64) * CIN
                        for k0 in range(0, KP, BK):
                            k = k0 + c
                            column = (w - PW)[:, None] + (k // CIN)[None, :]
                            ok = row_ok[:, None] & (k < KW * CIN)[None, :] & (column >= 0) & (column < width)
                            a = tl.load(start[:, None] + k[None, :], mask=ok, other=0.0)
                            taps = tl.load(w_ptr + ((kt * KH + kh) * KP + k)[:, None] * NP + n[None, :])
                            acc = tl.dot(a, taps, acc, input_precision=PRECISION)
        out = y_ptr + b * stride_yb + t * stride_yt + h.to(tl.int64)[:, None] * stride_yh
        out += w.to(tl.int64)[:, None] * out_channels + n[None, :]
        mask = (valid & (w < width))[:, None] & (n < out_channels)[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)

    return narrow_conv_kernel


def triton_conv(
    x_BTHWC: torch.Tensor,
    weight: PackedWeight,
    padding_hw: tuple[int, int],
    tiling: Tiling | None = None,
) -> torch.Tensor:
    """``reference(x, weight, padding_hw)`` in one Triton kernel (``tiling`` default: ``default_tiling``,
    whose ``bk`` the weight was packed with)."""
    batch, frames, height, width, in_channels = x_BTHWC.shape
    kt, kh, kw = weight.kernel_size
    tiling = tiling or default_tiling(in_channels)
    if in_channels != weight.in_channels:
        raise ValueError(f"narrow conv: the input has {in_channels} channels, the weight takes {weight.in_channels}")
    if tiling.bk != weight.bk:
        raise ValueError(f"narrow conv: the weight was packed for BK {weight.bk}, the tiling has {tiling.bk}")
    if x_BTHWC.stride(4) != 1 or x_BTHWC.stride(3) != in_channels:
        raise ValueError("narrow conv: the input's channel rows must be contiguous (channels-last)")
    ph, pw = padding_hw
    out_frames, out_height, out_width = frames - kt + 1, height + 2 * ph - kh + 1, width + 2 * pw - kw + 1
    if (out_height, out_width) != (height, width):
        raise ValueError(f"narrow conv: only 'same' spatial padding is supported, got {padding_hw} for {kh}x{kw}")
    if tiling.reuse and ((kh, kw, ph, pw) != (3, 3, 1, 1) or in_channels % tiling.bk):
        raise ValueError(
            f"narrow conv: reuse ('r') takes a 3x3 kernel padded by 1 and BK dividing the {in_channels} channels"
        )
    import triton

    out = x_BTHWC.new_empty(batch, out_frames, height, width, weight.out_channels)
    if tiling.reuse:  # rows of bw input pixels, bw - 2 outputs each
        grid = (height * triton.cdiv(width, tiling.bw - 2), out_frames, batch)
    else:
        grid = (triton.cdiv(height, tiling.bh) * triton.cdiv(width, tiling.bw), out_frames, batch)
    _triton_kernel()[grid](
        x_BTHWC,
        weight.packed,
        out,
        height,
        width,
        weight.out_channels,
        *x_BTHWC.stride()[:3],
        *out.stride()[:3],
        CIN=in_channels,
        KT=kt,
        KH=kh,
        KW=kw,
        KP=weight.packed.shape[2],
        NP=weight.packed.shape[3],
        PH=ph,
        PW=pw,
        BH=tiling.bh,
        BW=tiling.bw,
        BK=tiling.bk,
        PRECISION="ieee" if x_BTHWC.dtype == torch.float32 else "tf32",
        REUSE=tiling.reuse,
        num_warps=tiling.num_warps,
        num_stages=tiling.num_stages,
        enable_fp_fusion=True,
    )
    return out
