"""The Triton kernels of ``kernels/fp8_attention.py`` (which explains the scheme); imported on first use."""

import triton
import triton.language as tl

from tilecast.kernels.e4m3_triton import round_to_e4m3


@triton.jit
def quantize_blocks(
    x_ptr,
    out_ptr,
    scale_ptr,
    length,
    heads,
    stride_xb,
    stride_xs,
    stride_xh,
    stride_ob,
    stride_os,
    stride_od,
    multiplier,
    head_dim: tl.constexpr,
    BLOCK: tl.constexpr,
    DP: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    # One block of BLOCK rows of one (batch, head): PER_CHANNEL (V) e4m3 at the given float32 scale
    # of each channel of the head, else (Q, K) int8 with the block's own scale, rounded to nearest.
    block = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    rows = block * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, DP)
    mask = (rows[:, None] < length) & (cols[None, :] < head_dim)
    x = tl.load(x_ptr + b * stride_xb + h * stride_xh + rows[:, None] * stride_xs + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32) * multiplier
    if PER_CHANNEL:
        q = x / tl.load(scale_ptr + bh * DP + cols)[None, :]
        if INTERPRETED:  # the interpreter's own conversion loses a carry (e4m3_triton)
            q = round_to_e4m3(q)
        q = q.to(tl.float8e4nv)
        # Keys reordered within every 16 as ``attend_block`` reorders P's columns: key bits 3,2,1,0
        # stored at 2,3,1,0 (the bits of P's key that a thread's accumulator registers hold).
        rows = (rows & -16) | (rows & 1) | (((rows >> 3) & 1) << 1) | (((rows >> 1) & 3) << 2)
    else:
        scale = tl.maximum(tl.max(tl.abs(x)), 1e-12) / 127.0
        y = x / scale
        q = (y + tl.where(y >= 0, 0.5, -0.5)).to(tl.int8)
        tl.store(scale_ptr + bh * tl.num_programs(0) + block, scale)
    tl.store(out_ptr + bh * stride_ob + rows[:, None] * stride_os + cols[None, :] * stride_od, q)


@triton.jit
def attend_block(q, k_ptrs, vt_ptrs, ks_ptr, q_scale, m_i, l_i, acc, key0, num_k, keys, QUANT, MASK, INTERPRETED):
    # One key block of the online softmax; MASK: the block holds padded keys (the last one). V's
    # scales are per channel over all keys: the output is rescaled and the block's P·V added in one
    # multiply-add per value (V's scale applied once, at the end).
    log2_e4m3_max = 8.807354922057604  # log2(448): p comes out on e4m3's range
    k = tl.load(k_ptrs)
    scale_index = key0 // QUANT
    score_scale = q_scale * tl.load(ks_ptr + scale_index)
    qk = tl.dot(q, tl.trans(k), out_dtype=tl.int32)
    if MASK:
        valid = (key0 + keys)[None, :] < num_k
        qk = tl.where(valid, qk, -(1 << 22))  # below any score: out of the row max
    m_new = tl.maximum(m_i, tl.max(qk, 1).to(tl.float32) * score_scale)
    # The int32 score as a float with one integer add, no conversion: added to the bits of 1.5 * 2^23
    # (0x4B400000) it reads as 1.5 * 2^23 + qk exactly (|qk| < 2^22: head dims up to 256). The
    # offset times the scale leaves in the row's bias, rounded per row and key block (a shift of
    # about one step of the integer score, the same for all the block's scores).
    qk_biased = (qk + 0x4B400000).to(tl.float32, bitcast=True)
    bias = 12582912.0 * score_scale + (m_new - log2_e4m3_max)
    p = tl.math.exp2(qk_biased * score_scale - bias[:, None])
    if MASK:
        p = tl.where(valid, p, 0.0)
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    vt = tl.load(vt_ptrs)
    if INTERPRETED:
        p = round_to_e4m3(p)
    # P's keys reordered within every 16 (V is stored in that order: ``quantize_blocks``), so that
    # the registers each thread holds of the Q·K accumulator already are its part of the 8-bit
    # product's A operand (4 consecutive keys): no shuffles between threads. Key bits 3,2,1,0 move
    # to 2,3,1,0 (a thread's accumulator holds bits 0 and 3 of a key, lanes bits 1 and 2).
    p8 = tl.reshape(p.to(tl.float8e4nv), [p.shape[0], p.shape[1] // 16, 2, 2, 2, 2])
    p8 = tl.reshape(tl.permute(p8, [0, 1, 3, 4, 2, 5]), [p.shape[0], p.shape[1]])
    pv = tl.dot(p8, tl.trans(vt))
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def attend(
    q_ptr,
    k_ptr,
    vt_ptr,
    qs_ptr,
    ks_ptr,
    vs_ptr,
    out_ptr,
    lse_ptr,
    num_q,
    num_k,
    padded_q,
    padded_k,
    heads,
    stride_ob,
    stride_os,
    stride_oh,
    head_dim: tl.constexpr,
    DP: tl.constexpr,
    QUANT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    # One block of BLOCK_M query rows of one (batch, head) against every key. The operands are
    # padded to whole QUANT blocks (one scale each), which BLOCK_M and BLOCK_N divide.
    qblock = tl.program_id(0)
    bh = tl.program_id(1)
    rows = qblock * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, DP)
    keys = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + (bh * padded_q + rows[:, None]) * DP + cols[None, :])
    q_scale = tl.load(qs_ptr + bh * (padded_q // QUANT) + (qblock * BLOCK_M) // QUANT)
    k_ptrs = k_ptr + (bh * padded_k + keys[:, None]) * DP + cols[None, :]
    vt_ptrs = vt_ptr + (bh * DP + cols[:, None]) * padded_k + keys[None, :]
    ks_ptr += bh * (padded_k // QUANT)
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DP], tl.float32)
    num_full = num_k // BLOCK_N
    for kblock in range(0, num_full):
        m_i, l_i, acc = attend_block(
            q,
            k_ptrs,
            vt_ptrs,
            ks_ptr,
            q_scale,
            m_i,
            l_i,
            acc,
            kblock * BLOCK_N,
            num_k,
            keys,
            QUANT,
            False,
            INTERPRETED,
        )
        k_ptrs += BLOCK_N * DP
        vt_ptrs += BLOCK_N
    if num_full * BLOCK_N < num_k:
        m_i, l_i, acc = attend_block(
            q,
            k_ptrs,
            vt_ptrs,
            ks_ptr,
            q_scale,
            m_i,
            l_i,
            acc,
            num_full * BLOCK_N,
            num_k,
            keys,
            QUANT,
            True,
            INTERPRETED,
        )
    out = acc * (tl.load(vs_ptr + bh * DP + cols)[None, :] / l_i[:, None])
    b = bh // heads
    h = bh % heads
    out_mask = (rows[:, None] < num_q) & (cols[None, :] < head_dim)
    out_ptrs = out_ptr + b * stride_ob + h * stride_oh + rows[:, None] * stride_os + cols[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    lse = (m_i + tl.math.log2(l_i) - 8.807354922057604) * 0.6931471805599453  # remove the 448, to ln units
    tl.store(lse_ptr + bh * num_q + rows, lse, mask=rows < num_q)
