"""FLUX's per-head query/key RMS norms and rotary embedding in one pass (``qk_norm_rope``).

Between a FLUX block's fused QKV projection and its attention, diffusers normalises every query
and key head (``RMSNorm`` over the head dim, with a learnt weight), rotates them by the rotary
embedding (``apply_rotary_emb``, interleaved pairs) and, in a joint block, puts the text tokens
before the image tokens (``torch.cat``). Under ``--compile`` Inductor fuses that into one or two
kernels of its own, which on an H100 moved the bytes at about half the memory's speed.
``qk_norm_rope`` is one Triton kernel: a program takes a block of tokens of one head of one
segment (the text or the image tokens of the joint sequence), reads each query and key head from
the projection's output where they are and writes them normalised and rotated into the joint
``BSHD`` queries and keys. With several segments it copies the value heads into the joint values
too; a lone segment's values stay a view of its projection (no copy).

The arithmetic is eager PyTorch's on CUDA: ``x * rsqrt(mean(x^2) + eps) * weight`` in float32,
rounded once to the input's dtype (``F.rms_norm``, which FLUX's ``torch.nn.RMSNorm`` calls;
diffusers' own ``RMSNorm`` class rounds before the weight too), then ``x cos + rot(x) sin`` in
float32, rounded. Where a normalised value falls near a rounding boundary, the last bits of each
implementation's reciprocal square root decide which way it rounds. ``tests/test_qk_norm_rope.py``
holds the kernel to the float32 composition: every output within 2^-6 of its head's largest
magnitude (the roundings' worst case), and on average no further from it than eager bf16 (+10%).
Rounding before the weight as well measured 1.19-1.25x eager's average error on an H100 and
differed from eager in 28% of the outputs; emulated in PyTorch on the CPU, that arithmetic gives
the same figures, and this arithmetic gives eager bf16's outputs (CPU) exactly.

It is the custom op ``tilecast::qk_norm_rope``, so ``--compile`` and CUDA graphs take the kernel as
it is. On the CPU, without Triton, or for a head dim that is not a power of two, the op computes
``reference``: the PyTorch operations diffusers' FLUX runs.

Shapes: ``qkv_BSN`` (batch, tokens, ``3 * heads * head_dim``: queries, keys, values, as FLUX's fused
projection writes them); ``cos_SD`` / ``sin_SD`` (joint tokens, head dim); ``qk_2BSHD`` (queries
and keys, batch, joint tokens, heads, head dim).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from tilecast.kernels.spatial_norm import triton_available

BLOCK_TOKENS = 16
"""Tokens of one head a program normalises and rotates."""
NUM_WARPS = 8
"""Warps of one program. These two were the fastest of 16/32/64 tokens x 4/8 warps on an H100 at
FLUX's 512² shapes (README, Performance); a program taking 4 or 8 heads in turn, sharing one
read of the rotation, was slower at every size."""

Segment = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""``(qkv_BSN, norm_q weight, norm_k weight)``: one run of the joint sequence and its norms' weights."""


