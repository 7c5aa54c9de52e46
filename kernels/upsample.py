"""Nearest frame repeats of a channels-last video, and the interleave of an upsampler's phases.

``repeat_frames``: ``out[b, t] = x[b, (t + drop) // rt]``. The K-VAE decoder doubles frames
(dropping the first copy in the first segment) and repeats the first frame in front of the first
segment's causal convolutions. Done in PyTorch as a copy from a broadcast view, that copy runs
PyTorch's generic strided kernel (one element per thread), a large share of a tile's decode
(README, Performance). ``triton_repeat`` copies whole frames in contiguous blocks instead,
and can write into a slice of a larger buffer (``out``), such as a causal convolution's input.
Triton on CUDA when it is importable, else ``reference``; both are exact copies, equal bit for bit.

``interleave_phases`` is the other half of a 2x spatial upsampling computed by phases (the K-VAE's
``PhasedUpsample``): a 2x2 convolution gives, for every source pixel, the four output pixels it
becomes as four channel groups, and the interleave writes them to the doubled grid, adding the
bias on the way (Triton on CUDA, else PyTorch's add from a strided view; equal bit for bit).

Shapes: ``x_BTHWC`` (batch, frames, height, width, channels), channels-last.
"""

from __future__ import annotations

import functools

import torch

from tilecast.kernels.spatial_norm import line_tiling, triton_available


def output_shape(x_BTHWC: torch.Tensor, rt: int, drop: int) -> tuple[int, ...]:
    batch, frames, height, width, channels = x_BTHWC.shape
    if not 0 <= drop < rt:
        raise ValueError(f"frame repeats need rt >= 1 and 0 <= drop < rt, got rt={rt} drop={drop}")
    return batch, frames * rt - drop, height, width, channels


