"""``random/flux``: FLUX.1-dev at the released size with seeded random weights, built at load time.

The released size (17B parameters) is checked on the ``meta`` device (shapes, no memory); the
load path and a request end to end run on CPU with the sizes scaled down to the tiny ones.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.harness import make_context
from tilecast.launcher.options import model_num_heads
from tilecast.runtime.models.families import released
from tilecast.runtime.models.families.common import T2IParams
from tilecast.runtime.models.families.flux import RELEASED_CONFIGS, TINY_OVERRIDES, FluxT2IPipeline, flux_configs
from tilecast.runtime.pipeline import WorkItem
from tilecast.runtime.registry import resolve_pipeline


def test_released_configs_are_flux1_dev():
    transformer = RELEASED_CONFIGS["transformer"]
    clip, t5 = RELEASED_CONFIGS["text_encoder"], RELEASED_CONFIGS["text_encoder_2"]
    assert (transformer["num_layers"], transformer["num_single_layers"]) == (19, 38)
    assert transformer["num_attention_heads"] * transformer["attention_head_dim"] == 3072
    assert (transformer["joint_attention_dim"], transformer["pooled_projection_dim"]) == (4096, 768)
    assert transformer["guidance_embeds"] and tuple(transformer["axes_dims_rope"]) == (16, 56, 56)
    assert (
        clip["hidden_size"],
        clip["num_hidden_layers"],
        clip["num_attention_heads"],
        clip["intermediate_size"],
        clip["projection_dim"],
        clip["max_position_embeddings"],
    ) == (768, 12, 12, 3072, 768, 77)
    assert (
        t5["d_model"],
        t5["d_kv"],
        t5["d_ff"],
        t5["num_layers"],
        t5["num_heads"],
        t5["feed_forward_proj"],
        t5["relative_attention_num_buckets"],
    ) == (4096, 64, 10240, 24, 64, "gated-gelu", 32)
    vae = RELEASED_CONFIGS["vae"]
    assert vae["latent_channels"] == 16 and tuple(vae["block_out_channels"]) == (128, 256, 512, 512)
    assert (vae["scaling_factor"], vae["shift_factor"], vae["use_quant_conv"], vae["use_post_quant_conv"]) == (
        0.3611,
        0.1159,
        False,
        False,
    )
    assert RELEASED_CONFIGS["scheduler"] == dict(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    assert flux_configs() == RELEASED_CONFIGS
    with pytest.raises(ValueError, match="unknown FLUX component"):
        flux_configs({"unet": {}})


@pytest.mark.timeout(120)
def test_default_build_has_the_released_sizes_in_the_requested_dtype():
    pipe = released.build_random_flux("meta", torch.bfloat16)  # shapes only: no memory, no init cost
    billions = {
        name: sum(p.numel() for p in getattr(pipe, name).parameters()) / 1e9
        for name in ("transformer", "text_encoder", "text_encoder_2", "vae")
    }
    assert 11.8 < billions["transformer"] < 12.0, billions
    assert 4.5 < billions["text_encoder_2"] < 4.8, billions
    assert 0.08 < billions["text_encoder"] < 0.13 and 0.08 < billions["vae"] < 0.09, billions
    assert {p.dtype for name in billions for p in getattr(pipe, name).parameters()} == {torch.bfloat16}
    assert (pipe.transformer.config.num_layers, pipe.transformer.config.num_single_layers) == (19, 38)
    assert pipe.text_encoder_2.config.num_layers == 24 and pipe.tokenizer_2.model_max_length == 512


def test_routes_as_a_builtin_without_a_directory():
    assert resolve_pipeline("random/flux") is released.RandomFluxT2IPipeline
    assert issubclass(released.RandomFluxT2IPipeline, FluxT2IPipeline)
    assert released.RandomFluxT2IPipeline.max_sequence_length == 512 and FluxT2IPipeline.max_sequence_length == 128
    assert model_num_heads("random/flux") is None  # replicated family: no head rule for the picker


@pytest.mark.timeout(120)
def test_loads_in_the_requested_dtype_and_serves_a_request(monkeypatch, tmp_path):
    """The load path (registry -> load -> build_diffusers -> build_random_flux), scaled down for CPU."""
    monkeypatch.setattr(
        released, "build_random_flux", functools.partial(released.build_random_flux, overrides=TINY_OVERRIDES)
    )
    ctx = make_context(tmp_path, dtype="bfloat16")
    pipe = resolve_pipeline("random/flux").load("random/flux", ctx)
    assert pipe.dtype == torch.bfloat16 and pipe.pipe.text_encoder_2.dtype == torch.bfloat16
    again = released.build_random_flux("cpu", torch.bfloat16)
    assert torch.equal(pipe.pipe.transformer.proj_out.weight, again.transformer.proj_out.weight), "not seeded"
    assert pipe.call_kwargs(pipe.prepare(T2IParams(prompt="x", width=32, height=32), {}))["max_sequence_length"] == 512

    params = pipe.prepare(T2IParams(prompt="a cat", width=32, height=32, num_inference_steps=1, return_tensor=True), {})
    out = pipe.run([WorkItem(job_id="one", params=params)], ctx)[0]
    assert tuple(out.tensors["image"].shape) == (3, 32, 32) and torch.isfinite(out.tensors["image"]).all()
    assert out.files[0].path.is_file()

    with pytest.raises(ValueError, match="random/flux"):
        released.RandomFluxT2IPipeline.load("tiny/flux", ctx)
