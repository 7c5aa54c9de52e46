"""tilecast's channels-last K-VAE decode against diffusers' ``Kandinsky6SRVAE.decode``."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from diffusers import Kandinsky6SRVAE

from tilecast.kernels.spatial_norm import reference as norm_modulate_silu
from tilecast.runtime.models.k6sr.tiny import VAE_CONFIG
from tilecast.runtime.models.k6sr.vae_decode import ChannelsLastDecoder, nearest_index


def make_vae(seed: int = 0, **overrides) -> Kandinsky6SRVAE:
    torch.manual_seed(seed)
    vae = Kandinsky6SRVAE(**{**VAE_CONFIG, **overrides}).eval().requires_grad_(False)
    with torch.no_grad():  # random norm gains, so a wrong gamma/scale order cannot hide behind ones
        for name, param in vae.named_parameters():
            if name.endswith("gamma"):
                param.uniform_(0.5, 1.5)
    return vae


@pytest.mark.parametrize(
    "latent_frames, height, width",
    [
        (1, 3, 4),  # one latent frame: one segment, one pixel frame
        (5, 2, 3),  # exactly the first segment
        (11, 3, 5),  # segments of 5, 4 and 2 latent frames: causal frames carried twice
        (8, 4, 2),  # a short last segment of 3
    ],
)
def test_matches_diffusers_decode_float32(latent_frames, height, width):
    vae = make_vae()
    z = torch.randn(1, vae.config.latent_channels, latent_frames, height, width)
    with torch.no_grad():
        reference = vae.decode(z, return_dict=False)[0]
    decoded = ChannelsLastDecoder(vae).decode(z)
    assert decoded.shape == reference.shape == (1, 3, 1 + 4 * (latent_frames - 1), 16 * height, 16 * width)
    assert decoded.is_contiguous()
    torch.testing.assert_close(decoded, reference, rtol=0, atol=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (on the CPU: its interpreter)")
@pytest.mark.parametrize("channels", [None, (16, 64, 16, 16, 16)])  # the second: 64 -> 16 on the reuse kernel
def test_narrow_convs_on_triton_decode_as_diffusers(monkeypatch, channels):
    """``narrow_convs``: the convolutions with at most 16 output channels (all of the tiny VAE's
    3x3x3 ones) on ``kernels/narrow_conv.py``, float32 within 1e-5 of diffusers without TF32 (one
    small segment: on the CPU the kernel runs in Triton's interpreter, 15 s for this)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    vae = make_vae(seed=3, **({"decoder_block_out_channels": channels} if channels else {})).to(device)
    z = torch.randn(1, vae.config.latent_channels, 2, 1, 1, device=device)
    with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        reference = vae.decode(z, return_dict=False)[0]
    from tilecast.kernels import narrow_conv

    calls = []
    run = narrow_conv.triton_conv
    monkeypatch.setattr(narrow_conv, "triton_conv", lambda *args: calls.append(args[0].shape[-1]) or run(*args))
    decoder = ChannelsLastDecoder(vae, narrow_convs=True)
    narrow = [
        m
        for m in vae.decoder.modules()
        if isinstance(m, torch.nn.Conv3d) and m.kernel_size == (3, 3, 3) and m.out_channels <= 16
    ]
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        got = decoder.decode(z)
    torch.testing.assert_close(got, reference, rtol=0, atol=1e-5)
    assert len(decoder._narrow) == len(narrow) and len(calls) == len(narrow)  # one segment: each layer once
    assert any(tiling.reuse for _, tiling in decoder._narrow.values()) == (channels is not None)


def test_narrow_convs_by_default_only_on_cuda():
    """``narrow_convs=None``: Triton's kernels where the decoder's weights are on a CUDA device (and
    Triton is installed), PyTorch's convolutions elsewhere."""
    vae = make_vae()
    assert ChannelsLastDecoder(vae)._narrow == {}
    if torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
        assert ChannelsLastDecoder(vae.cuda())._narrow


def test_narrow_convs_without_triton_are_refused_naming_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(ValueError, match=r"narrow_convs=True\) needs Triton"):
        ChannelsLastDecoder(make_vae(), narrow_convs=True)


def test_batch_of_tiles_and_reuse():
    """A chunk of several tiles decodes like each tile alone, and a second call starts fresh."""
    vae = make_vae(seed=1)
    z = torch.randn(2, vae.config.latent_channels, 6, 2, 2)
    with torch.no_grad():
        reference = vae.decode(z, return_dict=False)[0]
    decoder = ChannelsLastDecoder(vae)
    first = decoder.decode(z)
    again = decoder.decode(z)
    torch.testing.assert_close(first, reference, rtol=0, atol=1e-5)
    assert torch.equal(first, again)


def test_diffusers_decode_unchanged_after_weights_go_channels_last():
    vae = make_vae(seed=2)
    z = torch.randn(1, vae.config.latent_channels, 5, 2, 2)
    with torch.no_grad():
        before = vae.decode(z, return_dict=False)[0]
        ChannelsLastDecoder(vae)
        after = vae.decode(z, return_dict=False)[0]
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)


