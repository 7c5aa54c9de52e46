"""Attention entry point and backend registry (single process).

Legend: B batch, S query length, K key length, H heads, D head dim.
"""

from __future__ import annotations

import math

import pytest
import torch

from tilecast.kernels import backends
from tilecast.kernels.attention import (
    FLASH_INSTALL_HINT,
    AttentionParallel,
    BackendUnavailableError,
    attention,
    available_backends,
    merge_partials,
    resolve_backend,
)

CUDA_BACKENDS = ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient")


def _qkv(seq_q=33, seq_k=33, heads=3, head_dim=16, dtype=torch.float32, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(2, seq_q, heads, head_dim), (2, seq_k, heads, head_dim), (2, seq_k, heads, head_dim)]
    return [torch.randn(s, generator=generator).to(device=device, dtype=dtype) for s in shapes]


def test_unknown_backend_lists_valid_names():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="unknown attention backend 'nope'.*chunked_math.*sdpa_math.*torch_sdpa"):
        attention(q, k, v, backend="nope")


def test_missing_flash_attn_names_error_and_install_hint(monkeypatch):
    def missing():
        raise ModuleNotFoundError("No module named 'flash_attn'")

    monkeypatch.setattr(backends, "_import_flash_attn", missing)
    q, k, v = _qkv()
    for name in ("fa", "flash_attn"):
        with pytest.raises(BackendUnavailableError) as info:
            attention(q, k, v, backend=name)
        assert FLASH_INSTALL_HINT in str(info.value) and "No module named 'flash_attn'" in str(info.value)
        assert isinstance(info.value, ValueError)
    assert "fa" not in available_backends("cuda")


def test_cpu_registry():
    assert available_backends("cpu") == ["chunked_math", "sdpa_flash_cpu", "sdpa_math"]
    assert resolve_backend(None, "cpu").name == "sdpa_flash_cpu"
    assert resolve_backend("auto", "cpu").name == "sdpa_flash_cpu"
    assert resolve_backend("torch_sdpa", "cpu").name == "sdpa_flash_cpu"
    q, k, v = _qkv()
    for name in CUDA_BACKENDS:
        with pytest.raises(BackendUnavailableError, match="(?i)cuda"):
            attention(q, k, v, backend=name)


@pytest.mark.parametrize("name", ["chunked_math", "sdpa_flash_cpu"])
def test_backends_match_math(monkeypatch, name):
    monkeypatch.setattr(backends, "CHUNK_Q", 7)  # several query and key blocks, ragged last ones
    monkeypatch.setattr(backends, "CHUNK_K", 5)
    q, k, v = _qkv(seq_q=33, seq_k=29)
    ref_BSHD, ref_lse_BHS = attention(q, k, v, backend="sdpa_math")
    out_BSHD, lse_BHS = attention(q, k, v, backend=name)
    assert lse_BHS.shape == (2, 3, 33) and lse_BHS.dtype == torch.float32
    torch.testing.assert_close(out_BSHD, ref_BSHD, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_BHS, ref_lse_BHS, atol=1e-5, rtol=1e-5)
    # And the reference matches PyTorch's own SDPA and an explicit logsumexp.
    torch_BSHD = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(
        1, 2
    )
    torch.testing.assert_close(ref_BSHD, torch_BSHD, atol=1e-5, rtol=1e-5)
    scores = torch.einsum("bshd,bkhd->bhsk", q, k) / math.sqrt(q.shape[-1])
    torch.testing.assert_close(ref_lse_BHS, scores.logsumexp(-1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["sdpa_math", "chunked_math", "sdpa_flash_cpu"])
def test_padded_keys_get_zero_weight(name):
    q, k, v = _qkv(seq_q=10, seq_k=10)
    k_pad, v_pad = (torch.cat([t, 1e3 * torch.randn(2, 3, 3, 16)], dim=1) for t in (k, v))
    out_BSHD, lse_BHS = attention(q, k_pad, v_pad, backend=name, parallel=AttentionParallel(seq_len=10))
    ref_BSHD, ref_lse_BHS = attention(q, k, v, backend="sdpa_math")
    torch.testing.assert_close(out_BSHD, ref_BSHD, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_BHS, ref_lse_BHS, atol=1e-5, rtol=1e-5)


def test_half_precision_keeps_dtype_and_fp32_lse():
    q, k, v = _qkv(dtype=torch.bfloat16)
    out_BSHD, lse_BHS = attention(q, k, v)
    ref_BSHD, _ = attention(*(t.float() for t in (q, k, v)), backend="sdpa_math")
    assert out_BSHD.dtype == torch.bfloat16 and lse_BHS.dtype == torch.float32
    torch.testing.assert_close(out_BSHD.float(), ref_BSHD, atol=2e-2, rtol=2e-2)


def test_merge_handles_empty_chunks_without_nan():
    q, k, v = _qkv(seq_q=6, seq_k=8)
    full_BSHD, full_lse_BHS = attention(q, k, v, backend="sdpa_math")
    a_BSHD, a_lse = attention(q, k[:, :5], v[:, :5], backend="sdpa_math")
    b_BSHD, b_lse = attention(q, k[:, 5:], v[:, 5:], backend="sdpa_math")
    empty_BSHD, empty_lse = torch.zeros_like(a_BSHD), torch.full_like(a_lse, -math.inf)
    out, lse = merge_partials(None, None, empty_BSHD, empty_lse)
    out, lse = merge_partials(out, lse, empty_BSHD, empty_lse)  # both empty: still no NaN
    assert torch.isfinite(out).all() and torch.isneginf(lse).all()
    for part, part_lse in ((a_BSHD, a_lse), (empty_BSHD, empty_lse), (b_BSHD, b_lse)):
        out, lse = merge_partials(out, lse, part, part_lse)
    torch.testing.assert_close(out, full_BSHD, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, full_lse_BHS, atol=1e-6, rtol=1e-5)


def test_shape_errors():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="BSHD"):
        attention(q[0], k, v)
    with pytest.raises(ValueError, match="seq_len"):
        AttentionParallel(seq_len=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", [*CUDA_BACKENDS, "fa", "chunked_math"])
def test_cuda_backends_match_math(name):
    if name == "fa" and backends._fa_check() is not None:
        pytest.skip("flash-attn not installed")
    q, k, v = _qkv(seq_q=100, seq_k=77, heads=4, head_dim=64, dtype=torch.bfloat16, device="cuda")
    ref_BSHD, ref_lse_BHS = attention(*(t.float() for t in (q, k, v)), backend="sdpa_math")
    out_BSHD, lse_BHS = attention(q, k, v, backend=name)
    assert out_BSHD.shape == q.shape and out_BSHD.dtype == torch.bfloat16
    assert lse_BHS.shape == (2, 4, 100) and lse_BHS.dtype == torch.float32
    torch.testing.assert_close(out_BSHD.float(), ref_BSHD, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse_BHS, ref_lse_BHS, atol=2e-2, rtol=2e-2)
    # Masked padding keys through the fused kernels too.
    out_pad, lse_pad = attention(q, k, v, backend=name, parallel=AttentionParallel(seq_len=50))
    ref_pad, ref_lse_pad = attention(*(t.float() for t in (q, k[:, :50], v[:, :50])), backend="sdpa_math")
    torch.testing.assert_close(out_pad.float(), ref_pad, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse_pad, ref_lse_pad, atol=2e-2, rtol=2e-2)
