"""Kandinsky 6 SR DiT under TP / Ulysses / Ring / TP × Ulysses / Ulysses × Ring on gloo ranks.

Every rank builds the same seeded tiny transformer, computes the single-rank output with the dense
attention processor, then applies ``apply_dit_parallel`` with groups from a ``DeviceMesh`` and
compares (ring3_padded: 64 tokens on 3 ranks, so padding is masked). Tolerance: fp32, max abs error <= 1e-4 on outputs of magnitude ~1 (measured ~1e-6).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tilecast.runtime.models.k6sr.tiny import TRANSFORMER_CONFIG

TOL = 1e-4
CONFIG = {**TRANSFORMER_CONFIG, "tile_sizes": ((128, 128), (128, 192), (192, 128))}
"""The tiny/k6sr checkpoint's transformer, with 128x192 rather than 128x256 wide and tall tiles."""


def _tiny_dit(num_frames: int = 3):
    from diffusers.models.transformers.transformer_kandinsky6_sr import Kandinsky6SRTransformer3DModel

    from tilecast.runtime.models.k6sr.attention import install_dense_attention

    torch.manual_seed(0)
    model = Kandinsky6SRTransformer3DModel(**CONFIG).eval()
    install_dense_attention(model)
    generator = torch.Generator().manual_seed(1)
    hidden_states = torch.randn(1, num_frames, 8, 8, 33, generator=generator)
    timestep = torch.tensor([500.0])
    return model, hidden_states, timestep


def _run_topology(rank: int, world_size: int, tp: int, ulysses: int, ring: int, num_frames: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from tilecast.runtime.models.k6sr.dit_parallel import apply_dit_parallel, dit_groups_from_mesh

    mesh = init_device_mesh("cpu", (ring, ulysses, tp), mesh_dim_names=("ring", "ulysses", "tp"))
    model, hidden_states, timestep = _tiny_dit(num_frames)
    seen_tokens = []
    block = model.visual_transformer_blocks[1]
    block.self_attention.register_forward_pre_hook(lambda m, args: seen_tokens.append(args[0].shape[1]))
    with torch.no_grad():
        reference = model(hidden_states, timestep).sample
        apply_dit_parallel(model, **dit_groups_from_mesh(mesh))
        output = model(hidden_states, timestep).sample
        again = model(hidden_states, timestep).sample  # hooks and caches survive a second call
    return {
        "tokens": seen_tokens,  # per call: full, then this rank's shard
        "q_features": block.self_attention.to_query.weight.shape[0],
        "shape_ok": output.shape == reference.shape,
        "err": (output - reference).abs().max().item(),
        "err_again": (again - reference).abs().max().item(),
        "scale": reference.abs().max().item(),
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("tp", "ulysses", "ring", "num_frames"),
    [(2, 1, 1, 3), (2, 2, 1, 3), (1, 2, 1, 3), (1, 1, 2, 3), (1, 2, 2, 3), (1, 1, 3, 1)],
    ids=["tp2", "tp2xulysses2", "ulysses2", "ring2", "ulysses2xring2", "ring3_padded"],
)
def test_dit_matches_single_rank(tp, ulysses, ring, num_frames):
    # ring3_padded: 64 tokens on 3 ranks are padded to 66; the padding must not leak into the output.
    results = run_ranks(_run_topology, tp * ulysses * ring, tp, ulysses, ring, num_frames, timeout=100)
    num_tokens = num_frames * 8 * 8
    for rank, result in enumerate(results):
        # The work really is split: each rank attends over its token shard with its head shard.
        assert result["tokens"] == [num_tokens] + [-(-num_tokens // (ulysses * ring))] * 2, rank
        assert result["q_features"] == CONFIG["model_dim"] // tp, rank
        assert result["shape_ok"], rank
        assert result["err"] <= TOL, (rank, result)
        assert result["err_again"] <= TOL, (rank, result)


def test_heads_must_divide_tp_times_ulysses():
    from tilecast.runtime.models.k6sr import dit_parallel

    model, _, _ = _tiny_dit()
    for tp, ulysses in [(8, 1), (2, 4), (1, 8)]:  # 12 heads
        with pytest.raises(ValueError, match="TP times Ulysses must divide the 12 DiT heads"):
            dit_parallel._check_divisible(model, tp, ulysses)  # the same words as before launch
    dit_parallel._check_divisible(model, 2, 2)
    dit_parallel._check_divisible(model, 1, 4)
