"""``--quantize fp8`` for K6 SR: the DiT blocks' linear layers as FP8 GEMMs (``kernels/fp8.py``).

The K6 SR DiT is attention-bound (at 47.6k tokens attention is about 82% of a block's FLOPs), so
its linear layers are the smaller share: the query/key/value/output projections and the feed
forward of every ``visual_transformer_blocks`` block. Those become ``Fp8Linear`` (e4m3 weights
with a scale per output channel, activations per token); the modulation (``visual_modulation``,
512 -> 10752 on one time embedding), the embeddings and the output layer stay in ``--dtype``.
Opt-in, never a default: each layer's output moves by a few percent of its scale (``bench k6sr
--quantize fp8`` reports the PSNR against diffusers).

Refused where the replaced modules would lose what was done to them: tensor parallelism (its
hooks and sharded weights sit on the ``nn.Linear`` objects), FSDP and a streamed or offloaded
DiT (they move the layers' parameters, not ``Fp8Linear``'s buffers).
"""

from __future__ import annotations

import torch

from tilecast.kernels import fp8
from tilecast.runtime.config import ServeConfig

BLOCKS = "visual_transformer_blocks."
KEPT = ".visual_modulation."
"""Linear layers under ``BLOCKS`` whose names contain this stay in ``--dtype``."""


def check(settings: ServeConfig, device: torch.device, dtype: torch.dtype) -> None:
    """Raise ``ValueError`` naming why ``--quantize fp8`` cannot be honoured with ``settings`` on
    ``device`` for a DiT in ``dtype``."""
    fp8.check_supported(device, dtype)
    placement = settings.placement
    for flag, conflict in (
        ("--tp-size", settings.tp_size > 1),
        ("--use-fsdp-inference", placement.use_fsdp_inference),
        ("an offloaded transformer", "transformer" in placement.offloaded),
    ):
        if conflict:
            raise ValueError(
                f"--quantize fp8 replaces K6 SR's DiT linear layers, which {flag} also rewrites: use one of them"
            )


def quantize_blocks(transformer: torch.nn.Module) -> int:
    """FP8 linear layers in the DiT blocks except the modulation; returns how many."""
    return fp8.quantize_linears(transformer, keep=lambda name: not name.startswith(BLOCKS) or KEPT in name)