def reference(
    segments: list[Segment], cos_SD: torch.Tensor, sin_SD: torch.Tensor, *, heads: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``qk_norm_rope`` by the operations diffusers' FLUX runs: ``torch.nn.RMSNorm``'s ``F.rms_norm``,
    the join, ``apply_rotary_emb``."""
    from diffusers.models.embeddings import apply_rotary_emb

    qs, ks, vs = [], [], []
    for qkv_BSN, norm_q, norm_k in segments:
        q, k, v = (t.unflatten(-1, (heads, -1)) for t in qkv_BSN.chunk(3, dim=-1))
        qs.append(F.rms_norm(q, (q.shape[-1],), norm_q, eps))
        ks.append(F.rms_norm(k, (k.shape[-1],), norm_k, eps))
        vs.append(v)
    q_BSHD, k_BSHD = (apply_rotary_emb(torch.cat(t, dim=1), (cos_SD, sin_SD), sequence_dim=1) for t in (qs, ks))
    return q_BSHD, k_BSHD, torch.cat(vs, dim=1) if len(vs) > 1 else vs[0]


@functools.cache
def _triton_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def _qk_norm_rope_kernel(
        qkv_ptr,
        qkv_batch_stride,
        qkv_row_stride,
        wq_ptr,
        wk_ptr,
        cos_ptr,
        sin_ptr,
        qk_ptr,
        qk_stride,
        v_ptr,
        rows,
        first_row,
        joint_rows,
        eps,
        HEADS: tl.constexpr,
        D: tl.constexpr,
        BLOCK: tl.constexpr,
        COPY_V: tl.constexpr,
    ):
        block, head, batch = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        row = block * BLOCK + tl.arange(0, BLOCK)  # within this segment
        col = tl.arange(0, D)
        mask = (row < rows)[:, None]
        joint = first_row + row  # position in the joint sequence
        cos = tl.load(cos_ptr + joint[:, None] * D + col[None, :], mask=mask, other=0.0)
        sin = tl.load(sin_ptr + joint[:, None] * D + col[None, :], mask=mask, other=0.0)
        sign = tl.where(col % 2 == 0, -1.0, 1.0)[None, :]  # rot(x) = (-x_odd, x_even) per pair
        src = qkv_ptr + batch.to(tl.int64) * qkv_batch_stride + row[:, None] * qkv_row_stride + head * D + col[None, :]
        out = (batch.to(tl.int64) * joint_rows + joint)[:, None] * (HEADS * D) + head * D + col[None, :]
        for which in tl.static_range(2):  # the query head, then the key head
            x = tl.load(src + which * HEADS * D, mask=mask, other=0.0)
            xf = x.to(tl.float32)
            inv = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)
            if which == 0:
                w = tl.load(wq_ptr + col)
            else:
                w = tl.load(wk_ptr + col)
            y = (xf * inv[:, None] * w[None, :].to(tl.float32)).to(x.dtype).to(tl.float32)
            even, odd = tl.split(tl.reshape(y, (BLOCK, D // 2, 2)))
            rotated = tl.reshape(tl.join(odd, even), (BLOCK, D)) * sign
            tl.store(qk_ptr + which * qk_stride + out, (y * cos + rotated * sin).to(x.dtype), mask=mask)
        if COPY_V:  # several segments: their values are joined
            tl.store(v_ptr + out, tl.load(src + 2 * HEADS * D, mask=mask, other=0.0), mask=mask)

    return _qk_norm_rope_kernel


def triton_qk_norm_rope(
    segments: list[Segment], cos_SD: torch.Tensor, sin_SD: torch.Tensor, *, heads: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(qk_2BSHD, joined values or None)``: the kernel, one launch per segment (CUDA tensors, or any
    under Triton's interpreter)."""
    import triton

    first = segments[0][0]
    batch, head_dim = first.shape[0], first.shape[-1] // (3 * heads)
    joint_rows = sum(qkv_BSN.shape[1] for qkv_BSN, _, _ in segments)
    qk_2BSHD = first.new_empty(2, batch, joint_rows, heads, head_dim)
    join = len(segments) > 1
    v_BSHD = torch.empty_like(qk_2BSHD[0]) if join else None
    cos_SD, sin_SD = (t.float().contiguous() for t in (cos_SD, sin_SD))
    start = 0
    for qkv_BSN, norm_q, norm_k in segments:
        if qkv_BSN.stride(-1) != 1:
            raise ValueError(
                f"qk_norm_rope reads rows of the projection: its last dim must be contiguous, got strides {qkv_BSN.stride()}"
            )
        rows = qkv_BSN.shape[1]
        _triton_kernels()[(triton.cdiv(rows, BLOCK_TOKENS), heads, batch)](
            qkv_BSN,
            qkv_BSN.stride(0),
            qkv_BSN.stride(1),
            norm_q,
            norm_k,
            cos_SD,
            sin_SD,
            qk_2BSHD,
            qk_2BSHD.stride(0),
            v_BSHD if join else qk_2BSHD,
            rows,
            start,
            joint_rows,
            eps,
            HEADS=heads,
            D=head_dim,
            BLOCK=BLOCK_TOKENS,
            COPY_V=join,
            num_warps=NUM_WARPS,
            enable_fp_fusion=True,
        )
        start += rows
    return qk_2BSHD, v_BSHD


def _runs_triton(qkv_BSN: torch.Tensor, heads: int) -> bool:
    head_dim = qkv_BSN.shape[-1] // (3 * heads)
    return qkv_BSN.is_cuda and triton_available() and head_dim & (head_dim - 1) == 0


@torch.library.custom_op("tilecast::qk_norm_rope", mutates_args=())
def _op(
    qkvs: list[torch.Tensor],
    weights: list[torch.Tensor],
    cos_SD: torch.Tensor,
    sin_SD: torch.Tensor,
    heads: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qk_2BSHD, joined values)``; the values are an empty tensor for a lone segment (the caller
    takes its view: an op's output may not alias its input)."""
    segments = [(qkv, weights[2 * i], weights[2 * i + 1]) for i, qkv in enumerate(qkvs)]
    if _runs_triton(qkvs[0], heads):
        qk_2BSHD, v_BSHD = triton_qk_norm_rope(segments, cos_SD, sin_SD, heads=heads, eps=eps)
    else:
        q_BSHD, k_BSHD, v_BSHD = reference(segments, cos_SD, sin_SD, heads=heads, eps=eps)
        qk_2BSHD, v_BSHD = torch.stack([q_BSHD, k_BSHD]), v_BSHD if len(qkvs) > 1 else None
    return qk_2BSHD, v_BSHD if v_BSHD is not None else qkvs[0].new_empty(0)


@_op.register_fake
def _(qkvs, weights, cos_SD, sin_SD, heads, eps):
    batch, n = qkvs[0].shape[0], qkvs[0].shape[-1]
    rows = sum(qkv.shape[1] for qkv in qkvs)
    qk_2BSHD = qkvs[0].new_empty(2, batch, rows, heads, n // (3 * heads))
    return qk_2BSHD, qk_2BSHD[0].clone() if len(qkvs) > 1 else qkvs[0].new_empty(0)


def qk_norm_rope(
    segments: list[Segment], cos_SD: torch.Tensor, sin_SD: torch.Tensor, *, heads: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The joint sequence's normalised, rotated queries and keys and its values (``BSHD``) from
    ``segments`` in order (FLUX's joint blocks: the text tokens', then the image tokens'): the
    Triton kernel where it runs (see the module doc), else ``reference``. The values of several
    segments are joined in a new tensor; a lone segment's are a view of its projection."""
    qkvs = [qkv_BSN for qkv_BSN, _, _ in segments]
    weights = [w for _, norm_q, norm_k in segments for w in (norm_q, norm_k)]
    qk_2BSHD, v_BSHD = _op(qkvs, weights, cos_SD, sin_SD, heads, eps)
    if len(segments) == 1:
        head_dim = qkvs[0].shape[-1] // (3 * heads)
        v_BSHD = qkvs[0][..., 2 * heads * head_dim :].unflatten(-1, (heads, head_dim))
    return qk_2BSHD[0], qk_2BSHD[1], v_BSHD
