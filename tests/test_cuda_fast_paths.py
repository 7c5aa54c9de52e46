"""CUDA fast paths against their reference paths (skipped without a GPU). The Triton kernels on
their own: ``tests/test_triton_kernels.py``.

Tolerances, on the tiny checkpoint's float video in [-1, 1]:
- the default attention backend (cuDNN SDPA on Hopper) vs the math backend, fp32 model: max 5e-3
  (cuDNN kernels and TF32 convolutions reorder sums; measured on an H200: 1.16e-3);
- ``torch.compile`` of the DiT blocks vs eager, fp32: max 5e-3 (measured on an H200: 1.19e-3);
- the bf16 pipeline (channels-last VAE decode included) vs its fp32 run: PSNR at most 1 dB below
  what diffusers' own ``Kandinsky6SRPipeline`` gets in bf16 vs fp32 (random tiny weights amplify
  bf16 rounding, so the bound is the peer's, not an absolute number);
- the channels-last VAE decode on a mid-size K-VAE over three segments vs diffusers' decode: fp32
  max 5e-3 (cuDNN picks other kernels, TF32); bf16 PSNR against diffusers' fp32 decode at most 1 dB
  below diffusers' own bf16 decode;
- FLUX's fast paths (``families.flux_fast``: tilecast's attention kernel, fused projections,
  optionally compiled blocks) vs diffusers' transformer on one tiny/flux step: fp32 max difference
  at most 5e-3 of the output's scale; bf16 PSNR against diffusers' fp32 at most 1 dB below
  diffusers' own bf16;
- FLUX's VAE decoder compiled (``--compile``) vs eager, tiny/flux: fp32 within 5e-3 of the output's
  scale (Inductor's norms and cuDNN's TF32 convolutions; measured 2.2e-3 on an H200); bf16 PSNR
  against eager fp32 at most 1 dB below eager bf16's (measured 55.2 vs 52.5 dB);
- ``--quantize fp8`` on that step (cuBLAS FP8 GEMMs, eager and compiled): in an fp32 model, PSNR
  against diffusers' fp32 of at least 40 dB (on CPU the same FP8 arithmetic gives 60 dB); in a bf16
  model, PSNR against diffusers' fp32 at most 1 dB below the bf16 fast paths' (tiny random FLUX in
  bf16 is far from fp32 on the GPU: 9.5 dB, diffusers' own bf16 too); one FP8 layer equals the
  float32 product of its dequantized operands within bf16 rounding.
- ``--cuda-graphs`` (``runtime.cuda_graphs``) on FLUX, eager and compiled: a whole 4-step
  ``FluxPipeline`` call, two batch sizes, is bit-exact to the same call without graphs (a replay
  runs the kernels the capture recorded, on copies of the same inputs); a graph reading a loop's
  planned modulation (``flux_plan``) against the per-step product without graphs, fp32: within
  1e-4 of the latents' scale (one product of more rows sums in another order).
"""

from __future__ import annotations

import pytest
import torch

from tilecast.runtime.config import ServeConfig

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _parts(dtype, backend=None, compile_blocks=False, fast_decode=True):
    from tilecast.runtime.models.k6sr.attention import install_dense_attention
    from tilecast.runtime.models.k6sr.loading import load_components
    from tilecast.runtime.models.k6sr.tiny import ensure_tiny_k6sr

    parts = load_components(ensure_tiny_k6sr(), device=torch.device("cuda"), dtype=dtype)
    install_dense_attention(parts.transformer, backend=backend)
    if fast_decode:
        from tilecast.runtime.models.k6sr.vae_decode import ChannelsLastDecoder

        parts.decoder = ChannelsLastDecoder(parts.vae)
    if compile_blocks:
        parts.transformer.compile_repeated_blocks()
    return parts


def _upscale(parts):
    from tilecast.launcher.bench.k6sr import pattern_video
    from tilecast.runtime.models.k6sr.stages import SRSettings, frames_to_video, upscale_video

    video = frames_to_video(torch.from_numpy(pattern_video(128, 64, 9)), parts.device)
    with torch.no_grad():
        out, _ = upscale_video(parts, video, SRSettings(scale=2, seed=3))
    return out.float().cpu()


def test_default_attention_backend_matches_math():
    reference = _upscale(_parts(torch.float32, backend="sdpa_math"))
    assert (_upscale(_parts(torch.float32)) - reference).abs().max().item() <= 5e-3


def test_compiled_dit_matches_eager():
    eager = _upscale(_parts(torch.float32))
    assert (_upscale(_parts(torch.float32, compile_blocks=True)) - eager).abs().max().item() <= 5e-3


def _psnr(out, reference):
    """PSNR of two ``[-1, 1]`` videos."""
    mse = ((out.float() - reference.float()) ** 2).mean().item() / 4
    return 10 * torch.log10(torch.tensor(1.0 / mse)).item()


