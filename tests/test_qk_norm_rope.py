"""``kernels.qk_norm_rope`` (FLUX's query/key norms and rotary embedding in one pass) against
diffusers' composition, and FLUX's attention processor taking it.

The Triton kernel runs on the GPU or, without one, in Triton's interpreter on the CPU
(``tests/conftest.py``), checked in float32 there (the interpreter truncates where the GPU rounds to
bf16; see ``tests/test_triton_kernels.py``). Tolerances: float32 within 1e-5 of ``reference``
(measured 2e-6: the sums' order); bf16 on the GPU against ``reference`` in float32: every output
within 2^-6 of its head's largest magnitude (its two roundings' worst case), and on average no
further than eager bf16 (+10%). The processor with the one-pass op against diffusers' own
processor, CPU float32: 1e-5.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tilecast.kernels import qk_norm_rope as qnr

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _segments(rows: list[int], *, heads: int, head_dim: int, batch: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(sum(rows) + heads)
    segments = [
        (
            torch.randn(batch, n, 3 * heads * head_dim, generator=g).to(DEVICE, dtype),
            (1 + 0.2 * torch.randn(head_dim, generator=g)).to(DEVICE, dtype),
            (1 + 0.2 * torch.randn(head_dim, generator=g)).to(DEVICE, dtype),
        )
        for n in rows
    ]
    angles = torch.randn(sum(rows), head_dim // 2, generator=g).repeat_interleave(2, dim=-1).to(DEVICE)
    return segments, angles.cos(), angles.sin()


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
@pytest.mark.parametrize(
    "rows, heads, head_dim, batch",
    [([40], 3, 16, 2), ([7, 33], 3, 16, 2), ([5, 70], 2, 32, 1), ([1], 1, 8, 3)],
    ids=["single-block", "joint-block", "joint-long", "one-token"],
)
def test_the_kernel_is_diffusers_composition(rows, heads, head_dim, batch):
    segments, cos, sin = _segments(rows, heads=heads, head_dim=head_dim, batch=batch)
    q_ref, k_ref, v_ref = qnr.reference(segments, cos, sin, heads=heads, eps=1e-6)
    qk, v = qnr.triton_qk_norm_rope(segments, cos, sin, heads=heads, eps=1e-6)
    assert qk.shape == (2, batch, sum(rows), heads, head_dim)
    torch.testing.assert_close(qk[0], q_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(qk[1], k_ref, atol=1e-5, rtol=0)
    if len(rows) > 1:  # the values joined, copied exactly
        assert torch.equal(v, v_ref)
    else:
        assert v is None


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA or not HAS_TRITON, reason="bf16 rounding: on the GPU (the interpreter truncates)")
@pytest.mark.parametrize("rows", [[1536], [512, 1024], [77, 300]], ids=["flux-single", "flux-joint", "ragged"])
def test_bf16_on_the_gpu_is_as_close_to_float32_as_eager(rows):
    segments, cos, sin = _segments(rows, heads=24, head_dim=128, batch=2, dtype=torch.bfloat16)
    exact = qnr.reference([tuple(t.float() for t in s) for s in segments], cos, sin, heads=24, eps=1e-6)
    eager = qnr.reference(segments, cos, sin, heads=24, eps=1e-6)
    got = qnr.qk_norm_rope(segments, cos, sin, heads=24, eps=1e-6)
    for g, e, x in zip(got[:2], eager[:2], exact[:2]):
        assert g.shape == x.shape and g.dtype == torch.bfloat16
        error, eager_error = (g.float() - x).abs(), (e.float() - x).abs()
        # the norm's rounding and the output's: at worst (sqrt(2) + 1) * 2^-8 of the head's largest magnitude
        bound = 2**-6 * x.abs().amax(dim=-1, keepdim=True)
        assert (error <= bound).all(), f"worst {(error / bound).max():.2f} of the bound"
        assert error.mean() <= 1.1 * eager_error.mean(), (error.mean(), eager_error.mean())
    assert torch.equal(got[2], eager[2])  # the values: copied (joint) or a view (single)


def test_the_op_keeps_a_lone_segments_values_a_view_and_compiles_whole():
    from torch._inductor.utils import run_and_get_code

    segments, cos, sin = _segments([9], heads=2, head_dim=8, batch=2)
    q, k, v = qnr.qk_norm_rope(segments, cos, sin, heads=2, eps=1e-6)
    assert v.data_ptr() == segments[0][0][..., 32:].data_ptr()  # no copy of the values
    with torch.inference_mode():
        got, code = run_and_get_code(
            torch.compile(lambda *a: qnr.qk_norm_rope(*a, heads=2, eps=1e-6), fullgraph=True), segments, cos, sin
        )
    assert "tilecast.qk_norm_rope" in "\n".join(code)  # one opaque op: Inductor keeps the kernel
    for g, w in zip(got, (q, k, v)):
        assert torch.equal(g, w)


@pytest.mark.parametrize("joint", [True, False], ids=["joint-block", "single-block"])
def test_flux_attention_takes_the_one_pass_and_matches_diffusers_processor(joint, monkeypatch):
    from diffusers.models.transformers.transformer_flux import FluxAttention, FluxAttnProcessor

    from tilecast.runtime.models.families import flux_fast

    torch.manual_seed(0)
    attn = FluxAttention(
        query_dim=32,
        heads=2,
        dim_head=16,
        added_kv_proj_dim=32 if joint else None,
        pre_only=not joint,
        eps=1e-6,
    ).eval()
    for norm in (m for m in attn.modules() if isinstance(m, torch.nn.RMSNorm)):
        torch.nn.init.normal_(norm.weight, 1.0, 0.3)  # not ones: each segment's norms must be its own
    image, text = torch.randn(2, 12, 32), torch.randn(2, 5, 32) if joint else None
    tokens = 12 + (5 if joint else 0)
    angles = torch.randn(tokens, 8).repeat_interleave(2, dim=-1)
    rotary = (angles.cos(), angles.sin())
    with torch.no_grad():
        attn.set_processor(FluxAttnProcessor())
        want = attn(image, text, image_rotary_emb=rotary)
        attn.fuse_projections()
        attn.set_processor(flux_fast.FluxDenseAttnProcessor(backend="sdpa_math"))
        calls = []
        op = flux_fast.qk_norm_rope
        monkeypatch.setattr(flux_fast, "qk_norm_rope", lambda *a, **kw: (calls.append(len(a[0])), op(*a, **kw))[1])
        got = attn(image, text, image_rotary_emb=rotary)
    assert calls == [2 if joint else 1]
    for g, w in zip(got if joint else [got], want if joint else [want]):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
