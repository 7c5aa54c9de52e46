"""``kernels/narrow_conv.py``: the K-VAE's few-output-channel convolutions as a Triton implicit GEMM.

Against ``F.conv3d`` (cuDNN on the GPU): float32 within 1e-5 of the output's scale, on the GPU or
in Triton's interpreter on the CPU (``tests/conftest.py``; the interpreter's bf16 dot is wrong:
``tests/test_triton_kernels.py``); bf16 on the GPU at most 0.5 dB below
cuDNN's bf16 PSNR against a float32 convolution without TF32. Shapes cover patches cut by the
frame's edges, runs of ``3 C_in`` values that do not fill a reduction block, and 3, 5 and 16 output
channels, and the reuse kernel (one load for the three column taps). Compiled ahead of time for
sm_90, both kernels are pipelined warp-group-MMA loops. Bad tilings and inputs are refused naming
the problem, the benchmark refuses to run
without a GPU, and its space-to-depth candidate's coarse kernel computes the fine convolution
(float64, 1e-12).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.harness import hopper_codegen
from tilecast.kernels.narrow_conv import (
    Tiling,
    default_tiling,
    exact,
    pack_weight,
    reference,
    reuse_tiling,
    triton_conv,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")


def _inputs(in_channels, out_channels, shape, dtype=torch.float32, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(*shape, in_channels, device=DEVICE, generator=gen)
    weight = torch.randn(out_channels, in_channels, 3, 3, 3, device=DEVICE, generator=gen) / (27 * in_channels) ** 0.5
    return x.to(dtype), weight.to(dtype)


@needs_triton
@pytest.mark.parametrize(
    "in_channels, out_channels, shape, tiling",
    [
        (16, 16, (2, 4, 5, 70), None),  # two batches, a patch row cut at 70 columns
        (256, 16, (1, 3, 9, 13), None),
        (16, 3, (1, 3, 4, 66), None),
        (24, 5, (1, 3, 3, 5), "4x16k32w4s2"),  # blocks straddle taps: 72 values in three blocks of 32, padded
        (16, 16, (2, 4, 5, 70), "1x32k16w4s3r"),  # reuse: 30 outputs per program, the last one cut
        (256, 16, (1, 3, 4, 13), "1x16k64w4s2r"),
        (16, 3, (1, 3, 3, 66), "1x64k16w4s3r"),
    ],
)
def test_narrow_conv_is_conv3d_in_float32(in_channels, out_channels, shape, tiling):
    x, weight = _inputs(in_channels, out_channels, shape)
    tiling = Tiling.parse(tiling) if tiling else default_tiling(in_channels)
    got = triton_conv(x, pack_weight(weight, tiling.bk), (1, 1), tiling)
    expected = exact(x, weight, (1, 1))
    assert got.shape == expected.shape == (shape[0], shape[1] - 2, *shape[2:], out_channels)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * expected.abs().max().item())


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="bf16 tensor cores: a CUDA GPU")
@pytest.mark.parametrize("reuse", [False, True])
@pytest.mark.parametrize("in_channels, out_channels", [(256, 16), (16, 16), (16, 3)])
def test_narrow_conv_in_bf16_as_close_to_float32_as_cudnn(in_channels, out_channels, reuse):
    from tilecast.launcher.bench.report import psnr_db

    x, weight = _inputs(in_channels, out_channels, (1, 6, 40, 96), dtype=torch.bfloat16)
    expected = exact(x, weight, (1, 1))
    tiling = reuse_tiling(in_channels) if reuse else None
    ours = psnr_db(triton_conv(x, pack_weight(weight, default_tiling(in_channels).bk), (1, 1), tiling), expected)
    cudnn = psnr_db(reference(x, weight.contiguous(memory_format=torch.channels_last_3d), (1, 1)), expected)
    print(f"narrow conv {in_channels}->{out_channels} bf16 PSNR vs fp32: triton {ours:.2f} dB, cuDNN {cudnn:.2f} dB")
    assert ours >= cudnn - 0.5


@pytest.mark.parametrize(
    "text, message",
    [
        ("2x64", "BHxBWkBKwWARPSsSTAGES"),
        ("3x64k64w4s3", "bh must be a power of two"),
        ("1x8k64w4s3", "at least 16 pixels"),
        ("2x64k8w4s3", "BK at least 16"),
        ("2x64k64w4s3r", "reuse .* one row per program"),
    ],
)
def test_bad_tilings_are_refused_naming_the_problem(text, message):
    with pytest.raises(ValueError, match=message):
        Tiling.parse(text)
    assert str(Tiling.parse("2x64k64w4s3")) == "2x64k64w4s3" and str(Tiling.parse("1x128k64w4s3r")) == "1x128k64w4s3r"


def test_bad_inputs_are_refused_naming_the_problem():
    x, weight = _inputs(16, 16, (1, 3, 4, 8))
    packed = pack_weight(weight, 16)
    with pytest.raises(ValueError, match="the input has 24 channels, the weight takes 16"):
        triton_conv(torch.zeros(1, 3, 4, 8, 24, device=DEVICE), packed, (1, 1))
    with pytest.raises(ValueError, match="packed for BK 16, the tiling has 64"):
        triton_conv(x, packed, (1, 1), Tiling(bk=64))
    with pytest.raises(ValueError, match="channel rows must be contiguous"):
        triton_conv(x.transpose(3, 2).contiguous().transpose(3, 2), packed, (1, 1))
    with pytest.raises(ValueError, match="only 'same' spatial padding"):
        triton_conv(x, packed, (0, 0))
    wide = pack_weight(torch.zeros(16, 24, 3, 3, 3, device=DEVICE), 16)
    with pytest.raises(ValueError, match="reuse .* BK dividing the 24 channels"):
        triton_conv(torch.zeros(1, 3, 4, 8, 24, device=DEVICE), wide, (1, 1), Tiling(bh=1, bw=64, bk=16, reuse=True))


def test_bench_refuses_a_bad_tiling_and_profile_without_decode(tmp_path):
    from tilecast.launcher.bench.narrow_conv import bench_narrow_conv

    with pytest.raises(ValueError, match="BHxBWkBKwWARPSsSTAGES"):
        bench_narrow_conv(["fast"])
    with pytest.raises(ValueError, match="pass --decode with it"):
        bench_narrow_conv([], profile_dir=tmp_path)


@pytest.mark.skipif(CUDA, reason="checks the refusal where no GPU is")
def test_bench_refuses_without_a_gpu():
    from tilecast.launcher.bench.narrow_conv import bench_narrow_conv

    with pytest.raises(ValueError, match="narrow-conv needs a CUDA GPU"):
        bench_narrow_conv(["2x64k64w4s3"])


def test_space_to_depth_kernel_convolves_the_coarse_grid_as_the_fine_one():
    """``bench narrow-conv``'s cudnn-s2d candidate computes the fine convolution (float64)."""
    from tilecast.launcher.bench.narrow_conv import depth_to_space, space_to_depth, space_to_depth_weight

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 6, 8, 5, generator=gen, dtype=torch.float64)
    weight = torch.randn(7, 5, 3, 3, 3, generator=gen, dtype=torch.float64)
    fine = reference(x, weight, (1, 1))
    coarse = reference(space_to_depth(x), space_to_depth_weight(weight), (1, 1))
    torch.testing.assert_close(depth_to_space(coarse), fine, rtol=1e-12, atol=1e-12)
    assert torch.equal(depth_to_space(space_to_depth(x)), x)


