"""``kernels/fp8_conv.py``: FP8 convolutions as shifted-row GEMMs (Triton; on the CPU its interpreter),
and the K-VAE decode that runs them (``--vae-config.fp8-convs``)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from tilecast.kernels import fp8_conv

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs Triton (on the CPU: its interpreter)"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = fp8_conv.Tiling(bm=16, bn=16, bk=32, num_warps=4, num_stages=2)
"""Small blocks, so the interpreter's tiny shapes still take several blocks of rows, channels and taps."""


@pytest.mark.parametrize(
    "kernel, padding, channels, size",
    [
        ((3, 3, 3), (1, 1), (32, 48), (4, 5, 7)),  # the decoder's causal 3x3x3 (outputs past one channel block)
        ((1, 2, 2), (1, 1), (32, 64), (1, 3, 4)),  # PhasedUpsample's 2x2, an output one larger each way
        ((3, 1, 1), (0, 0), (64, 16), (3, 2, 3)),  # the upsamplers' temporal convolution
    ],
)
def test_fp8_conv_computes_its_reference(kernel, padding, channels, size):
    """Every output pixel, channel and tap lands where ``F.conv3d`` of the dequantized operands puts
    it (float32: only the summation order differs), and the quantization costs what e4m3 costs
    (a few percent of the exact convolution, relative to its norm)."""
    torch.manual_seed(0)
    in_channels, out_channels = channels
    x = torch.randn(2, *size, in_channels, device=DEVICE)
    weight = torch.randn(out_channels, in_channels, *kernel, device=DEVICE) / (in_channels * 27) ** 0.5
    packed = fp8_conv.pack_weight(weight)
    got = fp8_conv.fp8_conv(x, packed, padding, SMALL)
    expected = fp8_conv.reference(x, packed, padding)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    exact = F.conv3d(x.permute(0, 4, 1, 2, 3), weight, None, 1, (0, *padding)).permute(0, 2, 3, 4, 1)
    assert ((got - exact).norm() / exact.norm()).item() < 0.06


def test_quantize_padded_rounds_as_torch_does_and_pads_with_zeros():
    """The e4m3 values are PyTorch's rounding of ``x / scale`` (including the ones whose rounding
    carries into the exponent, 127.3 -> 128, which Triton's interpreter cast alone gets wrong), and
    the padding is zeros."""
    torch.manual_seed(0)
    x = torch.randn(1, 2, 3, 4, 16, device=DEVICE)
    x[0, 0, 0, 0, :4] = torch.tensor([127.3, -127.3, 251.0, 0.3], device=DEVICE) * x.abs().max() / 448
    q, scale = fp8_conv.quantize_padded(x, (1, 2))
    assert q.dtype == torch.float8_e4m3fn and q.shape == (1, 2, 5, 8, 16)
    assert torch.equal(scale, fp8_conv.activation_scale(x))
    expected = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(q[:, :, 1:-1, 2:-2].float(), expected.float())
    inside = torch.zeros(q.shape[:4], dtype=torch.bool, device=DEVICE)
    inside[:, :, 1:-1, 2:-2] = True
    assert not q.float()[~inside].any()


def test_bad_tilings_and_channels_are_refused_naming_them(monkeypatch):
    with pytest.raises(ValueError, match=r"write it as BMxBNkBKwWARPSsSTAGES"):
        fp8_conv.Tiling.parse("128x256")
    with pytest.raises(ValueError, match=r"bn must be a power of two of at least 16, got 96"):
        fp8_conv.Tiling.parse("128x96k128w8s3")
    with pytest.raises(ValueError, match=r"e4m3 products need bk of at least 32"):
        fp8_conv.Tiling.parse("128x128k16w8s3")
    with pytest.raises(ValueError, match=r"input channels must be multiples of 32 .* got 48 -> 24"):
        fp8_conv.pack_weight(torch.randn(24, 48, 3, 3, 3))
    packed = fp8_conv.pack_weight(torch.randn(16, 32, 3, 3, 3))

    def no_kernel(*args):  # the input is refused before any kernel runs (a GPU would reject CPU tensors)
        raise AssertionError("quantized an input it then refused")

    monkeypatch.setattr(fp8_conv, "quantize_padded", no_kernel)
    with pytest.raises(ValueError, match=r"the input has 64 channels, the weight takes 32"):
        fp8_conv.fp8_conv(torch.randn(1, 3, 2, 2, 64), packed, (1, 1))
    with pytest.raises(ValueError, match=r"2 input frames for a kernel 3 frames deep"):
        fp8_conv.fp8_conv(torch.randn(1, 2, 2, 2, 32), packed, (1, 1))
    assert fp8_conv.Tiling().fit(96, 40) == fp8_conv.Tiling(bn=64, bk=32)  # bk divides 96, bn covers 40


