"""A linear layer with its tanh GELU in one call (``kernels.gelu_linear``) and FLUX's use of it.

On the CPU the layer is PyTorch's two operations, so it equals diffusers' layer bit for bit, and
FLUX's fast paths put it exactly where a tanh GELU follows a plain linear layer (not on FP8 layers,
not with LoRA). On CUDA it is cuBLASLt's bias-and-GELU epilogue (``torch._addmm_activation``): within
one output rounding plus 1e-5 of the output's scale of the float32 computation (the epilogue rounds
once, PyTorch's pair twice), also compiled. That Inductor keeps the call (a fallback kernel, not
decomposed into a product and a GELU kernel) is checked in its generated code, on the CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.activations import GELU
from torch import nn

from tests.harness import make_context
from tilecast.kernels.fp8 import Fp8Linear
from tilecast.kernels.gelu_linear import GeluLinear
from tilecast.runtime.models.families import flux_fast
from tilecast.runtime.models.families.flux import FluxT2IPipeline


def _linear(dtype=torch.float32, device="cpu", features=(64, 96)) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(*features).to(device=device, dtype=dtype)


def test_the_layer_shares_the_linear_layers_parameters_and_computes_its_gelu_on_the_cpu():
    linear = _linear()
    layer = GeluLinear(linear)
    assert layer.weight is linear.weight and layer.bias is linear.bias
    x = torch.randn(2, 5, 64)
    assert torch.equal(layer(x), F.gelu(linear(x), approximate="tanh"))
    with pytest.raises(ValueError, match="bias"):
        GeluLinear(nn.Linear(4, 4, bias=False))


def test_inductor_keeps_the_epilogue_call_instead_of_decomposing_it():
    from torch._inductor.utils import run_and_get_code

    linear = _linear()

    def product(x):
        return torch._addmm_activation(linear.bias, x, linear.weight.t(), use_gelu=True)

    with torch.inference_mode():
        _, code = run_and_get_code(torch.compile(product, fullgraph=True), torch.randn(4, 64))
    assert "aten._addmm_activation" in "\n".join(code)


def test_flux_fuses_every_tanh_gelu_after_a_plain_linear_layer_and_nothing_else(tiny_cache, tmp_path):
    family = FluxT2IPipeline.load("tiny/flux", make_context(tmp_path, dtype="float32"))
    transformer = family.pipe.transformer
    fused = [name for name, module in transformer.named_modules() if isinstance(module, GeluLinear)]
    assert fused == [
        "transformer_blocks.0.ff.net.0",
        "transformer_blocks.0.ff_context.net.0",
        "single_transformer_blocks.0.proj_mlp",
    ]
    assert isinstance(transformer.single_transformer_blocks[0].act_mlp, nn.Identity)
    assert not any(isinstance(module, (GELU, nn.GELU)) for module in transformer.modules())


def test_flux_leaves_fp8_and_lora_layers_unfused():
    diffusers_pipe = FluxT2IPipeline.build_diffusers("tiny/flux", torch.device("cpu"), torch.float32)
    flux_fast.quantize_blocks(diffusers_pipe.transformer)
    assert flux_fast.fuse_gelus(diffusers_pipe.transformer) == 0
    assert isinstance(diffusers_pipe.transformer.single_transformer_blocks[0].proj_mlp, Fp8Linear)

    unfused = FluxT2IPipeline.build_diffusers("tiny/flux", torch.device("cpu"), torch.float32)
    flux_fast.install_fast_paths(unfused.transformer, fuse=False)
    assert not any(isinstance(module, GeluLinear) for module in unfused.transformer.modules())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_runs_the_cublaslt_epilogue_within_one_rounding(dtype, compiled, monkeypatch):
    linear = _linear(dtype, "cuda", features=(256, 512))
    layer = GeluLinear(linear)
    calls = []
    epilogue = torch._addmm_activation
    monkeypatch.setattr(torch, "_addmm_activation", lambda *a, **kw: (calls.append(kw), epilogue(*a, **kw))[1])
    run = torch.compile(layer, fullgraph=True) if compiled else layer
    x = torch.randn(3, 128, 256, device="cuda", dtype=dtype)
    with torch.inference_mode():
        ours = run(x).float()
    assert calls and all(call["use_gelu"] for call in calls), "the epilogue did not run"
    exact = F.gelu(F.linear(x.float(), linear.weight.float(), linear.bias.float()), approximate="tanh")
    rounding = torch.finfo(dtype).eps * exact.abs()
    assert ((ours - exact).abs() <= rounding + 1e-5 * exact.abs().max()).all()
