"""FP8 linear layers (``kernels.fp8``) and FLUX's ``--quantize fp8``, on CPU.

``torch._scaled_mm`` has a CPU implementation, so the layer's arithmetic is checked here exactly:
its output equals the float32 product of the dequantized operands (within float32 summation order,
1e-5 of the output's scale). Against the unquantized layer it is within 6% (relative Frobenius
norm; e4m3 keeps 3 mantissa bits: measured 3.6% on Gaussian data). On tiny/flux one step with the
FP8 blocks has a PSNR of at least 45 dB against the float32 step (measured 60 dB), and differs from
it, so the FP8 layers really ran.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from torch import nn

from tests.harness import cli_flags, flux_step_bench
from tilecast.kernels import fp8
from tilecast.kernels.fp8 import E4M3_MAX, Fp8Linear, quantize_linears, quantize_rows
from tilecast.runtime.config import ServeConfig
from tilecast.runtime.models.families.modulation import BankedLinear


def needs_cpu_fp8(dtype: torch.dtype = torch.float32):
    """Skip where this PyTorch has no CPU ``_scaled_mm`` with row scales into ``dtype`` (then
    ``--quantize fp8`` on the CPU is refused naming it: the last test here)."""
    error = fp8.cpu_scaled_mm_error(dtype)
    return pytest.mark.skipif(error is not None, reason=f"torch {torch.__version__}: no CPU _scaled_mm ({error})")


def test_rows_map_their_largest_magnitude_onto_e4m3s_and_zero_rows_stay_zero():
    x = torch.tensor([[1.0, -3.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0], [1e-3, 2e-3, -4e-3, 0.0]])
    q, scale = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 1)
    assert q.float().abs().amax(dim=1).tolist() == [E4M3_MAX, 0.0, E4M3_MAX]
    assert not q[1].float().any() and torch.isfinite(scale).all()
    assert torch.allclose(q.float() * scale, x, rtol=2**-3, atol=0)


@pytest.mark.parametrize(
    "dtype", [pytest.param(dtype, marks=needs_cpu_fp8(dtype)) for dtype in (torch.float32, torch.bfloat16)]
)
@pytest.mark.parametrize("bias", [True, False])
def test_fp8_linear_is_the_dequantized_product_and_close_to_the_layer(dtype, bias):
    torch.manual_seed(0)
    linear = nn.Linear(256, 512, bias=bias).to(dtype)
    x = torch.randn(3, 40, 256, dtype=dtype)
    layer = Fp8Linear(linear)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (3, 40, 512)
    exact = layer.reference(x)
    rounding = 1e-5 if dtype == torch.float32 else 2**-8  # the output's own dtype
    assert (y.float() - exact).abs().max() <= rounding * exact.abs().max()
    reference = linear(x).float()
    assert (y.float() - reference).norm() / reference.norm() <= 0.06


@needs_cpu_fp8()
def test_quantize_linears_replaces_aligned_layers_except_the_kept_ones():
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 10)))
    model.add_module("keep_me", nn.Linear(16, 16))
    assert quantize_linears(model, keep=lambda name: name == "keep_me") == 2
    assert isinstance(model[0], Fp8Linear) and isinstance(model[2][0], Fp8Linear)
    assert type(model[2][1]) is nn.Linear  # 10 outputs: not a multiple of 16
    assert type(model.keep_me) is nn.Linear
    assert not any(p.dtype == torch.float32 and p.dim() == 2 for p in model[0].parameters())  # weight released
    assert model[:3](torch.randn(5, 32)).shape == (5, 10)


def test_fp8_linear_refuses_unaligned_layers():
    with pytest.raises(ValueError, match="multiples of 16"):
        Fp8Linear(nn.Linear(24, 32))


def test_fp8_needs_fp8_tensor_cores_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"compute capability >= 8.9\); NVIDIA A100 is 8.0"):
        fp8.check_supported(torch.device("cuda"))
    cpu_error = fp8.cpu_scaled_mm_error(torch.float32)
    if cpu_error is None:
        fp8.check_supported(torch.device("cpu"))
    else:  # some builds have no CPU row-scaled _scaled_mm (torch 2.11 cu130): refused, naming why
        with pytest.raises(ValueError, match="needs PyTorch's CPU torch._scaled_mm"):
            fp8.check_supported(torch.device("cpu"))


# ------------------------------------------------------------------------------------ FLUX
def _flux_step(quantize: str | None) -> tuple[torch.Tensor, object]:
    from tilecast.launcher.bench.step import step_inputs
    from tilecast.runtime.models.families.flux import FluxT2IPipeline

    pipe = FluxT2IPipeline.build_diffusers("tiny/flux", torch.device("cpu"), torch.float32)
    FluxT2IPipeline.install_fast_paths(pipe, ServeConfig(device="cpu", dtype="float32", quantize=quantize))
    with torch.inference_mode():
        inputs = step_inputs(pipe, 2, width=64, height=48, max_sequence_length=FluxT2IPipeline.max_sequence_length)
        return pipe.transformer(**inputs)[0], pipe.transformer


@needs_cpu_fp8()
def test_flux_fp8_quantizes_the_block_projections_and_keeps_the_step_close(tiny_cache):
    from tilecast.launcher.bench.report import psnr_db

    reference, _ = _flux_step(None)
    out, transformer = _flux_step("fp8")
    quantized = sorted(name for name, m in transformer.named_modules() if isinstance(m, Fp8Linear))
    assert quantized == sorted(
        [
            *(
                f"transformer_blocks.0.{n}"
                for n in (
                    "attn.to_qkv",
                    "attn.to_added_qkv",
                    "attn.to_out.0",
                    "attn.to_add_out",
                    "ff.net.0.proj",
                    "ff.net.2",
                    "ff_context.net.0.proj",
                    "ff_context.net.2",
                )
            ),
            *(f"single_transformer_blocks.0.{n}" for n in ("attn.to_qkv", "proj_mlp", "proj_out")),
        ]
    )
    kept = {name for name, m in transformer.named_modules() if type(m) is nn.Linear}
    assert {"x_embedder", "proj_out"} <= kept
    banked = {name for name, m in transformer.named_modules() if isinstance(m, BankedLinear)}
    assert {  # the modulation layers: one product in the model's dtype (families.modulation)
        "transformer_blocks.0.norm1.linear",
        "transformer_blocks.0.norm1_context.linear",
        "single_transformer_blocks.0.norm.linear",
    } <= banked
    assert transformer.modulation_bank.weight.dtype == reference.dtype
    assert not torch.equal(out, reference)
    assert psnr_db(out.float(), reference.float()) >= 45.0


def test_flux_refuses_an_unknown_quantize_mode_at_load(tiny_cache):
    with pytest.raises(ValueError, match="--quantize must be one of fp8, got 'int4'"):
        _flux_step("int4")


def test_serve_refuses_an_unknown_quantize_mode_naming_it():
    from typer.testing import CliRunner

    from tilecast.launcher.cli import app

    result = CliRunner().invoke(app, ["serve", "--device", "cpu", "--quantize", "int4"])
    assert result.exit_code == 2 and "--quantize must be one of fp8, got 'int4'" in " ".join(result.output.split())


@needs_cpu_fp8()
def test_k6sr_fp8_quantizes_the_block_projections_and_feed_forward_and_stays_close():
    """K6 SR's ``--quantize fp8``: every block's query/key/value/output projections and feed forward
    become ``Fp8Linear``, the modulation, embeddings and output layer stay; the DiT's output stays
    near the unquantized one (tiny checkpoint's transformer, float32 on the CPU)."""
    from tests.test_dit_parallel import _tiny_dit
    from tilecast.launcher.bench.report import psnr_db
    from tilecast.runtime.models.k6sr.quantize import quantize_blocks

    model, hidden_states, timestep = _tiny_dit()
    with torch.no_grad():
        reference = model(hidden_states, timestep).sample
        assert quantize_blocks(model) == 2 * 6
        out = model(hidden_states, timestep).sample
    quantized = {name for name, m in model.named_modules() if isinstance(m, Fp8Linear)}
    layers = ("to_query", "to_key", "to_value", "out_layer")
    assert quantized == {
        f"visual_transformer_blocks.{i}.{n}"
        for i in range(2)
        for n in (*(f"self_attention.{layer}" for layer in layers), "feed_forward.net.0.proj", "feed_forward.net.2")
    }
    kept = {name for name, m in model.named_modules() if type(m) is nn.Linear}
    assert {"visual_transformer_blocks.0.visual_modulation.out_layer", "out_layer.out_layer"} <= kept
    assert not torch.equal(out, reference)
    assert psnr_db(out, reference) >= 35.0


def test_k6sr_fp8_is_refused_where_it_cannot_be_honoured(tmp_path, monkeypatch):
    """At load, before any weight: no FP8 tensor cores, or a setting that rewrites the same layers."""
    from tests.harness import make_context
    from tilecast.kernels import fp8 as fp8_module
    from tilecast.runtime.models.k6sr.pipeline import K6SRPipeline

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "A100")
    ctx = make_context(tmp_path, device="cuda", dtype="bfloat16", quantize="fp8", cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"compute capability >= 8.9.*A100 is 8.0"):
        K6SRPipeline.load("tiny/k6sr", ctx)
    monkeypatch.setattr(fp8_module, "check_supported", lambda *args: None)
    for fields, named in (
        ({"tp_size": 2, "num_gpus": 2}, "--tp-size"),
        ({"cpu_offload_components": "transformer"}, "an offloaded transformer"),
    ):
        ctx = make_context(tmp_path, dtype="float32", quantize="fp8", cache_dir=tmp_path, **fields)
        with pytest.raises(ValueError, match=rf"--quantize fp8 replaces K6 SR's DiT linear layers, which {named}"):
            K6SRPipeline.load("tiny/k6sr", ctx)
    assert not (tmp_path / "models").exists()


