"""The K-VAE decoder's spatial norm + SiLU in one pass: ``silu(rms_normalize(h) * scale * gamma * up(y) + up(b))``.

Optionally ``h`` first gets a per-channel bias (``h_bias_C``): the bias of the convolution that made
``h``, which the decoder leaves out of that convolution (PyTorch adds a convolution's bias in a
separate broadcast pass, which on channels-last video was 10% of a tile's decode).

``h`` is a channels-last feature map ``h_BTHWC``; ``y``/``b`` are the two 1x1 convolutions of the
latent ``zq`` at latent resolution, already gathered to ``h``'s frames (``y_BTHWC`` with ``H / rh``
rows and ``W / rw`` columns); ``up`` repeats each of their pixels ``rh`` x ``rw`` times (nearest
upsampling). ``reference`` is the PyTorch composition (every op rounds to ``h``'s dtype, in
diffusers' order); ``triton_fused`` is one Triton kernel that reads ``h`` once and writes the
result once, one program per block of pixels of one image row (``line_tiling``) with the whole
channel row in registers, and rounds to ``h``'s dtype at the same points as ``reference`` but one
(the modulation ``n * y + b`` is a fused multiply-add on the GPU) (why it exists: README, Performance).

``norm_modulate_silu`` picks the kernel: Triton on CUDA when it is importable, else ``reference``.
``norm_modulate_silu_e4m3`` is the same kernel writing e4m3 with zero padding around every frame,
the input of an FP8 convolution (``kernels/fp8_conv.py``), under the scale ``e4m3_scale`` bounds.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from tilecast.kernels.fp8 import E4M3_MAX, to_e4m3


def reference(
    h_BTHWC: torch.Tensor,
    scale: float,
    gamma_C: torch.Tensor,
    y_BTHWC: torch.Tensor,
    b_BTHWC: torch.Tensor,
    rh: int,
    rw: int,
    out: torch.Tensor | None = None,
    h_bias_C: torch.Tensor | None = None,
) -> torch.Tensor:
    """PyTorch ops in diffusers' order (``Kandinsky6VAERMSNorm`` then ``Kandinsky6SRSpatialNorm3D``, then SiLU)."""
    batch, frames, height, width, channels = h_BTHWC.shape
    if h_bias_C is not None:
        h_BTHWC = h_BTHWC + h_bias_C
    normalized = F.normalize(h_BTHWC.float(), dim=-1).to(h_BTHWC.dtype) * scale * gamma_C
    normalized = normalized.view(batch, frames, height // rh, rh, width // rw, rw, channels)
    y = y_BTHWC[:, :, :, None, :, None, :]
    b = b_BTHWC[:, :, :, None, :, None, :]
    result = F.silu(normalized * y + b).view(batch, frames, height, width, channels)
    return result if out is None else out.copy_(result)


ROW_BLOCK_ELEMENTS = 4096
"""Elements one program of a channels-last row kernel handles (whole channel rows)."""


def row_tiling(num_rows: int, channels: int) -> tuple[tuple[int], int, int]:
    """``(grid, BLOCK_C, ROWS)`` of the channels-last row kernels (``channel_bias``): one program
    per ``ROWS`` pixels, each a whole channel row padded to a power of two."""
    import triton

    block_c = triton.next_power_of_2(channels)
    rows = max(1, ROW_BLOCK_ELEMENTS // block_c)
    return (triton.cdiv(num_rows, rows),), block_c, rows


def line_tiling(lines: int, width: int, channels: int) -> tuple[tuple[int, int], int, int]:
    """``(grid, BLOCK_C, COLS)`` of the kernels that work line by line (here, ``upsample``'s
    interleave): program ``(i, j)`` computes pixels ``j COLS .. (j + 1) COLS`` of image row ``i``
    (batch, frame and row together), every channel. So where a pixel comes from is one division
    per program, never per pixel (64-bit divisions per pixel made these kernels instruction-bound).
    ``COLS``: ``ROW_BLOCK_ELEMENTS`` values per program, halved while a row's last program would
    leave more than 1/16 of the row's lanes idle (a padded width, such as 770)."""
    import triton

    block_c = triton.next_power_of_2(channels)
    cols = max(1, ROW_BLOCK_ELEMENTS // block_c)
    while cols > 1 and triton.cdiv(width, cols) * cols * 16 > width * 17:
        cols //= 2
    return (lines, triton.cdiv(width, cols)), block_c, cols


def num_warps(block_c: int) -> int:
    """Warps of a spatial-norm program whose channel rows are ``block_c`` wide."""
    return 8 if block_c >= 1024 else 4


@functools.cache
def _triton_kernel():
    """The Triton kernel, imported on first use: importing this module needs no Triton."""
    from tilecast.kernels.spatial_norm_triton import spatial_norm_silu_kernel

    return spatial_norm_silu_kernel


def _launch(h_BTHWC, scale, gamma_C, y_BTHWC, b_BTHWC, rh, rw, out, h_bias_C, out_scale=None, padding_hw=(0, 0)):
    """The kernel over ``out``'s pixels (``h``'s, or with ``out_scale`` its padded e4m3 grid), written
    straight into ``out`` when it is contiguous, else through a contiguous copy."""
    if not out.is_contiguous():
        work = torch.empty_like(out, memory_format=torch.contiguous_format)
        return out.copy_(
            _launch(h_BTHWC, scale, gamma_C, y_BTHWC, b_BTHWC, rh, rw, work, h_bias_C, out_scale, padding_hw)
        )
    from .e4m3_triton import interpreted

    h_BTHWC, y_BTHWC, b_BTHWC = h_BTHWC.contiguous(), y_BTHWC.contiguous(), b_BTHWC.contiguous()
    _, _, height, width, channels = h_BTHWC.shape
    out_height, out_width = out.shape[2], out.shape[3]
    grid, block_c, cols = line_tiling(out.numel() // (out_width * channels), out_width, channels)
    _triton_kernel()[grid](
        h_BTHWC,
        gamma_C if h_bias_C is None else h_bias_C.contiguous(),
        gamma_C.contiguous(),
        y_BTHWC,
        b_BTHWC,
        out,
        gamma_C if out_scale is None else out_scale,
        float(scale),
        channels,
        height,
        width,
        height // rh,
        width // rw,
        rh,
        out_height,
        out_width,
        *padding_hw,
        RW=rw,
        HAS_BIAS=h_bias_C is not None,
        E4M3=out_scale is not None,
        INTERPRETED=interpreted(),
        BLOCK_C=block_c,
        COLS=cols,
        num_warps=num_warps(block_c),
        enable_fp_fusion=True,
    )
    return out


def triton_fused(
    h_BTHWC: torch.Tensor,
    scale: float,
    gamma_C: torch.Tensor,
    y_BTHWC: torch.Tensor,
    b_BTHWC: torch.Tensor,
    rh: int,
    rw: int,
    out: torch.Tensor | None = None,
    h_bias_C: torch.Tensor | None = None,
) -> torch.Tensor:
    """``reference`` in one Triton kernel (CUDA tensors), into ``out`` when given."""
    out = torch.empty_like(h_BTHWC, memory_format=torch.contiguous_format) if out is None else out
    return _launch(h_BTHWC, scale, gamma_C, y_BTHWC, b_BTHWC, rh, rw, out, h_bias_C)


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def norm_modulate_silu(
    h_BTHWC: torch.Tensor,
    scale: float,
    gamma_C: torch.Tensor,
    y_BTHWC: torch.Tensor,
    b_BTHWC: torch.Tensor,
    rh: int,
    rw: int,
    out: torch.Tensor | None = None,
    h_bias_C: torch.Tensor | None = None,
) -> torch.Tensor:
    """``triton_fused`` for CUDA tensors when Triton is importable, else ``reference``; the result goes
    to ``out`` (``h``'s shape and dtype) when given, and is returned. ``h_bias_C`` (the bias of the
    convolution that made ``h``, left out there) is added to ``h`` first, rounded as a separate add."""
    kernel = triton_fused if h_BTHWC.is_cuda and triton_available() else reference
    return kernel(h_BTHWC, scale, gamma_C, y_BTHWC, b_BTHWC, rh, rw, out=out, h_bias_C=h_bias_C)


SILU_MIN = 0.27846454276107380
"""``-min silu``: SiLU's output is never below ``-SILU_MIN`` (at ``x = -1.27846``)."""


def e4m3_scale(scale: float, gamma_C: torch.Tensor, y_BTHWC: torch.Tensor, b_BTHWC: torch.Tensor) -> torch.Tensor:
    """A float32 one-element scale (on the device) under which ``norm_modulate_silu`` of *any* ``h`` fits
    e4m3 for these (or fewer) ``y``/``b`` pixels: a bound of its magnitude over 448, with no pass over ``h``.

    ``F.normalize`` leaves every channel of a pixel at most 1 in magnitude, so channel ``c`` of the
    modulation is at most ``|scale gamma_c| max|y_c| + max|b_c|``, and SiLU maps that range into
    ``[-SILU_MIN, max(bound, 0)]``. The bound is the worst pixel's, larger than a real maximum
    (1/sqrt(C) of it is typical), which e4m3 hardly feels: its relative step is the same over its
    whole normal range, 2^-6 .. 448, so only values that many times smaller than the bound get coarser.
    1% of slack covers the roundings to ``h``'s dtype on the way."""
    dims = tuple(range(y_BTHWC.dim() - 1))
    y_max, b_max = y_BTHWC.abs().amax(dim=dims).float(), b_BTHWC.abs().amax(dim=dims).float()
    bound = ((abs(scale) * gamma_C.abs().float() * y_max + b_max).max() * 1.01).clamp(min=SILU_MIN)
    return (bound / E4M3_MAX).reshape(1)


def norm_modulate_silu_e4m3(
    h_BTHWC: torch.Tensor,
    scale: float,
    gamma_C: torch.Tensor,
    y_BTHWC: torch.Tensor,
    b_BTHWC: torch.Tensor,
    rh: int,
    rw: int,
    *,
    out: torch.Tensor,
    out_scale: torch.Tensor,
    padding_hw: tuple[int, int],
    h_bias_C: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fp8.to_e4m3(norm_modulate_silu(...), out_scale)`` with ``padding_hw`` rows and columns of zeros
    around every frame, written into ``out`` (``[B, T, H + 2 PH, W + 2 PW, C]`` e4m3): the input of
    ``fp8_conv.conv_quantized`` straight from the norm, in one pass over ``h`` on CUDA (Triton),
    instead of a bf16 result that the convolution reduces for its scale and copies into e4m3.
    ``out_scale``: ``e4m3_scale``'s, so nothing saturates."""
    batch, frames, height, width, channels = h_BTHWC.shape
    ph, pw = padding_hw
    if out.dtype != torch.float8_e4m3fn or out.shape != (batch, frames, height + 2 * ph, width + 2 * pw, channels):
        raise ValueError(
            f"norm_modulate_silu_e4m3: out is {out.dtype} {tuple(out.shape)}, expected float8_e4m3fn "
            f"{(batch, frames, height + 2 * ph, width + 2 * pw, channels)}"
        )
    if not (h_BTHWC.is_cuda and triton_available()):
        return e4m3_reference(h_BTHWC, scale, gamma_C, y_BTHWC, b_BTHWC, rh, rw, out, out_scale, padding_hw, h_bias_C)
    return triton_e4m3(h_BTHWC, scale, gamma_C, y_BTHWC, b_BTHWC, rh, rw, out, out_scale, padding_hw, h_bias_C)


def e4m3_reference(h_BTHWC, scale, gamma_C, y_BTHWC, b_BTHWC, rh, rw, out, out_scale, padding_hw, h_bias_C=None):
    """``norm_modulate_silu_e4m3`` from ``reference`` and ``fp8.to_e4m3`` (PyTorch)."""
    result = reference(h_BTHWC, scale, gamma_C, y_BTHWC, b_BTHWC, rh, rw, h_bias_C=h_bias_C)
    ph, pw = padding_hw
    out.zero_()
    out[:, :, ph : out.shape[2] - ph, pw : out.shape[3] - pw] = to_e4m3(result, out_scale)
    return out


def triton_e4m3(h_BTHWC, scale, gamma_C, y_BTHWC, b_BTHWC, rh, rw, out, out_scale, padding_hw, h_bias_C=None):
    """``norm_modulate_silu_e4m3`` in one Triton kernel (``triton_fused``'s, writing e4m3 over the padded grid)."""
    return _launch(h_BTHWC, scale, gamma_C, y_BTHWC, b_BTHWC, rh, rw, out, h_bias_C, out_scale, padding_hw)
