"""T5 encoder attention on the fused kernel (``families.t5_attention``), on CPU.

Against transformers' own SDPA path on the same T5 encoder, float32: within 1e-5 (the same bias
added to the same scores; measured below 1e-6). On CUDA, where the memory-efficient kernel runs,
``tests/test_cuda_fast_paths.py`` holds it to bf16 rounding.
"""

from __future__ import annotations

import pytest
import torch

from tilecast.runtime.families import t5_attention


def _t5(seed: int = 0):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    config = T5Config(vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=4,
                      relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", dropout_rate=0.0)
    return T5EncoderModel(config).eval()


def test_the_fused_path_is_transformers_sdpa_path(monkeypatch):
    model = _t5()
    ids = torch.randint(0, 64, (3, 20))
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[1, 15:] = 0  # padding: the bias meets a boolean mask
    with torch.inference_mode():
        reference = [model(ids)[0], model(ids, attention_mask=mask)[0]]
    calls, kernel = [], t5_attention.biased_sdpa
    monkeypatch.setattr(t5_attention, "biased_sdpa", lambda *a, **kw: (calls.append(1), kernel(*a, **kw))[1])
    t5_attention.install(model)
    assert model.config._attn_implementation == t5_attention.NAME
    with torch.inference_mode():
        ours = [model(ids)[0], model(ids, attention_mask=mask)[0]]
    assert calls, "the fused attention did not run"
    for got, want in zip(ours, reference):
        assert (got - want).abs().max().item() <= 1e-5


def test_causal_use_is_refused():
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="serves encoders"):
        t5_attention.biased_sdpa(None, q, q, q, None, is_causal=True)


def test_flux_switches_its_t5_and_compiles_its_vae_decoder(tiny_cache):
    from tilecast.runtime.families.flux import FluxT2IPipeline

    pipe = FluxT2IPipeline.build_diffusers("tiny/flux", torch.device("cpu"), torch.float32)
    FluxT2IPipeline.install_fast_paths(pipe, {"compile": True})
    assert pipe.text_encoder_2.config._attn_implementation == t5_attention.NAME
    assert pipe.vae.decoder._compiled_call_impl is not None
