"""The K-VAE decoder's spatial norm + SiLU in one pass: ``silu(rms_normalize(h) * scale * gamma * up(y) + up(b))``.

Optionally ``h`` first gets a per-channel bias (``h_bias_C``): the bias of the convolution that made
``h``, which the decoder leaves out of that convolution (PyTorch adds a convolution's bias in a
separate broadcast pass, which on channels-last video was 10% of a tile's decode).

``h`` is a channels-last feature map ``h_BTHWC``; ``y``/``b`` are the two 1x1 convolutions of the
latent ``zq`` at latent resolution, already gathered to ``h``'s frames (``y_BTHWC`` with ``H / rh``
rows and ``W / rw`` columns); ``up`` repeats each of their pixels ``rh`` x ``rw`` times (nearest
upsampling). ``reference`` is the PyTorch composition (every op rounds to ``h``'s dtype, in
diffusers' order); ``triton_fused`` is one Triton kernel that reads ``h`` once and writes the
result once, one program per block of pixels with the whole channel row in registers, and rounds
to ``h``'s dtype at the same points as ``reference`` (why it exists: README, Performance).

``norm_modulate_silu`` picks the kernel: Triton on CUDA when it is importable, else ``reference``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


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
    """``(grid, BLOCK_C, ROWS)`` of the channels-last row kernels (here, ``upsample``,
    ``channel_bias``): one program per ``ROWS`` pixels, each a whole channel row padded to a power of two."""
    import triton

    block_c = triton.next_power_of_2(channels)
    rows = max(1, ROW_BLOCK_ELEMENTS // block_c)
    return (triton.cdiv(num_rows, rows),), block_c, rows


@functools.cache
def _triton_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def spatial_norm_silu_kernel(
        h_ptr,
        h_bias_ptr,
        gamma_ptr,
        y_ptr,
        b_ptr,
        out_ptr,
        scale,
        num_rows,
        channels,
        height,
        width,
        latent_height,
        latent_width,
        rh,
        rw,
        HAS_BIAS: tl.constexpr,
        BLOCK_C: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        dtype = h_ptr.dtype.element_ty
        rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        cols = tl.arange(0, BLOCK_C)
        col_ok = cols < channels
        mask = (rows < num_rows)[:, None] & col_ok[None, :]
        offsets = rows[:, None] * channels + cols[None, :]

        x = tl.load(h_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:  # the previous convolution's bias, added here instead of in a pass of its own
            x = (x + tl.load(h_bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]).to(dtype)
            x = x.to(tl.float32)
        denom = tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), 1e-12)  # F.normalize's eps
        n = (x / denom[:, None]).to(dtype).to(tl.float32)
        n = (n * scale).to(dtype).to(tl.float32)
        gamma = tl.load(gamma_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        n = (n * gamma[None, :]).to(dtype).to(tl.float32)

        # Pixel (frame, row, col) of every h row, and the y/b pixel it repeats.
        col = rows % width
        rest = rows // width
        row = rest % height
        frame = rest // height
        small = (frame * latent_height + row // rh) * latent_width + col // rw
        small_offsets = small[:, None] * channels + cols[None, :]
        y = tl.load(y_ptr + small_offsets, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + small_offsets, mask=mask, other=0.0).to(tl.float32)
        m = (n * y).to(dtype).to(tl.float32)
        m = (m + b).to(dtype).to(tl.float32)
        tl.store(out_ptr + offsets, (m / (1.0 + tl.exp(-m))).to(dtype), mask=mask)

    return spatial_norm_silu_kernel


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
    """``reference`` in one Triton kernel (CUDA tensors), written straight into ``out`` when it is contiguous."""
    if out is not None and not out.is_contiguous():
        return out.copy_(triton_fused(h_BTHWC, scale, gamma_C, y_BTHWC, b_BTHWC, rh, rw, h_bias_C=h_bias_C))
    kernel = _triton_kernel()
    h_BTHWC, y_BTHWC, b_BTHWC = h_BTHWC.contiguous(), y_BTHWC.contiguous(), b_BTHWC.contiguous()
    batch, frames, height, width, channels = h_BTHWC.shape
    out = torch.empty_like(h_BTHWC) if out is None else out
    num_rows = h_BTHWC.numel() // channels
    grid, block_c, rows = row_tiling(num_rows, channels)
    kernel[grid](
        h_BTHWC,
        gamma_C if h_bias_C is None else h_bias_C.contiguous(),
        gamma_C.contiguous(),
        y_BTHWC,
        b_BTHWC,
        out,
        float(scale),
        num_rows,
        channels,
        height,
        width,
        height // rh,
        width // rw,
        rh,
        rw,
        HAS_BIAS=h_bias_C is not None,
        BLOCK_C=block_c,
        ROWS=rows,
        num_warps=8 if block_c >= 1024 else 4,
    )
    return out


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
