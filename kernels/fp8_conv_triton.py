"""The Triton kernels of ``kernels/fp8_conv.py`` (which explains the layout); imported on first use."""

import triton
import triton.language as tl

from tilecast.kernels.e4m3_triton import round_to_e4m3


@triton.jit
def quantize(
    x_ptr,
    q_ptr,
    scale_ptr,
    height,
    width,
    padded_height,
    padded_width,
    PH,
    PW,
    C: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One padded row of one frame: ``x / scale`` in e4m3 inside, zeros in the padding."""
    row = tl.program_id(0).to(tl.int64)  # frame * padded_height + padded row
    frame, hp = row // padded_height, row % padded_height
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    wp, c = e // C, e % C
    h, w = hp - PH + tl.zeros([BLOCK], dtype=tl.int64), wp - PW  # h per value: the interpreter's masks
    inside = (h >= 0) & (h < height) & (w >= 0) & (w < width)
    x = tl.load(x_ptr + ((frame * height + h) * width + w) * C + c, mask=inside, other=0.0)
    q = tl.clamp(x.to(tl.float32) / tl.load(scale_ptr), -448.0, 448.0)
    q = round_to_e4m3(q)  # on the GPU too: the interpreter's conversion is wrong without it
    tl.store(q_ptr + row * padded_width * C + e, q.to(tl.float8e4nv), mask=e < padded_width * C)


@triton.jit
def conv(
    x_desc,
    w_desc,
    y_ptr,
    x_scale_ptr,
    w_scale_ptr,
    frames_in,
    out_frames,
    padded_height,
    padded_width,
    out_height,
    out_width,
    out_channels,
    stride_yb,
    stride_yt,
    stride_yh,
    C: tl.constexpr,
    KT: tl.constexpr,
    KH: tl.constexpr,
    KW: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    b = tl.program_id(2) // out_frames
    t = tl.program_id(2) % out_frames
    frame_rows = padded_height * padded_width
    first_row = (b * frames_in + t) * frame_rows + pid_m * BM  # tap (0, 0, 0) of the block's first pixel
    n0 = pid_n * BN
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for step in range(KT * KH * KW * (C // BK)):
        tap = step // (C // BK)
        c0 = (step % (C // BK)) * BK
        shift = (tap // (KH * KW)) * frame_rows + ((tap // KW) % KH) * padded_width + tap % KW
        a = x_desc.load([first_row + shift, c0])
        w = w_desc.load([n0, tap * C + c0])
        acc = tl.dot(a, w.T, acc)
    n = n0 + tl.arange(0, BN)
    n_ok = n < out_channels
    acc *= tl.load(x_scale_ptr) * tl.load(w_scale_ptr + n, mask=n_ok, other=0.0)[None, :]
    p = pid_m * BM + tl.arange(0, BM)
    h, w = p // padded_width, p % padded_width
    out = y_ptr + b.to(tl.int64) * stride_yb + t.to(tl.int64) * stride_yt + h.to(tl.int64)[:, None] * stride_yh
    out += w.to(tl.int64)[:, None] * out_channels + n[None, :]
    mask = ((h < out_height) & (w < out_width))[:, None] & n_ok[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)
