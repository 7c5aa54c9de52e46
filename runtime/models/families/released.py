"""Released-size models with seeded random weights, for benchmarks: ``random/flux``.

``random/flux`` is FLUX.1-dev at its released size (``flux.RELEASED_CONFIGS``: the 12B-parameter
transformer, CLIP ViT-L/14 and T5-v1.1-XXL text encoders, the 16-channel VAE) with seeded random
weights. Its images are noise: it exists so that speed and memory can be measured on the real
shapes without the real weights, which are never downloaded. Nothing is written to disk (the
weights would take tens of GB): every rank builds the model directly on its device when it loads,
one network at a time, each cast to ``--dtype`` as soon as it is built, so at most one network
ever exists in float32. Every rank uses the same seed, so replicated ranks hold the same weights.

Made for ``--device cuda`` (seconds to build on a GPU; about 60 GB of device memory at the peak of
the build, the transformer in float32, then ~35 GB in bfloat16); on CPU it is slow to build and to run. Under ``float16`` every weight is cast (``from_pretrained`` would
keep T5's ``wo`` in float32); benchmarks use ``bfloat16``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from tilecast.runtime.models.families.common import _BUILD_LOCK
from tilecast.runtime.models.families.flux import FluxT2IPipeline, build_flux, flux_configs

logger = logging.getLogger(__name__)

RANDOM_FLUX_SEED = 20250702
"""Seed of ``random/flux``'s weights (the same on every rank and in the benchmark's own process)."""


def build_random_flux(
    device, dtype: torch.dtype, *, seed: int = RANDOM_FLUX_SEED, overrides: dict[str, dict] | None = None
):
    """FLUX.1-dev's ``FluxPipeline`` with seeded random weights, built on ``device`` in ``dtype``.

    ``overrides`` (per-component config changes, see ``flux.flux_configs``) exist for tests that
    need a scaled-down model on CPU; without them every network has its released size.
    """
    device = torch.device(device)
    configs = flux_configs(overrides)

    def finish(module):
        # plain nn.Module.to: diffusers' ModelMixin.to warns on every dtype cast, even with nothing to keep in fp32
        return torch.nn.Module.to(module, dtype).eval()

    with _BUILD_LOCK, torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with torch.device(device):
            pipe = build_flux(configs, finish)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # give back the float32 staging blocks of the casts
    pipe.set_progress_bar_config(disable=True)
    return pipe


class RandomFluxT2IPipeline(FluxT2IPipeline):
    """``random/flux``: the FLUX family (same requests, same batching) on the released-size random model."""

    builtin_name = "random/flux"
    checkpoint = None  # the weights are drawn at load, nothing is written
    max_sequence_length = 512
    """FLUX.1-dev's T5 length and diffusers' ``FluxPipeline`` default: the released workload."""

    @classmethod
    def build_diffusers(cls, model_path: str, device: torch.device, dtype: torch.dtype) -> Any:
        if model_path != cls.builtin_name:
            raise ValueError(f"{cls.__name__} builds only {cls.builtin_name!r}, got --model-path {model_path!r}")
        began = time.perf_counter()
        pipe = build_random_flux(device, dtype)
        num_params = sum(
            p.numel()
            for part in (pipe.transformer, pipe.text_encoder, pipe.text_encoder_2, pipe.vae)
            for p in part.parameters()
        )
        logger.info(
            "built %s with random weights: %.2fB parameters, %s, %s, in %.1fs",
            cls.builtin_name,
            num_params / 1e9,
            dtype,
            device,
            time.perf_counter() - began,
        )
        return pipe
