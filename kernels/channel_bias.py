"""A convolution's bias, and optionally a residual, added to a channels-last video in place: ``y += bias (+ residual)``.

PyTorch adds a convolution's bias after cuDNN, in a broadcast pass that runs its generic strided
kernel on channels-last tensors (a share of a K-VAE tile's decode: README, Performance). The
decoder convolves without bias and adds it here: in the same pass as the residual that follows
most of its convolutions, otherwise in a pass of its own that reads whole channel rows.
Rounding matches PyTorch's two adds (``y + bias`` is rounded to ``y``'s dtype before the residual).

``add_bias_`` picks the kernel: Triton on CUDA when it is importable, else ``reference_``.

Shapes: ``y_BTHWC`` (batch, frames, height, width, channels), channels-last; ``bias_C`` (channels).
"""

from __future__ import annotations

import functools

import torch

from tilecast.kernels.spatial_norm import row_tiling, triton_available


def reference_(
    y_BTHWC: torch.Tensor, bias_C: torch.Tensor | None, residual_BTHWC: torch.Tensor | None = None
) -> torch.Tensor:
    """The two adds in PyTorch."""
    if bias_C is not None:
        y_BTHWC.add_(bias_C)
    if residual_BTHWC is not None:
        y_BTHWC.add_(residual_BTHWC)
    return y_BTHWC


@functools.cache
def _triton_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def add_bias_kernel(
        y_ptr,
        bias_ptr,
        residual_ptr,
        num_rows,
        channels,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK_C: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        dtype = y_ptr.dtype.element_ty
        # ROWS channel rows from a 64-bit base, 32-bit offsets within the block.
        rows = tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_C)
        col_ok = cols < channels
        mask = (tl.program_id(0) * ROWS + rows < num_rows)[:, None] & col_ok[None, :]
        base = tl.program_id(0).to(tl.int64) * ROWS * channels
        y_ptr, residual_ptr = y_ptr + base, residual_ptr + base
        offsets = rows[:, None] * channels + cols[None, :]
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        y = (tl.load(y_ptr + offsets, mask=mask, other=0.0).to(tl.float32) + bias[None, :]).to(dtype)
        if HAS_RESIDUAL:
            y = (y.to(tl.float32) + tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)).to(dtype)
        tl.store(y_ptr + offsets, y, mask=mask)

    return add_bias_kernel


def triton_(
    y_BTHWC: torch.Tensor, bias_C: torch.Tensor | None, residual_BTHWC: torch.Tensor | None = None
) -> torch.Tensor:
    """``reference_`` in one Triton kernel (contiguous CUDA tensors; anything else goes to ``reference_``)."""
    if (
        bias_C is None
        or not y_BTHWC.is_contiguous()
        or (
            residual_BTHWC is not None and (not residual_BTHWC.is_contiguous() or residual_BTHWC.shape != y_BTHWC.shape)
        )
    ):
        return reference_(y_BTHWC, bias_C, residual_BTHWC)
    kernel = _triton_kernel()
    channels = y_BTHWC.shape[-1]
    num_rows = y_BTHWC.numel() // channels
    grid, block_c, rows = row_tiling(num_rows, channels)
    kernel[grid](
        y_BTHWC,
        bias_C.contiguous(),
        y_BTHWC if residual_BTHWC is None else residual_BTHWC,
        num_rows,
        channels,
        HAS_RESIDUAL=residual_BTHWC is not None,
        BLOCK_C=block_c,
        ROWS=rows,
        num_warps=4,
        enable_fp_fusion=True,
    )
    return y_BTHWC


def add_bias_(
    y_BTHWC: torch.Tensor, bias_C: torch.Tensor | None, residual_BTHWC: torch.Tensor | None = None
) -> torch.Tensor:
    """``y += bias (+ residual)`` in place and return ``y``: ``triton_`` on CUDA when Triton is importable."""
    kernel = triton_ if y_BTHWC.is_cuda and triton_available() else reference_
    return kernel(y_BTHWC, bias_C, residual_BTHWC)