@needs_cpu_fp8()
def test_bench_step_reports_the_fp8_difference(tiny_cache):
    (row,) = flux_step_bench(width=32, height=32, batch_sizes=[2], quantize="fp8", iters=1)
    assert 0 < row["max_rel_diff"] <= 0.05 and 45.0 <= row["psnr_db"] < float("inf")


@needs_cpu_fp8()
def test_generate_passes_quantize_to_the_flux_pipeline(tiny_cache, tmp_path):
    """The real CLI in a process of its own (``generate`` blocks signals and configures logging in the
    process it runs in): the same seed gives a different image with ``--quantize fp8``, so the flag
    reached the pipeline."""
    images = {}
    for name, extra in (("plain", []), ("fp8", ["--quantize", "fp8"])):
        out = tmp_path / name
        args = cli_flags(
            model_path="tiny/flux", device="cpu", prompt="a red boat", width=32, height=32, output_path=out
        )
        command = [sys.executable, "-m", "tilecast", "generate", *args, *extra]
        done = subprocess.run(command, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stdout + done.stderr
        images[name] = (out / "flux_seed42.png").read_bytes()
    assert images["fp8"] != images["plain"]


def test_fp8_on_a_cpu_without_the_cpu_kernel_is_refused_naming_it(monkeypatch):
    """A PyTorch without the CPU ``_scaled_mm`` path: ``--quantize fp8`` on the CPU is refused at load,
    naming the torch version and its error, instead of failing inside the first request."""
    monkeypatch.setattr(fp8, "cpu_scaled_mm_error", lambda dtype=torch.float32: "no CPU kernel for rowwise")
    with pytest.raises(
        ValueError, match=re.escape(f"torch {torch.__version__} refuses for torch.float32: no CPU kernel")
    ):
        fp8.check_supported(torch.device("cpu"))
    with pytest.raises(ValueError, match=r"no CPU kernel for rowwise"):
        _flux_step("fp8")
