"""Nearest upsampling of a channels-last video by whole factors: ``out[b, t, h, w] = x[b, (t + drop) // rt, h // rh, w // rw]``.

The K-VAE decoder doubles frames (dropping the first copy in the first segment) and doubles rows
and columns. Done in PyTorch as a copy from a broadcast view, that copy runs PyTorch's generic
strided kernel (one element per thread), a large share of a tile's decode (README, Performance).
``triton_repeat`` copies whole channel rows instead, one program per block of output pixels,
and can write into a slice of a larger buffer (``out``), such as a causal convolution's input.

``repeat_nearest`` picks the kernel: Triton on CUDA when it is importable, else ``reference``.
Both are exact copies: their outputs are equal, bit for bit.

Shapes: ``x_BTHWC`` (batch, frames, height, width, channels), channels-last.
"""

from __future__ import annotations

import functools

import torch

from tilecast.kernels.spatial_norm import row_tiling, triton_available


def output_shape(x_BTHWC: torch.Tensor, rt: int, rh: int, rw: int, drop: int) -> tuple[int, ...]:
    batch, frames, height, width, channels = x_BTHWC.shape
    if not 0 <= drop < rt or min(rt, rh, rw) < 1:
        raise ValueError(f"repeat factors must be >= 1 and 0 <= drop < rt, got rt={rt} rh={rh} rw={rw} drop={drop}")
    return batch, frames * rt - drop, height * rh, width * rw, channels


def reference(
    x_BTHWC: torch.Tensor, rt: int, rh: int, rw: int, drop: int = 0, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The copy from a broadcast view, in PyTorch."""
    batch, frames, height, width, channels = x_BTHWC.shape
    shape = output_shape(x_BTHWC, rt, rh, rw, drop)
    view = x_BTHWC[:, :, None, :, None, :, None, :].expand(batch, frames, rt, height, rh, width, rw, channels)
    view = view.reshape(batch, frames * rt, height * rh, width * rw, channels)[:, drop:]
    if out is None:
        return view.contiguous()
    if tuple(out.shape) != shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {shape}")
    return out.copy_(view)


@functools.cache
def _triton_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(
        x_ptr,
        out_ptr,
        num_rows,
        channels,
        frames,
        height,
        width,
        out_frames,
        out_height,
        out_width,
        rt,
        rh,
        rw,
        drop,
        BLOCK_C: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        cols = tl.arange(0, BLOCK_C)
        mask = (rows < num_rows)[:, None] & (cols < channels)[None, :]
        col = rows % out_width
        rest = rows // out_width
        row = rest % out_height
        rest = rest // out_height
        frame = rest % out_frames
        batch = rest // out_frames
        source = ((batch * frames + (frame + drop) // rt) * height + row // rh) * width + col // rw
        values = tl.load(x_ptr + source[:, None] * channels + cols[None, :], mask=mask)
        tl.store(out_ptr + rows[:, None] * channels + cols[None, :], values, mask=mask)

    return kernel


def triton_repeat(
    x_BTHWC: torch.Tensor, rt: int, rh: int, rw: int, drop: int = 0, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``reference`` in one Triton kernel (CUDA tensors); straight into ``out`` when it is contiguous."""
    shape = output_shape(x_BTHWC, rt, rh, rw, drop)
    if out is not None and tuple(out.shape) != shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {shape}")
    if out is not None and not out.is_contiguous():
        return out.copy_(triton_repeat(x_BTHWC, rt, rh, rw, drop))
    kernel = _triton_kernel()
    x_BTHWC = x_BTHWC.contiguous()
    out = x_BTHWC.new_empty(shape) if out is None else out
    _, frames, height, width, channels = x_BTHWC.shape
    num_rows = out.numel() // channels
    grid, block_c, rows = row_tiling(num_rows, channels)
    kernel[grid](
        x_BTHWC,
        out,
        num_rows,
        channels,
        frames,
        height,
        width,
        shape[1],
        shape[2],
        shape[3],
        rt,
        rh,
        rw,
        drop,
        BLOCK_C=block_c,
        ROWS=rows,
        num_warps=4,
    )
    return out


def repeat_nearest(
    x_BTHWC: torch.Tensor, rt: int, rh: int, rw: int, drop: int = 0, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``triton_repeat`` for CUDA tensors when Triton is importable, else ``reference``."""
    kernel = triton_repeat if x_BTHWC.is_cuda and triton_available() else reference
    return kernel(x_BTHWC, rt, rh, rw, drop, out=out)