def _diffusers(dtype):
    from tilecast.launcher.bench.k6sr import DenseSDPAProcessor, pattern_video, run_diffusers, set_processors

    parts = _parts(dtype, fast_decode=False)
    set_processors(parts.transformer, DenseSDPAProcessor)
    with torch.no_grad():
        video_FCHW = run_diffusers(parts, pattern_video(128, 64, 9), seed=3)
    return (video_FCHW.float().cpu() * 2 - 1).permute(1, 0, 2, 3)[None]


def test_bf16_pipeline_as_close_to_fp32_as_diffusers_bf16():
    ours = _psnr(_upscale(_parts(torch.bfloat16)), _upscale(_parts(torch.float32)))
    peer = _psnr(_diffusers(torch.bfloat16), _diffusers(torch.float32))
    print(f"bf16 vs fp32 PSNR: tilecast {ours:.2f} dB, diffusers {peer:.2f} dB")
    assert ours >= peer - 1.0, (ours, peer)


def _mid_vae(dtype):
    from diffusers import Kandinsky6SRVAE

    torch.manual_seed(0)
    with torch.device("cuda"):
        vae = Kandinsky6SRVAE(
            latent_channels=64,
            encoder_block_out_channels=(16, 32, 64, 128, 128),
            decoder_block_out_channels=(16, 64, 128, 256, 256),
            layers_per_block=2,
        )
    return vae.eval().requires_grad_(False).to(dtype)


def test_channels_last_decode_matches_diffusers():
    from tilecast.runtime.models.k6sr.vae_decode import ChannelsLastDecoder

    z = torch.randn(1, 64, 11, 6, 8, device="cuda")
    with torch.no_grad():
        vae = _mid_vae(torch.float32)
        reference = vae.decode(z, return_dict=False)[0]
        vae_bf16 = _mid_vae(torch.bfloat16)
        diffusers_bf16 = vae_bf16.decode(z.bfloat16(), return_dict=False)[0]
        fast = ChannelsLastDecoder(vae).decode(z)
        fast_bf16 = ChannelsLastDecoder(vae_bf16).decode(z.bfloat16())
    assert (fast - reference).abs().max().item() <= 5e-3
    ours, peer = _psnr(fast_bf16, reference), _psnr(diffusers_bf16, reference)
    print(f"decode bf16 vs fp32 PSNR: tilecast {ours:.2f} dB, diffusers {peer:.2f} dB")
    assert ours >= peer - 1.0, (ours, peer)


def _flux_step(dtype, fast: bool, compile_blocks: bool = False, quantize: str | None = None):
    """One step of tiny/flux's transformer on the GPU, diffusers' own or with tilecast's fast paths."""
    from tilecast.launcher.bench.step import step_inputs
    from tilecast.runtime.models.families.flux import FluxT2IPipeline

    pipe = FluxT2IPipeline.build_diffusers("tiny/flux", torch.device("cuda"), dtype)
    if fast:
        FluxT2IPipeline.install_fast_paths(pipe, ServeConfig(compile=compile_blocks, quantize=quantize))
    with torch.inference_mode():
        inputs = step_inputs(pipe, 2, width=128, height=96, max_sequence_length=FluxT2IPipeline.max_sequence_length)
        return pipe.transformer(**inputs)[0].float().cpu()


@pytest.mark.parametrize("compile_blocks", [False, True])
def test_flux_fast_paths_match_diffusers(compile_blocks):
    """fp32: within 5e-3 relative to the output's scale; bf16 (cuDNN attention there): PSNR against
    diffusers' fp32 at most 1 dB below diffusers' own bf16."""
    from tilecast.launcher.bench.report import psnr_db

    reference = _flux_step(torch.float32, fast=False)
    ours = _flux_step(torch.float32, fast=True, compile_blocks=compile_blocks)
    assert ((ours - reference).abs().max() / reference.abs().max()).item() <= 5e-3

    fast_bf16 = psnr_db(_flux_step(torch.bfloat16, fast=True, compile_blocks=compile_blocks), reference)
    peer_bf16 = psnr_db(_flux_step(torch.bfloat16, fast=False), reference)
    print(f"FLUX step bf16 vs fp32 PSNR: tilecast {fast_bf16:.2f} dB, diffusers {peer_bf16:.2f} dB")
    assert fast_bf16 >= peer_bf16 - 1.0, (fast_bf16, peer_bf16)