@needs_triton
def test_kernel_compiles_for_hopper_as_a_pipelined_wgmma_loop():
    """At the decoder's layers (256 and 16 input channels; default and reuse tilings): Hopper's warp-group MMA,
    the input loads as asynchronous copies the pipeliner runs ahead of the products, and products
    left in flight while the next step's loads go out (what makes the kernels worth measuring; in
    SASS: 16-byte cp.async loads and HGMMA, 1 group in flight for the plain kernel, 3 for reuse). Compiled ahead of time for sm_90 (Triton ships ptxas: no GPU
    needed), in a process of its own (``harness.hopper_codegen``)."""
    ops = hopper_codegen()
    assert len(ops) == 4, ops  # 256 and 16 channels, the default and a reuse tiling each
    for counts in ops.values():
        assert counts["warp_group_dot"] > 0 and counts["async_copy_global_to_local"] > 0, ops
        assert counts["in_flight"] >= 1, ops  # the loop waits for the products of earlier steps only


def test_exact_reference_in_frame_chunks_is_conv3d():
    """``exact`` convolves a few output frames per call (a whole segment would not fit cuDNN). The
    whole convolution in float32 too: cuDNN rounds float32 inputs to TF32 unless told not to."""
    x, weight = _inputs(8, 4, (2, 7, 5, 6))
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        whole = reference(x, weight, (1, 1))
    for frames_per_call in (1, 2, 5):
        torch.testing.assert_close(exact(x, weight, (1, 1), frames_per_call), whole, rtol=1e-5, atol=1e-5)