def reference(x_BTHWC: torch.Tensor, rt: int, drop: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """The copy from a broadcast view, in PyTorch."""
    batch, frames, height, width, channels = x_BTHWC.shape
    shape = output_shape(x_BTHWC, rt, drop)
    view = x_BTHWC[:, :, None].expand(batch, frames, rt, height, width, channels)
    view = view.reshape(batch, frames * rt, height, width, channels)[:, drop:]
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
    def repeat_frames_kernel(x_ptr, out_ptr, frame_size, frames, out_frames, rt, drop, BLOCK: tl.constexpr):
        # A program copies BLOCK elements of one output frame (batch and frame together) from its
        # source frame: where they come from is a division per program, none per element.
        blocks = tl.cdiv(frame_size, BLOCK)
        frame, block = tl.program_id(0) // blocks, tl.program_id(0) % blocks
        batch, t = frame // out_frames, frame % out_frames
        source = batch * frames + (t + drop) // rt
        offsets = block * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < frame_size
        values = tl.load(x_ptr + source.to(tl.int64) * frame_size + offsets, mask=mask)
        tl.store(out_ptr + frame.to(tl.int64) * frame_size + offsets, values, mask=mask)

    return repeat_frames_kernel


FRAME_BLOCK = 4096
"""Elements of a frame one program of ``triton_repeat`` copies."""


def triton_repeat(x_BTHWC: torch.Tensor, rt: int, drop: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """``reference`` in one Triton kernel (CUDA tensors); straight into ``out`` when it is contiguous."""
    import triton

    shape = output_shape(x_BTHWC, rt, drop)
    if out is not None and tuple(out.shape) != shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {shape}")
    if out is not None and not out.is_contiguous():
        return out.copy_(triton_repeat(x_BTHWC, rt, drop))
    x_BTHWC = x_BTHWC.contiguous()
    out = x_BTHWC.new_empty(shape) if out is None else out
    batch, frames = x_BTHWC.shape[:2]
    frame_size = x_BTHWC[0, 0].numel()
    grid = (batch * shape[1] * triton.cdiv(frame_size, FRAME_BLOCK),)
    _triton_kernel()[grid](
        x_BTHWC, out, frame_size, frames, shape[1], rt, drop, BLOCK=FRAME_BLOCK, num_warps=4, enable_fp_fusion=True
    )
    return out


def repeat_frames(x_BTHWC: torch.Tensor, rt: int, drop: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """``triton_repeat`` for CUDA tensors when Triton is importable, else ``reference``."""
    kernel = triton_repeat if x_BTHWC.is_cuda and triton_available() else reference
    return kernel(x_BTHWC, rt, drop, out=out)


def phases_shape(y_BTHWC: torch.Tensor) -> tuple[int, ...]:
    """The doubled grid ``(B, T, 2H, 2W, C)`` that phases ``(B, T, H + 1, W + 1, 4 C)`` interleave to."""
    batch, frames, height1, width1, channels4 = y_BTHWC.shape
    if channels4 % 4 or height1 < 2 or width1 < 2:
        raise ValueError(f"phases need (B, T, H + 1, W + 1, 4 C) with H, W >= 1, got {tuple(y_BTHWC.shape)}")
    return batch, frames, 2 * (height1 - 1), 2 * (width1 - 1), channels4 // 4


def phases_reference(y_BTHWC: torch.Tensor, bias_C: torch.Tensor) -> torch.Tensor:
    """``out[b, t, 2i + a, 2j + e, c] = y[b, t, i + a, j + e, (2a + e) C + c] + bias[c]``, in PyTorch (an add
    from a strided view of ``y``)."""
    batch, frames, out_height, out_width, channels = phases_shape(y_BTHWC)
    y_BTHWC = y_BTHWC.contiguous()
    s_b, s_t, s_h, s_w, _ = y_BTHWC.stride()
    phases = y_BTHWC.as_strided(
        (batch, frames, out_height // 2, 2, out_width // 2, 2, channels),
        (s_b, s_t, s_h, s_h + 2 * channels, s_w, s_w + channels, 1),
    )
    out = y_BTHWC.new_empty(batch, frames, out_height, out_width, channels)
    torch.add(phases, bias_C, out=out.view(phases.shape))
    return out


@functools.cache
def _triton_phases_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def interleave_phases_kernel(
        y_ptr, bias_ptr, out_ptr, channels, out_height, out_width, BLOCK_C: tl.constexpr, COLS: tl.constexpr
    ):
        # COLS pixels of one output row (spatial_norm.line_tiling), every channel: output row
        # 2i + a reads phase row i + a, output column 2j + e phase column j + e, channel group 2a + e.
        dtype = out_ptr.dtype.element_ty
        line = tl.program_id(0)
        frame, row = line // out_height, line % out_height  # batch and frame together
        a = row % 2
        col = tl.program_id(1) * COLS + tl.arange(0, COLS)
        e = col % 2
        cols = tl.arange(0, BLOCK_C)
        col_ok = cols < channels
        mask = (col < out_width)[:, None] & col_ok[None, :]
        source_row = (frame * (out_height // 2 + 1) + row // 2 + a).to(tl.int64) * (out_width // 2 + 1) * 4 * channels
        offsets = ((col // 2 + e) * 4 * channels + (2 * a + e) * channels)[:, None] + cols[None, :]
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        values = tl.load(y_ptr + source_row + offsets, mask=mask, other=0.0).to(tl.float32)
        out_row = out_ptr + line.to(tl.int64) * out_width * channels
        tl.store(out_row + col[:, None] * channels + cols[None, :], (values + bias[None, :]).to(dtype), mask=mask)

    return interleave_phases_kernel


def triton_phases(y_BTHWC: torch.Tensor, bias_C: torch.Tensor) -> torch.Tensor:
    """``phases_reference`` in one Triton kernel (CUDA tensors), reading whole channel rows."""
    shape = phases_shape(y_BTHWC)
    y_BTHWC = y_BTHWC.contiguous()
    out = y_BTHWC.new_empty(shape)
    batch, frames, out_height, out_width, channels = shape
    grid, block_c, cols = line_tiling(batch * frames * out_height, out_width, channels)
    _triton_phases_kernel()[grid](
        y_BTHWC,
        bias_C,
        out,
        channels,
        out_height,
        out_width,
        BLOCK_C=block_c,
        COLS=cols,
        num_warps=4,
        enable_fp_fusion=True,
    )
    return out


def interleave_phases(y_BTHWC: torch.Tensor, bias_C: torch.Tensor) -> torch.Tensor:
    """``triton_phases`` for CUDA tensors when Triton is importable, else ``phases_reference``."""
    kernel = triton_phases if y_BTHWC.is_cuda and triton_available() else phases_reference
    return kernel(y_BTHWC, bias_C)