def test_flux_compiled_vae_decoder_matches_eager():
    from tilecast.launcher.bench.report import psnr_db
    from tilecast.runtime.models.families.flux import FluxT2IPipeline

    def decode(dtype, compiled):
        pipe = FluxT2IPipeline.build_diffusers("tiny/flux", torch.device("cuda"), dtype)
        if compiled:
            FluxT2IPipeline.install_fast_paths(pipe, ServeConfig(compile=True))
        latents = torch.randn(2, 16, 32, 48, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        with torch.inference_mode():
            return pipe.vae.decode(latents.to(dtype), return_dict=False)[0].float()

    reference = decode(torch.float32, compiled=False)
    assert (decode(torch.float32, compiled=True) - reference).abs().max() <= 5e-3 * reference.abs().max()
    compiled_bf16 = psnr_db(decode(torch.bfloat16, compiled=True), reference)
    eager_bf16 = psnr_db(decode(torch.bfloat16, compiled=False), reference)
    print(f"FLUX VAE decode bf16 vs fp32 PSNR: compiled {compiled_bf16:.2f} dB, eager {eager_bf16:.2f} dB")
    assert compiled_bf16 >= eager_bf16 - 1.0


@pytest.mark.parametrize("compile_blocks", [False, True])
def test_flux_fp8_step_stays_within_its_tolerance(compile_blocks):
    from tilecast.launcher.bench.report import psnr_db

    reference = _flux_step(torch.float32, fast=False)
    fp8_fp32 = _flux_step(torch.float32, fast=True, compile_blocks=compile_blocks, quantize="fp8")
    fp8_bf16 = _flux_step(torch.bfloat16, fast=True, compile_blocks=compile_blocks, quantize="fp8").float()
    bf16 = _flux_step(torch.bfloat16, fast=True, compile_blocks=compile_blocks).float()
    print(
        f"FLUX step vs fp32 PSNR: fp8 in fp32 {psnr_db(fp8_fp32, reference):.2f} dB, "
        f"fp8 in bf16 {psnr_db(fp8_bf16, reference):.2f} dB, bf16 {psnr_db(bf16, reference):.2f} dB"
    )
    assert not torch.equal(fp8_bf16, bf16)
    assert 40.0 <= psnr_db(fp8_fp32, reference) < float("inf")
    assert psnr_db(fp8_bf16, reference) >= psnr_db(bf16, reference) - 1.0


def test_fp8_linear_on_cuda_is_the_dequantized_product():
    from tilecast.kernels.fp8 import Fp8Linear

    torch.manual_seed(0)
    layer = Fp8Linear(torch.nn.Linear(3072, 1536, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(2, 700, 3072, device="cuda", dtype=torch.bfloat16)
    exact = layer.reference(x)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    assert (y.float() - exact).abs().max() <= 2**-8 * exact.abs().max()


@pytest.mark.parametrize("compile_blocks", [False, True])
def test_flux_cuda_graphs_are_bit_exact(compile_blocks):
    from tilecast.runtime.models.families.flux import FluxT2IPipeline

    def images(cuda_graphs):
        pipe = FluxT2IPipeline.build_diffusers("tiny/flux", torch.device("cuda"), torch.bfloat16)
        FluxT2IPipeline.install_fast_paths(pipe, ServeConfig(compile=compile_blocks, cuda_graphs=cuda_graphs))
        out = []
        with torch.inference_mode():
            for batch in (1, 2, 1):
                out.append(
                    pipe(
                        prompt=[f"graph test {i}" for i in range(batch)],
                        width=128,
                        height=96,
                        num_inference_steps=4,
                        max_sequence_length=FluxT2IPipeline.max_sequence_length,
                        generator=torch.Generator("cpu").manual_seed(batch),
                        output_type="pt",
                    ).images.cpu()
                )
        return out, pipe.transformer.forward

    plain, _ = images(cuda_graphs=False)
    graphed, forward = images(cuda_graphs=True)
    # one graph per batch size, each reading the loop's planned modulation (flux_plan), none computing it
    assert sorted((dict(kwargs)["hidden_states"][1][0], staged) for (_, kwargs), staged in forward.graphs) == [
        (1, True),
        (2, True),
    ]
    for a, b in zip(plain, graphed):
        assert torch.equal(a, b)


def test_flux_planned_modulation_under_cuda_graphs_matches_the_per_step_product(monkeypatch):
    from tilecast.runtime.models.families import flux_plan
    from tilecast.runtime.models.families.flux import FluxT2IPipeline

    def latents(planned):
        with monkeypatch.context() as patch:
            if not planned:
                patch.setattr(flux_plan, "install", lambda *args: None)
            pipe = FluxT2IPipeline.build_diffusers("tiny/flux", torch.device("cuda"), torch.float32)
            FluxT2IPipeline.install_fast_paths(pipe, ServeConfig(cuda_graphs=True))
        with torch.inference_mode():
            return [
                pipe(
                    prompt=["plan test"],
                    width=64,
                    height=64,
                    num_inference_steps=6,  # the signature's third call is captured, mid-loop
                    max_sequence_length=FluxT2IPipeline.max_sequence_length,
                    generator=torch.Generator("cpu").manual_seed(seed),
                    output_type="latent",
                ).images
                for seed in (1, 2)
            ], pipe.transformer.forward

    (first, second), forward = latents(planned=True)
    (want_first, want_second), reference_forward = latents(planned=False)
    assert [staged for _, staged in forward.graphs] == [True]
    assert [staged for _, staged in reference_forward.graphs] == [False]
    for got, want in ((first, want_first), (second, want_second)):
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()  # fp32: one product of more rows