def test_decode_with_fp8_convs_runs_every_wide_convolution_through_the_kernel(monkeypatch):
    """``ChannelsLastDecoder(fp8_convs=True)`` on a VAE with 32-channel levels: every causal and
    upsampling convolution wider than 16 channels runs the FP8 kernel, each call within float32
    summation of the convolution of its dequantized operands (compared call by call: a decode-wide
    comparison would amplify rounding flips of the next layers' quantization); the resnet blocks'
    convolutions take their e4m3 input straight from the spatial norm (no ``quantize_padded``), with
    nothing saturated; and the result stays near diffusers' float32 decode (random weights: about
    35 dB). On the GPU the tolerance is Hopper's: its e4m3 products accumulate with fewer than
    float32's bits (on an H100 most calls were 2-4e-4 off, the worst 2.0e-3)."""
    from tests.test_vae_decode import make_vae
    from tilecast.launcher.bench.report import psnr_db
    from tilecast.runtime.models.k6sr.vae_decode import ChannelsLastDecoder

    vae = make_vae(seed=3, decoder_block_out_channels=(32, 32, 32, 32, 32)).to(DEVICE)
    z = torch.randn(1, vae.config.latent_channels, 2, 1, 2, device=DEVICE)
    with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        exact = vae.decode(z, return_dict=False)[0]
    decoder = ChannelsLastDecoder(vae, fp8_convs=True)
    convs = [m for m in vae.decoder.modules() if isinstance(m, torch.nn.Conv3d) and m.kernel_size != (1, 1, 1)]
    wide = [m for m in convs if ChannelsLastDecoder._wide(m)]  # the upsamplers' 1x1 linears fold into the 2x2
    assert len(decoder._fp8) + sum(p.fp8 is not None for p in decoder._phased.values()) == len(wide)
    blocks = [m for m in vae.decoder.modules() if type(m).__name__ == "Kandinsky6SRResnetBlock3D"]
    norm_fed = sum(ChannelsLastDecoder._wide(conv.conv) for block in blocks for conv in (block.conv1, block.conv2))
    errors, quantized, largest = [], [], []
    run, quantize = fp8_conv.conv_quantized, fp8_conv.quantize_padded

    def checked(q, x_scale, weight, out_dtype, tiling=None):
        out = run(q, x_scale, weight, out_dtype, tiling)
        x = (q.float() * x_scale).permute(0, 4, 1, 2, 3)
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
            expected = F.conv3d(x, fp8_conv.dequantize_weight(weight), None, 1, 0).permute(0, 2, 3, 4, 1)
        errors.append(((out.float() - expected).abs().max() / expected.abs().max()).item())
        if q.data_ptr() not in quantized:  # written by the norm
            largest.append(q.float().abs().max().item())
        return out

    def counted(x, padding):
        q, x_scale = quantize(x, padding)
        quantized.append(q.data_ptr())
        return q, x_scale

    monkeypatch.setattr(fp8_conv, "conv_quantized", checked)
    monkeypatch.setattr(fp8_conv, "quantize_padded", counted)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        got = decoder.decode(z)
    assert len(errors) == len(wide)  # one segment: each wide layer once
    assert len(quantized) == len(wide) - norm_fed > 0 and norm_fed > 0
    assert max(errors) <= (5e-3 if DEVICE == "cuda" else 1e-5), errors
    assert len(largest) == norm_fed and 10 < max(largest) < 448  # the norm's bound is a bound, and not a loose one
    assert 30 < psnr_db(got, exact) < 50


