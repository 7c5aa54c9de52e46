"""Every modulation layer of a FLUX step as one product (``families.modulation``, ``flux_fast.bank_modulation``).

On tiny/flux's transformer with two joint and three single blocks (random weights, CPU float32): the
banked model equals the original within 1e-6 of the output (the same dot products; only the
summation order of the one stacked product may differ), holds as many parameters, and computes one
SiLU and one product where the original computed one per layer. Compiled with diffusers' regional
compilation, the bank's outputs are graph inputs: as many graphs as diffusers' own model makes, no
recompile per block or per call. Misuse raises naming the problem instead of returning another forward's values.
"""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers import FluxTransformer2DModel
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tests.harness import make_context
from tilecast.runtime.models.families import flux_fast
from tilecast.runtime.models.families.flux import TINY_OVERRIDES, FluxT2IPipeline, flux_configs
from tilecast.runtime.models.families.modulation import BankedLinear, ModulationBank

JOINT, SINGLE = 2, 3
LAYERS = 2 * JOINT + SINGLE + 1
"""Each joint block's image and text ``norm1``, each single block's ``norm``, ``norm_out``."""


def _transformer() -> FluxTransformer2DModel:
    """tiny/flux's transformer with more blocks (a per-block recompile needs two of a kind to show)."""
    torch.manual_seed(0)
    config = {**flux_configs(TINY_OVERRIDES)["transformer"], "num_layers": JOINT, "num_single_layers": SINGLE}
    return FluxTransformer2DModel(**config).eval()


def _inputs(batch: int = 2) -> dict:
    dims = flux_configs(TINY_OVERRIDES)["transformer"]
    torch.manual_seed(1)
    return dict(
        hidden_states=torch.randn(batch, 16, dims["in_channels"]),
        encoder_hidden_states=torch.randn(batch, 4, dims["joint_attention_dim"]),
        pooled_projections=torch.randn(batch, dims["pooled_projection_dim"]),
        timestep=torch.full((batch,), 0.5),
        guidance=torch.full((batch,), 3.5),
        img_ids=torch.randn(16, 3),
        txt_ids=torch.zeros(4, 3),
        return_dict=False,
    )


def _banked() -> tuple[FluxTransformer2DModel, FluxTransformer2DModel]:
    original = _transformer()
    banked = copy.deepcopy(original)
    assert flux_fast.bank_modulation(banked) == LAYERS
    return original, banked


class _Count(TorchDispatchMode):
    """How many SiLUs, and how many products with one row per image, a forward runs."""

    def __init__(self, batch: int) -> None:
        super().__init__()
        self.batch, self.silu, self.rows = batch, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.silu.default:
            self.silu += 1
        if func in (torch.ops.aten.linear.default, torch.ops.aten.addmm.default) and out.shape[0] == self.batch:
            self.rows += 1
        return out


def test_the_banked_transformer_equals_the_original_with_the_same_parameters():
    original, banked = _banked()
    with torch.inference_mode():
        expected, got = original(**_inputs())[0], banked(**_inputs())[0]
    assert (got - expected).abs().max().item() <= 1e-6 * expected.abs().max().item()
    assert sum(p.numel() for p in banked.parameters()) == sum(p.numel() for p in original.parameters())
    layers = [name for name, module in banked.named_modules() if isinstance(module, BankedLinear)]
    assert layers == [
        "transformer_blocks.0.norm1.linear",
        "transformer_blocks.0.norm1_context.linear",
        "transformer_blocks.1.norm1.linear",
        "transformer_blocks.1.norm1_context.linear",
        "single_transformer_blocks.0.norm.linear",
        "single_transformer_blocks.1.norm.linear",
        "single_transformer_blocks.2.norm.linear",
        "norm_out.linear",
    ]


