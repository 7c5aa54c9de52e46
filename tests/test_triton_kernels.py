"""tilecast's Triton kernels against their PyTorch references, on the GPU or, without one, in
Triton's interpreter on the CPU (``tests/conftest.py`` sets ``TRITON_INTERPRET``); skipped where
Triton is not installed.

The interpreter runs each program in NumPy: the indexing, masks, tiling and float32 arithmetic are
the kernel's, but it converts float32 to bfloat16 (and e4m3) by truncation where the GPU rounds to
nearest, and its ``tl.dot`` of two bfloat16 blocks is wrong (Triton 3.9: 2.6e10 off on a 16x16
product of N(0, 1) values; float16 and int8 are right).
So the kernel that only moves data (the frame repeat) is checked in bf16 everywhere, the ones
that compute are checked in float32 everywhere and in bf16 on the GPU.

Tolerances:
- frame repeat, phase interleave, bias (+ residual) add, PiFlow step: bit-exact to PyTorch;
- spatial norm + modulation + SiLU: float32 within 1e-5 of the PyTorch composition; bf16 allclose
  (2e-2), and its mean error against the float64 result at most 1.1x the composition's (on an H200
  about 7% of bf16 values sat one bf16 step from the composition's, the decode's PSNR against
  diffusers unchanged: 56.9 dB eager and fused);
- the same kernel writing e4m3: ``fp8.to_e4m3`` of its own bf16/float32 result, bit-exact in the
  interpreter, on the GPU but for rare ties (it multiplies by the inverse scale there).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.harness import hopper_codegen

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")

ON_GPU = pytest.mark.skipif(not CUDA, reason="bf16 arithmetic: the interpreter truncates where the GPU rounds")
ARITHMETIC_DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=[pytest.mark.cuda, ON_GPU])]


@pytest.mark.parametrize(
    "shape, rt, drop", [((1, 5, 6, 8, 128), 2, 1), ((2, 4, 3, 5, 24), 2, 0), ((1, 1, 4, 4, 1024), 3, 0)]
)
def test_triton_frame_repeat_is_the_reference_copy(shape, rt, drop):
    from tilecast.kernels.upsample import reference, triton_repeat

    x = torch.randn(*shape, device=DEVICE, dtype=torch.bfloat16)
    expected = reference(x, rt, drop)
    assert torch.equal(triton_repeat(x, rt, drop), expected)
    out = torch.zeros(shape[0], expected.shape[1] + 2, *expected.shape[2:], device=DEVICE, dtype=torch.bfloat16)
    triton_repeat(x, rt, drop, out=out[:, 2:])  # a slice (contiguous only for batch 1)
    assert torch.equal(out[:, 2:], expected) and not out[:, :2].any()


@pytest.mark.parametrize("dtype", ARITHMETIC_DTYPES)
@pytest.mark.parametrize(
    "shape", [(1, 2, 5, 7, 4 * 256), (2, 3, 2, 2, 4 * 24), (1, 1, 9, 4, 4 * 2048), (1, 1, 2, 10, 4 * 256)]
)
def test_triton_phase_interleave_is_the_reference(shape, dtype):
    from tilecast.kernels.upsample import phases_reference, triton_phases

    torch.manual_seed(shape[-1])
    y = torch.randn(*shape, device=DEVICE, dtype=dtype) * 4
    bias = torch.randn(shape[-1] // 4, device=DEVICE, dtype=dtype)
    assert torch.equal(triton_phases(y, bias), phases_reference(y, bias))


@pytest.mark.parametrize("dtype", ARITHMETIC_DTYPES)
@pytest.mark.parametrize("channels", [16, 256, 24, 2048])
@pytest.mark.parametrize("with_residual", [False, True])
def test_triton_bias_add_is_pytorchs_two_adds(channels, with_residual, dtype):
    from tilecast.kernels.channel_bias import reference_, triton_

    torch.manual_seed(channels)
    y = torch.randn(1, 3, 5, 7, channels, device=DEVICE, dtype=dtype) * 4
    bias = torch.randn(channels, device=DEVICE, dtype=dtype)
    residual = torch.randn_like(y) if with_residual else None
    assert torch.equal(triton_(y.clone(), bias, residual), reference_(y.clone(), bias, residual))


@pytest.mark.parametrize("dtype", ARITHMETIC_DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("channels, rh, rw", [(16, 16, 16), (256, 8, 8), (512, 4, 4), (2048, 1, 1), (24, 2, 4)])
def test_fused_spatial_norm_matches_pytorch(channels, rh, rw, with_bias, dtype):
    from tilecast.kernels.spatial_norm import reference, triton_fused

    torch.manual_seed(channels)
    frames, rows, cols = (3, 4, 6) if CUDA else (1, 2, 3)  # the interpreter: one program at a time
    h = torch.randn(2, frames, rows * rh, cols * rw, channels, device=DEVICE, dtype=dtype) * 3
    y = torch.randn(2, frames, rows, cols, channels, device=DEVICE, dtype=dtype)
    b = torch.randn(2, frames, rows, cols, channels, device=DEVICE, dtype=dtype)
    gamma = (torch.rand(channels, device=DEVICE) + 0.5).to(dtype)
    h_bias = torch.randn(channels, device=DEVICE, dtype=dtype) if with_bias else None
    args = (channels**0.5, gamma, y, b, rh, rw)
    exact = reference(
        h.double(),
        channels**0.5,
        gamma.double(),
        y.double(),
        b.double(),
        rh,
        rw,
        h_bias_C=None if h_bias is None else h_bias.double(),
    )
    expected = reference(h, *args, h_bias_C=h_bias).double()
    got = triton_fused(h, *args, h_bias_C=h_bias).double()
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        return
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
    # As close to the unrounded (float64) result as the PyTorch composition is.
    ours, pytorch = (got - exact).abs().mean().item(), (expected - exact).abs().mean().item()
    assert ours <= 1.1 * pytorch, (ours, pytorch)


@pytest.mark.parametrize("dtype", ARITHMETIC_DTYPES)
@pytest.mark.parametrize("channels, rh, rw, padding", [(32, 2, 2, (1, 1)), (64, 1, 1, (1, 2)), (24, 2, 4, (0, 0))])
def test_spatial_norm_in_e4m3_is_the_rounded_norm_with_zero_padding(channels, rh, rw, padding, dtype):
    """``norm_modulate_silu_e4m3``'s kernel writes ``fp8.to_e4m3`` of the bf16/float32 kernel's result
    inside the padded grid (exactly in the interpreter, whose float32 rounding reproduces PyTorch's,
    subnormals and exponent carries included; on the GPU but for rare ties) and zeros around it, batches apart included; ``e4m3_scale`` bounds
    it without saturating, even for an ``h`` with all its energy in one channel; the PyTorch
    reference writes the same layout."""
    from tilecast.kernels import spatial_norm
    from tilecast.kernels.fp8 import to_e4m3

    torch.manual_seed(channels)
    batch, frames, rows, cols = 2, 2, 2, 3
    h = torch.randn(batch, frames, rows * rh, cols * rw, channels, device=DEVICE, dtype=dtype) * 3
    h[0, 0, 0, 0] = 0.0
    h[0, 0, 0, 0, 1] = 5.0  # one channel holds the pixel: the bound's worst case
    y = torch.randn(batch, frames, rows, cols, channels, device=DEVICE, dtype=dtype)
    b = torch.randn(batch, frames, rows, cols, channels, device=DEVICE, dtype=dtype)
    gamma = (torch.rand(channels, device=DEVICE) + 0.5).to(dtype)
    h_bias = torch.randn(channels, device=DEVICE, dtype=dtype)
    args = (channels**0.5, gamma, y, b, rh, rw)
    scale = spatial_norm.e4m3_scale(channels**0.5, gamma, y, b)
    ph, pw = padding
    buffer = torch.full((batch, frames + 1, rows * rh + 2 * ph, cols * rw + 2 * pw, channels), 7.0, device=DEVICE).to(
        torch.float8_e4m3fn
    )
    got = spatial_norm.triton_e4m3(h, *args, buffer[:, 1:], scale, padding, h_bias).float()  # batches apart
    result = spatial_norm.triton_fused(h, *args, h_bias_C=h_bias)
    inside = got[:, :, ph : got.shape[2] - ph, pw : got.shape[3] - pw]
    expected = to_e4m3(result, scale).float()
    if CUDA:  # times the inverse scale there: a rare tie may round the other way, one e4m3 step
        step = torch.maximum(expected.abs().clamp(min=2**-6) * 2**-3, torch.full_like(expected, 2**-9))
        assert ((inside - expected).abs() <= step).all() and (inside != expected).float().mean() < 1e-3
    else:
        assert torch.equal(inside, expected)
    assert got.abs().sum() == inside.abs().sum()  # the padding is zeros
    assert torch.equal(buffer[:, 0].float(), torch.full_like(buffer[:, 0].float(), 7.0))  # nothing else written
    assert (result.float().abs() / scale).max() < 448
    reference = spatial_norm.e4m3_reference(h, *args, torch.empty_like(buffer[:, 1:]), scale, padding, h_bias)
    rounded = to_e4m3(spatial_norm.reference(h, *args, h_bias_C=h_bias), scale).float()
    assert torch.equal(reference.float()[:, :, ph : got.shape[2] - ph, pw : got.shape[3] - pw], rounded)
    assert reference.float().abs().sum() == rounded.abs().sum()


@pytest.mark.parametrize("dtype", ARITHMETIC_DTYPES)
@pytest.mark.parametrize(
    "num_steps, config, shape",
    [
        pytest.param(2, {}, (1, 31, 32, 48, 64), marks=pytest.mark.skipif(not CUDA, reason="a large tile: GPU only")),
        (4, {"shift": 3.0, "n_grid": 6, "num_policy_substeps": 40}, (2, 3, 5, 7, 24)),
    ],
)
def test_triton_piflow_step_is_diffusers_step(dtype, num_steps, config, shape):
    from diffusers import PiflowScheduler

    from tilecast.kernels import piflow
    from tilecast.runtime.models.k6sr.stages import piflow_schedule

    scheduler = PiflowScheduler(**config)
    scheduler.set_timesteps(num_steps, device=DEVICE)
    schedule = piflow_schedule(scheduler, num_steps)
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    for index, timestep in enumerate(scheduler.timesteps):
        sample = torch.randn(shape, generator=generator, device=DEVICE).to(dtype)
        output = torch.randn((*shape[:-1], shape[-1] * scheduler.n_grid), generator=generator, device=DEVICE).to(dtype)
        expected = scheduler.step(output, timestep, sample, return_dict=False)[0]
        got = piflow.triton_rollout(sample, output, schedule[index])
        assert torch.equal(got, expected), f"step {index}: max diff {(got.float() - expected.float()).abs().max()}"


def test_memory_bound_kernels_compile_without_per_pixel_division():
    """The decoder's memory-bound kernels (spatial norm in bf16 and e4m3, phase interleave, frame
    repeat, bias add), compiled for sm_90 SASS ahead of time (no GPU needed: Triton ships ptxas and
    nvdisasm), call no subroutine and stay within an instruction budget per value. Where a pixel's
    row, frame and source came from 64-bit divisions per pixel, each compiled to calls (10-13 per
    kernel) and the interleave and repeat took 22-25 instructions per value, the norm 53-57 before
    its calls' own; with the divisions gone and before the norm's bf16 operations ran packed, the
    e4m3 norm took 49.5 at 2048 channels (``python tests/hopper_codegen.py rows`` prints the
    counts). In a process of its own, without ``TRITON_INTERPRET`` (``harness.hopper_codegen``)."""
    counts = hopper_codegen("rows")
    budget = {"norm": 40, "norm_e4m3": 45, "interleave": 10, "repeat": 6, "add_bias": 8}
    assert len(counts) == 3 * len(budget), counts  # 16, 256 and 2048 channels
    for key, count in counts.items():
        assert count["calls"] == 0, (key, count)
        assert count["per_value"] <= budget[key.split()[0]], (key, count)


@pytest.mark.skipif(CUDA, reason="Triton's interpreter")
def test_interpreter_spelled_true_is_the_interpreter_to_the_kernels(monkeypatch):
    """Triton takes ``TRITON_INTERPRET=true`` (or ``on``) as its interpreter, and so do the kernels that
    round to e4m3 themselves there (``e4m3_triton.interpreted``): they would write the interpreter's
    carry-less conversion otherwise."""
    from tilecast.kernels.e4m3_triton import interpreted

    monkeypatch.setenv("TRITON_INTERPRET", "true")
    assert interpreted()
    test_spatial_norm_in_e4m3_is_the_rounded_norm_with_zero_padding(32, 2, 2, (1, 1), torch.float32)


def test_every_triton_launch_states_fp_fusion():
    """Every Triton launch in ``kernels/`` says whether multiplies and adds may fuse (FMA): the kernels'
    speed and tolerances were measured with fusion on (``piflow``, bit-exact to PyTorch's step: off),
    and Triton's default for it is changing (3.10: off unless ``TRITON_DEFAULT_FP_FUSION=1``)."""
    import ast

    launches = []
    for path in sorted((Path(__file__).parents[1] / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                if any(keyword.arg in ("num_warps", "BLOCK", "BLOCK_C", "BLOCK_M") for keyword in node.keywords):
                    launches.append((path.name, node.lineno, {keyword.arg for keyword in node.keywords}))
    assert len(launches) >= 11, launches
    assert [(name, line) for name, line, keywords in launches if "enable_fp_fusion" not in keywords] == []
