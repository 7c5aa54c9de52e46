"""The Triton kernel of ``kernels/spatial_norm.py`` (which explains what it computes); imported on first use."""

import triton
import triton.language as tl

from tilecast.kernels.e4m3_triton import round_to_e4m3


@triton.jit
def spatial_norm_silu_kernel(
    h_ptr,
    h_bias_ptr,
    gamma_ptr,
    y_ptr,
    b_ptr,
    out_ptr,
    out_scale_ptr,
    scale,
    channels,
    height,
    width,
    latent_height,
    latent_width,
    rh,
    out_height,
    out_width,
    PH,
    PW,
    RW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    E4M3: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_C: tl.constexpr,
    COLS: tl.constexpr,
):
    # COLS pixels of one output row (line_tiling), every channel: h's rows, or with E4M3 the
    # padded grid's (its padding gets zeros). Rows and frames are per program; offsets within
    # a row are 32-bit, from 64-bit row bases.
    dtype = h_ptr.dtype.element_ty
    line = tl.program_id(0)
    frame = line // out_height  # batch and frame together
    row = line % out_height - PH
    out_col = tl.program_id(1) * COLS + tl.arange(0, COLS)
    col = out_col - PW
    cols = tl.arange(0, BLOCK_C)
    col_ok = cols < channels
    rows = tl.zeros_like(col) + row  # per pixel: the interpreter cannot put a scalar condition in a mask
    inside = (col >= 0) & (col < width) & (rows >= 0) & (rows < height)
    mask = inside[:, None] & col_ok[None, :]
    out_mask = (out_col < out_width)[:, None] & col_ok[None, :]

    h_row = h_ptr + (frame * height + row).to(tl.int64) * width * channels
    # An op whose operands are both in h's dtype runs in that dtype: for bf16, one rounding of the
    # exact result, which is what PyTorch's float32 op then rounding to bf16 gives (float32 has
    # more than twice bf16's precision, so the double rounding never differs), in packed bf16
    # instructions without conversions. Ops with a float32 operand (the norm, scale) run in
    # float32. One exception, the compiler's (LLVM narrows float32 ops on bf16 values to bf16,
    # then contracts; it did so before these ran in bf16 too): n * y + b is one fused
    # multiply-add, rounded once where PyTorch rounds twice (tolerance: tests/test_triton_kernels.py).
    x = tl.load(h_row + col[:, None] * channels + cols[None, :], mask=mask, other=0.0)
    if HAS_BIAS:  # the previous convolution's bias, added here instead of in a pass of its own
        x = x + tl.load(h_bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
    x = x.to(tl.float32)
    # Divisions are per row or fast (a full-precision one per element made the kernel compute-bound).
    inverse = 1.0 / tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), 1e-12)  # F.normalize's eps
    n = (x * inverse[:, None]).to(dtype).to(tl.float32)
    n = (n * scale).to(dtype)
    n = n * tl.load(gamma_ptr + cols, mask=col_ok, other=0.0)[None, :]

    # The y/b pixel every output pixel repeats.
    small_row = (frame * latent_height + row // rh).to(tl.int64) * latent_width * channels
    small_offsets = small_row + (col // RW)[:, None] * channels + cols[None, :]
    m = n * tl.load(y_ptr + small_offsets, mask=mask, other=0.0)
    m = (m + tl.load(b_ptr + small_offsets, mask=mask, other=0.0)).to(tl.float32)
    result = tl.fdiv(m, 1.0 + tl.exp(-m)).to(dtype)
    out_offsets = out_col[:, None] * channels + cols[None, :]
    out_row = out_ptr + line.to(tl.int64) * out_width * channels
    if E4M3 and INTERPRETED:  # fp8.to_e4m3 exactly: rounded in float32 first (e4m3_triton)
        q = tl.clamp(tl.where(mask, result.to(tl.float32), 0.0) / tl.load(out_scale_ptr), -448.0, 448.0)
        tl.store(out_row + out_offsets, round_to_e4m3(q).to(tl.float8e4nv), mask=out_mask)
    elif E4M3:  # the GPU's conversion rounds to nearest itself; times the inverse scale, not divided
        q = tl.where(mask, result.to(tl.float32), 0.0) * (1.0 / tl.load(out_scale_ptr))
        tl.store(out_row + out_offsets, tl.clamp(q, -448.0, 448.0).to(tl.float8e4nv), mask=out_mask)
    else:
        tl.store(out_row + out_offsets, result, mask=out_mask)