def test_nearest_index_is_pytorchs():
    for size_in, size_out in [(4, 16), (5, 9), (3, 7), (31, 121), (2, 2), (6, 4)]:
        x = torch.arange(size_in, dtype=torch.float32)[None, None]
        expected = torch.nn.functional.interpolate(x, size=size_out, mode="nearest")[0, 0].long()
        assert torch.equal(nearest_index(size_in, size_out, "cpu"), expected), (size_in, size_out)


def test_norm_modulate_silu_broadcast_equals_materialised_upsample():
    torch.manual_seed(3)
    h = torch.randn(1, 3, 8, 12, 16)
    y, b = torch.randn(1, 3, 2, 3, 16), torch.randn(1, 3, 2, 3, 16)
    gamma = torch.rand(16) + 0.5
    got = norm_modulate_silu(h, 4.0, gamma, y, b, 4, 4)
    up = lambda t: t.repeat_interleave(4, dim=2).repeat_interleave(4, dim=3)  # noqa: E731
    expected = torch.nn.functional.silu(torch.nn.functional.normalize(h, dim=-1) * 4.0 * gamma * up(y) + up(b))
    torch.testing.assert_close(got, expected)


# ----------------------------------------------------------------------------- in the pipeline


def _load(cache, **settings):
    from tests.harness import make_context
    from tilecast.runtime.models.k6sr.pipeline import K6SRPipeline

    return K6SRPipeline.load("tiny/k6sr", make_context(cache / "out", cache_dir=cache, **settings))


def _upscale(pipe) -> torch.Tensor:
    from tests.test_placement import clip
    from tilecast.runtime.models.k6sr.params import SRParams

    return pipe.upscale_frames(clip(), SRParams(sr_resolution_scale=2))[0]


def test_pipeline_decodes_with_it_by_default_and_matches_diffusers(tiny_cache):
    fast = _load(tiny_cache)
    reference = _load(tiny_cache, vae={"fast_decode": False})
    assert isinstance(fast.parts.decoder, ChannelsLastDecoder)
    assert reference.parts.decoder is None
    torch.testing.assert_close(_upscale(fast), _upscale(reference), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "settings",
    [
        dict(layerwise_offload_components="vae"),
        dict(cpu_offload_components="vae"),
    ],
)
def test_placed_vae_keeps_diffusers_decode(tiny_cache, settings):
    assert _load(tiny_cache, **settings).parts.decoder is None


def test_spatial_shard_keeps_diffusers_decode(tiny_cache):
    pipe = _load(tiny_cache)
    pipe.tile_work.decode_mode = "spatial_shard"  # what a multi-rank --vae-config.use-parallel-decode selects
    assert not pipe.fast_decode_applies()


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("frames, height, width", [(9, 5, 7), (4, 6, 4)])
def test_spatial_norm_matches_diffusers_for_any_resize(first, frames, height, width):
    """Also a feature grid that is no whole multiple of zq's (rows/columns gathered, not broadcast)."""
    vae = make_vae(seed=4)
    norm = vae.decoder.norm_out
    channels = norm.norm_layer.gamma.shape[0]
    h = torch.randn(1, channels, frames, height, width)
    zq = torch.randn(1, vae.config.latent_channels, 3, 2, 3)
    with torch.no_grad():
        expected = torch.nn.functional.silu(norm(h, zq, {"is_first_segment": first}))
        got = ChannelsLastDecoder(vae)._spatial_norm_silu(
            norm, h.permute(0, 2, 3, 4, 1).contiguous(), zq.permute(0, 2, 3, 4, 1).contiguous(), first
        )
    torch.testing.assert_close(got.permute(0, 4, 1, 2, 3), expected, rtol=0, atol=1e-5)


# ---- frame repeats (kernels/upsample.py) --------------------------------------------------------
def test_frame_repeat_reference_is_repeat_interleave_and_writes_into_slices():
    from tilecast.kernels.upsample import reference, repeat_frames

    x = torch.randn(2, 3, 4, 5, 6)
    expected = x.repeat_interleave(3, 1)
    assert torch.equal(reference(x, 3), expected)
    assert torch.equal(repeat_frames(x, 3, drop=2), expected[:, 2:])
    buffer = torch.zeros(2, 8, 4, 5, 6)
    repeat_frames(x, 2, drop=1, out=buffer[:, 3:])  # into a causal convolution's body
    assert torch.equal(buffer[:, 3:], x.repeat_interleave(2, 1)[:, 1:]) and not buffer[:, :3].any()