def test_fp8_convs_setting_is_refused_where_it_cannot_run():
    """``--vae-config.fp8-convs`` names why it cannot run: not on a CPU, and the video families'
    VAEs are not the K-VAE."""
    from tilecast.runtime.config import ServeConfig, VaeConfig
    from tilecast.runtime.registry import builtin_models

    with pytest.raises(ValueError, match=r"runs on a CUDA GPU \(Hopper or newer\), not cpu"):
        fp8_conv.check_supported(torch.device("cpu"))
    settings = ServeConfig(vae=VaeConfig(fp8_convs=True))
    with pytest.raises(ValueError, match=r"fp8.convs.*K6 SR's K-VAE only"):
        builtin_models()["tiny/wan2.1-t2v"].check_settings(settings, "tiny/wan2.1-t2v")
    builtin_models()["tiny/k6sr"].check_settings(settings, "tiny/k6sr")  # honoured there (on a Hopper GPU)


def test_k6sr_refuses_fp8_convs_on_a_cpu_and_without_the_fast_decode(monkeypatch, tmp_path):
    """Loading K6 SR with ``--vae-config.fp8-convs`` names why it cannot be honoured: the device,
    and (on a GPU that could run it) the decode it needs being off."""
    from tests.harness import make_context
    from tilecast.runtime.config import ServeConfig, VaeConfig
    from tilecast.runtime.models.k6sr.pipeline import FP8_CONVS_REFUSAL, K6SRPipeline

    settings = ServeConfig(device="cpu", vae=VaeConfig(fp8_convs=True))
    with pytest.raises(ValueError, match=r"runs on a CUDA GPU"):
        K6SRPipeline.load("tiny/k6sr", make_context(tmp_path, settings=settings, cache_dir=tmp_path))
    monkeypatch.setattr(fp8_conv, "check_supported", lambda device: None)  # as on a Hopper GPU
    settings = ServeConfig(device="cpu", vae=VaeConfig(fp8_convs=True, fast_decode=False))
    with pytest.raises(ValueError, match=FP8_CONVS_REFUSAL[:40]):
        K6SRPipeline.load("tiny/k6sr", make_context(tmp_path, settings=settings, cache_dir=tmp_path))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tiling", ["128x256k128w8s3", "128x128k128w4s4", "64x128k64w4s3"])
def test_fp8_conv_on_the_gpu_in_bf16(tiling):
    """On the GPU (TMA, e4m3 tensor cores), bf16 in and out: within bf16's rounding of the float32
    reference, at a decoder-like width (256 channels, rows of 40 pixels: blocks straddle rows)."""
    torch.manual_seed(0)
    x = torch.randn(1, 4, 12, 40, 256, device="cuda").bfloat16()
    weight = (torch.randn(256, 256, 3, 3, 3, device="cuda") / (256 * 27) ** 0.5).bfloat16()
    packed = fp8_conv.pack_weight(weight)
    got = fp8_conv.fp8_conv(x, packed, (1, 1), fp8_conv.Tiling.parse(tiling))
    expected = fp8_conv.reference(x, packed, (1, 1))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


def test_benches_refuse_bad_options_before_needing_a_gpu():
    """``bench fp8-conv`` names a bad tiling and ``--profile`` without ``--decode``; ``bench k6sr``
    names ``--default-too`` without an opt-in to compare and an unknown ``--quantize``."""
    from typer.testing import CliRunner

    from tilecast.launcher import cli

    runner = CliRunner()
    for args, message in (
        (["fp8-conv", "--tiling", "128x96k128w8s3"], "bn must be a power of two"),
        (["fp8-conv", "--profile", "p"], "--profile profiles the whole-tile decodes"),
        (["k6sr", "--default-too", "--peer", "none"], "--default-too compares tilecast's defaults with an opt-in"),
        (["k6sr", "--quantize", "int4", "--peer", "none"], "--quantize must be one of fp8, got 'int4'"),
    ):
        result = runner.invoke(cli.app, ["bench", *args])
        assert result.exit_code != 0 and message in " ".join(result.output.replace("│", " ").split()), result.output
