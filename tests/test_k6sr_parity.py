"""tilecast's SR loop agrees with diffusers' ``Kandinsky6SRPipeline`` on the tiny checkpoint.

Same frames in, same noise, dense attention on both sides (diffusers' transformer gets a plain
PyTorch SDPA processor, tilecast its own processor through ``tilecast.kernels.attention``). The
float videos are compared before quantisation.

Tolerance: ``ATOL = 1e-4`` on the ``[0, 1]`` video (1/40 of one 8-bit level). Both sides run
the same float32 ops except the attention kernel, so the expected difference is fp32 rounding.
Measured (printed with ``-s``): exactly 0 with the kernels' auto backend on CPU (it picks SDPA, as
the reference does) and 6.9e-7 with ``sdpa_math`` / ``chunked_math``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.harness import make_context
from tests.media import pattern_frames
from tilecast.launcher.bench.k6sr import DenseSDPAProcessor
from tilecast.runtime.models.k6sr.params import SRParams
from tilecast.runtime.models.k6sr.pipeline import K6SRPipeline
from tilecast.runtime.models.k6sr.tiny import ensure_tiny_k6sr

ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return ensure_tiny_k6sr(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def ours(tiny_dir, tmp_path_factory) -> K6SRPipeline:
    return K6SRPipeline.load(str(tiny_dir), make_context(tmp_path_factory.mktemp("out")))


@pytest.fixture(scope="module")
def reference(tiny_dir):
    from diffusers import Kandinsky6SRPipeline

    pipe = Kandinsky6SRPipeline.from_pretrained(str(tiny_dir), dtype=torch.float32)
    pipe.transformer.set_attn_processor(DenseSDPAProcessor())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _compare(ours, reference, frames_FHWC, *, scale, tiles_batch_size, seed=42):
    params = SRParams(sr_resolution_scale=scale, sr_tiles_batch_size=tiles_batch_size, seed=seed)
    video_BCFHW, plan = ours.upscale_frames(torch.from_numpy(frames_FHWC), params)
    ours_01 = (video_BCFHW / 2 + 0.5).clamp(0, 1)[0].permute(1, 0, 2, 3)  # F C H W

    video_FCHW = torch.from_numpy(frames_FHWC).permute(0, 3, 1, 2).float() / 255.0
    ref = reference(
        video=video_FCHW,
        resolution_scale=scale,
        num_inference_steps=2,
        tiles_batch_size=tiles_batch_size,
        generator=torch.Generator().manual_seed(seed),
        output_type="pt",
    ).frames[0]
    assert ours_01.shape == ref.shape
    diff = (ours_01 - ref).abs().max().item()
    print(f"scale {scale}, {plan.num_tiles} tiles, batch {tiles_batch_size}: max |diff| = {diff:.3g}")
    assert ref.std() > 0.02, "reference output is (nearly) constant: the tiny weights are degenerate"
    assert diff <= ATOL
    return plan


def test_single_tile_x2_matches_diffusers(ours, reference):
    plan = _compare(ours, reference, pattern_frames(64, 64, 5), scale=2, tiles_batch_size=1)
    assert plan.num_tiles == 1


def test_multi_tile_x2_25_one_chunk_matches_diffusers(ours, reference):
    # 80x80 -> 1.125x pre-upscale snapped to 96x96 -> 2x2 tiles of 64 px; one chunk of 4 tiles
    # draws the same noise as diffusers' single generator.
    plan = _compare(ours, reference, pattern_frames(80, 80, 1), scale=2.25, tiles_batch_size=4)
    assert plan.num_tiles == 4 and plan.output_size == (192, 192)


def test_multi_tile_x4_matches_diffusers(ours, reference):
    plan = _compare(ours, reference, pattern_frames(48, 32, 1), scale=4, tiles_batch_size=2)
    assert plan.num_tiles == 2


def test_per_chunk_seeds_match_reseeded_diffusers(ours, reference, monkeypatch):
    """tilecast seeds chunk ``i`` with ``seed + first tile``; diffusers with that seeding agrees."""
    import diffusers.pipelines.kandinsky6.pipeline_kandinsky6_sr as module

    calls = []

    def reseeded_randn(shape, generator=None, device=None, dtype=None):
        first_tile = len(calls)  # batch 1: chunk i starts at tile i
        calls.append(shape)
        g = torch.Generator().manual_seed(7 + first_tile)
        return torch.randn(shape, generator=g, dtype=dtype).to(device)

    monkeypatch.setattr(module, "randn_tensor", reseeded_randn)
    plan = _compare(ours, reference, pattern_frames(96, 64, 1), scale=2, tiles_batch_size=1, seed=7)
    assert plan.num_tiles == len(calls) == 2


def test_tile_batch_changes_the_output_but_stays_deterministic(ours):
    frames = torch.from_numpy(pattern_frames(96, 64, 1))
    one, _ = ours.upscale_frames(frames, SRParams(sr_resolution_scale=2, sr_tiles_batch_size=1))
    two, _ = ours.upscale_frames(frames, SRParams(sr_resolution_scale=2, sr_tiles_batch_size=2))
    again, _ = ours.upscale_frames(frames, SRParams(sr_resolution_scale=2, sr_tiles_batch_size=2))
    assert torch.equal(two, again)
    assert not torch.equal(one, two)
    assert math.isfinite(one.abs().max().item()) and np.isfinite(two.numpy()).all()


@pytest.mark.parametrize("backend", ["sdpa_math", "chunked_math"])
def test_other_attention_backends_match_diffusers(ours, reference, backend):
    from tilecast.kernels.backends import available_backends
    from tilecast.runtime.models.k6sr.attention import dense_processors

    if backend not in available_backends():
        pytest.skip(f"attention backend {backend} is not available here")
    processors = dense_processors(ours.parts.transformer)
    previous = [p.backend for p in processors]
    try:
        for processor in processors:
            processor.backend = backend
        _compare(ours, reference, pattern_frames(64, 64, 1), scale=2, tiles_batch_size=1)
    finally:
        for processor, value in zip(processors, previous):
            processor.backend = value