@pytest.mark.parametrize("factors, message", [((0, 0), "rt >= 1"), ((2, 2), "drop < rt")])
def test_frame_repeat_refuses_bad_factors(factors, message):
    from tilecast.kernels.upsample import repeat_frames

    with pytest.raises(ValueError, match=message):
        repeat_frames(torch.zeros(1, 2, 2, 2, 4), *factors)
    with pytest.raises(ValueError, match="expected"):
        repeat_frames(torch.zeros(1, 2, 2, 2, 4), 2, out=torch.zeros(1, 2, 2, 2, 4))


def test_bias_add_reference_rounds_like_two_adds_and_the_norm_takes_a_bias():
    from tilecast.kernels.channel_bias import add_bias_

    y, bias, residual = (
        torch.randn(1, 2, 3, 4, 8).bfloat16(),
        torch.randn(8).bfloat16(),
        torch.randn(1, 2, 3, 4, 8).bfloat16(),
    )
    expected = (y + bias) + residual
    assert torch.equal(add_bias_(y.clone(), bias, residual), expected)
    assert torch.equal(add_bias_(y.clone(), None, residual), y + residual)
    h, gamma = torch.randn(1, 2, 4, 4, 8), torch.rand(8) + 0.5
    zy, zb = torch.randn(1, 2, 2, 2, 8), torch.randn(1, 2, 2, 2, 8)
    assert torch.equal(
        norm_modulate_silu(h, 2.0, gamma, zy, zb, 2, 2, h_bias_C=bias.float()),
        norm_modulate_silu(h + bias.float(), 2.0, gamma, zy, zb, 2, 2),
    )


@pytest.mark.parametrize("height, width", [(3, 5), (1, 1), (4, 2)])
def test_phased_upsample_equals_diffusers_upsampler(height, width):
    """Doubling, 1x3x3 convolution, residual and linear of diffusers' upsampler, by four 2x2 phases
    on the undoubled grid (borders included: the doubled grid's zero padding is the source's)."""
    from diffusers.models.autoencoders.autoencoder_kandinsky6_sr import Kandinsky6SRUpsample

    from tilecast.runtime.models.k6sr.vae_decode import PhasedUpsample

    torch.manual_seed(height * 10 + width)
    upsample = Kandinsky6SRUpsample(8, compress_time=False).double()
    with torch.no_grad():
        for param in upsample.parameters():  # non-zero biases, so a dropped one shows
            param.uniform_(-0.5, 0.5)
        x = torch.randn(2, 8, 3, height, width, dtype=torch.float64)
        expected = upsample(x, {})
        got = PhasedUpsample(upsample)(x.permute(0, 2, 3, 4, 1).contiguous()).permute(0, 4, 1, 2, 3)
    assert got.shape == expected.shape == (2, 8, 3, 2 * height, 2 * width)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_phases_interleave_each_output_pixel_from_its_group():
    from tilecast.kernels.upsample import phases_reference

    y = torch.randn(2, 3, 4, 5, 4 * 6)
    bias = torch.randn(6)
    out = phases_reference(y, bias)
    assert out.shape == (2, 3, 6, 8, 6)
    for i in range(3):
        for j in range(4):
            for a in (0, 1):
                for e in (0, 1):
                    group = y[:, :, i + a, j + e, (2 * a + e) * 6 : (2 * a + e + 1) * 6]
                    assert torch.equal(out[:, :, 2 * i + a, 2 * j + e], group + bias)


def test_phased_decode_does_fewer_flops_than_diffusers():
    """At the released size the upsamplers' 1x3x3 convolutions and linears on the doubled grid were
    21% of a tile's FLOPs; by phases they cost 4/9 of the convolution alone (counted on meta tensors)."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        vae = Kandinsky6SRVAE().eval()
    z = torch.empty(1, 64, 5, 4, 6, device="meta")
    counts = []
    phased = ChannelsLastDecoder(vae)  # its weights are combined here, not counted
    for decode in (lambda: vae.decode(z, return_dict=False), lambda: phased.decode(z)):
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            decode()
        counts.append(counter.get_total_flops())
    diffusers_flops, phased_flops = counts
    assert 0.85 * diffusers_flops < phased_flops < 0.9 * diffusers_flops


def test_a_profile_names_every_decoder_level(tmp_path):
    """``bench k6sr --profile`` tables show the decode per level (named ranges of each segment)."""
    from tilecast.launcher.bench.report import profile_call

    vae = make_vae(seed=4)
    decoder = ChannelsLastDecoder(vae)
    z = torch.randn(1, vae.config.latent_channels, 2, 1, 1)
    table = profile_call(lambda: decoder.decode(z), tmp_path / "decode.txt", device="cpu").read_text()
    levels = [f"k-vae: level {level} (" for level in range(len(vae.decoder.up))]
    assert all(name in table for name in ["k-vae: conv_in + mid", *levels, "k-vae: norm_out + conv_out"]), table
    assert "k-vae: level 1 upsample" in table and "aten::" in table