def test_one_silu_and_one_product_stand_in_for_every_modulation_layer():
    original, banked = _banked()
    counts = []
    for model in (original, banked):
        with torch.inference_mode(), _Count(batch=2) as count:
            model(**_inputs())
        counts.append((count.silu, count.rows))
    (silu_before, rows_before), (silu_after, rows_after) = counts
    assert silu_before - silu_after == LAYERS - 1
    assert rows_before - rows_after == LAYERS - 1


def _graphs(model: FluxTransformer2DModel) -> tuple[int, torch.Tensor]:
    """(graphs Dynamo made, the output) of two forwards of ``model`` regionally compiled; the second
    may not recompile."""
    model.compile_repeated_blocks()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch.inference_mode():
        first = model(**_inputs())[0]
        with torch.compiler.set_stance("fail_on_recompile"):
            assert torch.equal(model(**_inputs())[0], first)
    return torch._dynamo.utils.counters["stats"]["unique_graphs"], first


def test_compiled_blocks_take_the_banks_values_as_inputs_not_one_graph_per_block():
    original, banked = _banked()
    with torch.inference_mode():
        expected = original(**_inputs())[0]
    graphs, got = _graphs(banked)
    # diffusers' own: a joint block, a single block, and the single block again for the strided
    # token views the first single block hands on; a bank read per block would make one per block.
    assert graphs == _graphs(original)[0] == 3
    assert (got - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


def test_a_banked_layer_outside_the_forward_or_with_another_batch_raises():
    _, banked = _banked()
    layer = banked.transformer_blocks[0].norm1.linear
    with torch.inference_mode():
        banked(**_inputs())
        with pytest.raises(RuntimeError, match="outside its transformer's forward"):
            layer(torch.zeros(2, banked.inner_dim))
        banked.modulation_bank.compute(torch.zeros(2, banked.inner_dim))
        with pytest.raises(ValueError, match=r"input rows \(1,\); the bank computed \(2,\)"):
            layer(torch.zeros(1, banked.inner_dim))
        bank = banked.modulation_bank
        with pytest.raises(IndexError, match="step 0 of a plan of 0 steps"):
            bank.stage(0)
        bank.plan(torch.zeros(3, 2, banked.inner_dim))
        with pytest.raises(IndexError, match="step 3 of a plan of 3 steps"):
            bank.stage(3)
        bank.stage(2)
        with pytest.raises(ValueError, match="a forward of batch 1 found a modulation row staged for batch 2"):
            bank.compute(torch.zeros(1, banked.inner_dim))


def test_layers_that_cannot_be_banked_are_refused_and_a_wrapped_one_leaves_the_model_alone():
    holder = nn.Module()
    holder.a, holder.b, holder.c, holder.d = (
        nn.Linear(16, 8),
        nn.Linear(12, 8),
        nn.Linear(16, 8, bias=False),
        nn.Identity(),
    )
    with pytest.raises(ValueError, match="at least one layer"):
        ModulationBank([])
    with pytest.raises(ValueError, match="share input size, dtype and device"):
        ModulationBank([(holder, "a"), (holder, "b")])
    with pytest.raises(ValueError, match="with a bias"):
        ModulationBank([(holder, "a"), (holder, "c")])
    with pytest.raises(ValueError, match="plain nn.Linear"):
        ModulationBank([(holder, "a"), (holder, "d")])
    assert type(holder.a) is nn.Linear  # nothing replaced by a refused bank

    model = _transformer()
    model.norm_out.linear = nn.Sequential(model.norm_out.linear)  # as an adapter wraps a layer
    assert flux_fast.bank_modulation(model) == 0
    assert not hasattr(model, "modulation_bank")
    assert not any(isinstance(m, BankedLinear) for m in model.modules())


def test_flux_banks_its_modulation_when_fusing_and_not_for_lora(tiny_cache, tmp_path):
    family = FluxT2IPipeline.load("tiny/flux", make_context(tmp_path, dtype="float32"))
    assert isinstance(family.pipe.transformer.modulation_bank, ModulationBank)
    model = _transformer()
    flux_fast.install_fast_paths(model, backend="sdpa_math", fuse=False)
    assert not hasattr(model, "modulation_bank")
