"""The built-in ``tiny/k6sr`` checkpoint: seeded random weights in tiny configs of the real classes.

Nothing is downloaded. On first use the checkpoint is generated into
``$TILECAST_CACHE/models/tiny-k6sr-v1`` (default cache ``~/.cache/tilecast``) as an ordinary
diffusers-format directory (``model_index.json`` + ``transformer/``, ``vae/``,
``latent_upscaler/``, ``scheduler/``), written by diffusers' ``save_pretrained`` with safetensors.
Generation is byte-for-byte reproducible; ``runtime/cache.py`` builds it once (one process under a
file lock), marks it complete with a manifest and verifies it on every use.

The configs keep every structural constraint of the released model: a 16x spatial / 4x temporal
K-VAE (five levels), a PiFlow-distilled transformer head (``out_visual_dim = n_grid *
in_visual_dim``), tiles whose token grids are multiples of 8 (128 px at factor 16) and 12 attention heads, so 2-, 3- and
4-way head sharding can be tested.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

from tilecast.runtime.cache import ensure_model_dir

logger = logging.getLogger(__name__)

TINY_NAME = "tiny-k6sr-v1"
"""Directory name under ``<cache>/models``; bump the suffix whenever the configs or seed change."""
TINY_SEED = 20250601
"""Seed of the random weights."""

TRANSFORMER_CONFIG: dict = dict(
    in_visual_dim=16,
    out_visual_dim=16 * 10,
    time_dim=32,
    patch_size=(1, 1, 1),
    model_dim=192,
    ff_dim=384,
    num_visual_blocks=2,
    axes_dims=(4, 6, 6),
    # Every trained tile must be a multiple of 16 px (VAE) x 8 tokens (the transformer's 8x8 token
    # blocks) = 128 px, so the wide/tall tiles are 128x256 rather than the real model's 2:3.
    tile_sizes=((128, 128), (128, 256), (256, 128)),
)
VAE_CONFIG: dict = dict(
    latent_channels=16,
    encoder_block_out_channels=(8, 16, 16, 16, 16),
    decoder_block_out_channels=(8, 16, 16, 16, 16),
    layers_per_block=1,
)
UPSCALER_CONFIG: dict = dict(
    in_channels=16,
    stage_channels=(32, 32, 32),
    num_pre_blocks=1,
    num_mid_blocks=1,
    num_post_blocks=1,
    num_x2_adapter_blocks=1,
    scales=(2, 4),
)
SCHEDULER_CONFIG: dict = dict(n_grid=10)

# Weight init draws from the global torch RNG: one generator per process at a time.
_BUILD_LOCK = threading.Lock()


def build_tiny_pipeline():
    """Construct the tiny ``Kandinsky6SRPipeline`` in memory (float32, CPU, seeded weights)."""
    from diffusers import (
        Kandinsky6SRLatentUpscalerBank,
        Kandinsky6SRPipeline,
        Kandinsky6SRTransformer3DModel,
        Kandinsky6SRVAE,
        PiflowScheduler,
    )

    with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        # The default PyTorch init gives finite, non-constant outputs at these sizes (checked by
        # tests/test_k6sr_tiny.py); no rescaling is needed.
        transformer = Kandinsky6SRTransformer3DModel(**TRANSFORMER_CONFIG)
        vae = Kandinsky6SRVAE(**VAE_CONFIG)
        upscaler = Kandinsky6SRLatentUpscalerBank(**UPSCALER_CONFIG)
    scheduler = PiflowScheduler(**SCHEDULER_CONFIG)
    return Kandinsky6SRPipeline(
        transformer=transformer.eval(), vae=vae.eval(), scheduler=scheduler, latent_upscaler=upscaler.eval()
    )


def write_tiny_k6sr(target: Path) -> Path:
    """Write the tiny checkpoint into ``target`` (which must not exist yet); return ``target``."""
    pipe = build_tiny_pipeline()
    pipe.save_pretrained(str(target), safe_serialization=True)
    return target


def ensure_tiny_k6sr(cache_dir: Path | None = None) -> Path:
    """Return the directory of the tiny checkpoint, generating it on first use.

    ``cache_dir`` defaults to :func:`default_cache_dir`; the model lives in
    ``<cache_dir>/models/tiny-k6sr-v1``. Safe against concurrent callers, and a directory that
    does not match its manifest is rebuilt (``runtime/cache.py``).
    """
    return ensure_model_dir(TINY_NAME, f"{__name__}:write_tiny_k6sr", cache_dir)
