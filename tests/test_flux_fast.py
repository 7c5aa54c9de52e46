"""FLUX's fast paths (``families.flux_fast``) against diffusers' own ``FluxPipeline``, tiny/flux, CPU fp32.

Tolerances (max abs difference on the ``[0, 1]`` image): the dense processor with fused projections
vs diffusers: 1e-5 (measured 0: on CPU both reach the same SDPA kernel and the fused matrix
multiply gives the same sums); the compiled blocks and VAE decoder vs diffusers: 1e-4 (Inductor
reorders the norm and modulation arithmetic; measured 1.3e-6).
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import flux_step_bench, make_context
from tilecast.kernels.attention import BackendUnavailableError
from tilecast.runtime.models.families import flux_fast
from tilecast.runtime.models.families.flux import FluxT2IPipeline
from tilecast.runtime.models.families.flux_fast import FluxDenseAttnProcessor
from tilecast.runtime.pipeline import WorkItem


@pytest.fixture(scope="module")
def diffusers_pipe(tiny_cache):
    """diffusers' ``FluxPipeline`` on tiny/flux, untouched."""
    return FluxT2IPipeline.build_diffusers("tiny/flux", torch.device("cpu"), torch.float32)


def _image(family: FluxT2IPipeline, pipe=None) -> torch.Tensor:
    params = family.prepare(family.params_type(prompt="a lighthouse at dusk", width=32, height=32, seed=5), {})
    with torch.inference_mode():
        return (pipe or family.pipe)(**family.call_args([WorkItem(job_id="x", params=params)]), return_dict=False)[0]


def _attentions(family: FluxT2IPipeline):
    from diffusers.models.transformers.transformer_flux import FluxAttention

    return [m for m in family.pipe.transformer.modules() if isinstance(m, FluxAttention)]


def test_fast_paths_are_installed_and_match_diffusers(diffusers_pipe, tmp_path, monkeypatch):
    family = FluxT2IPipeline.load("tiny/flux", make_context(tmp_path, dtype="float32", attention_backend="sdpa_math"))
    attentions = _attentions(family)
    assert len(attentions) == 2  # one joint block, one single block
    for attn in attentions:
        assert isinstance(attn.processor, FluxDenseAttnProcessor) and attn.processor.backend == "sdpa_math"
        assert attn.fused_projections and not hasattr(attn, "to_q") and not hasattr(attn, "add_q_proj")
    calls = []
    kernel = flux_fast.attention
    monkeypatch.setattr(flux_fast, "attention", lambda *a, **kw: (calls.append(kw["backend"]), kernel(*a, **kw))[1])
    ours = _image(family)
    assert calls == ["sdpa_math"] * 2 * family.default_steps, "tilecast's attention kernel did not run"
    reference = _image(family, diffusers_pipe)
    assert (ours - reference).abs().max().item() <= 1e-5


def test_bad_attention_backend_fails_at_load_naming_it(tiny_cache, tmp_path):
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        FluxT2IPipeline.load("tiny/flux", make_context(tmp_path, dtype="float32", attention_backend="nope"))
    with pytest.raises(BackendUnavailableError, match="sdpa_cudnn"):
        FluxT2IPipeline.load("tiny/flux", make_context(tmp_path, dtype="float32", attention_backend="sdpa_cudnn"))


def test_a_mask_is_refused_not_ignored():
    with pytest.raises(ValueError, match="attention_mask"):
        FluxDenseAttnProcessor()(None, torch.zeros(1, 2, 4), attention_mask=torch.ones(1, 2))


def test_compiled_blocks_match_diffusers(diffusers_pipe, tmp_path, monkeypatch):
    from diffusers import ModelMixin

    options = []
    compile_blocks = ModelMixin.compile_repeated_blocks
    monkeypatch.setattr(
        ModelMixin, "compile_repeated_blocks", lambda self, **kw: (options.append(kw), compile_blocks(self, **kw))[1]
    )
    family = FluxT2IPipeline.load("tiny/flux", make_context(tmp_path, dtype="float32", compile=True))
    assert options == [{"options": {"combo_kernels": True, "coordinate_descent_tuning": True}}]
    blocks = [*family.pipe.transformer.transformer_blocks, *family.pipe.transformer.single_transformer_blocks]
    assert all(block._compiled_call_impl is not None for block in blocks)
    assert family.pipe.vae.decoder._compiled_call_impl is not None
    assert family.pipe.transformer.pos_embed._compiled_call_impl is not None  # the rotary tables, fused
    assert (_image(family) - _image(family, diffusers_pipe)).abs().max().item() <= 1e-4


def test_flux_honours_backend_and_compile_and_refuses_the_rest():
    from tilecast.runtime.config import ServeConfig, unsupported_settings

    config = ServeConfig(device="cpu", attention_backend="sdpa_math", compile=True, tile_parallel=True)
    assert unsupported_settings(config, FluxT2IPipeline.honoured_settings) == ["--tile-parallel"]
    with pytest.raises(ValueError, match="--tile-parallel is not supported by tiny/flux"):
        FluxT2IPipeline.check_settings(config, "tiny/flux")


def test_bench_step_times_both_sides_of_the_same_model(tiny_cache, tmp_path):
    rows = flux_step_bench(
        width=32, height=48, batch_sizes=[1, 3], attention_backend="sdpa_math", iters=2, profile_dir=tmp_path
    )
    assert [row["batch"] for row in rows] == [1, 3]
    for batch in (1, 3):  # --profile: one tilecast step's operators, heaviest first
        table = (tmp_path / f"step_b{batch}.txt").read_text()
        assert "Self CPU" in table and "aten::" in table
    for row in rows:
        assert row["diffusers_ms"] > 0 and row["tilecast_ms"] > 0 and row["tflop"] > 0
        assert row["ratio"] == pytest.approx(row["tilecast_ms"] / row["diffusers_ms"])
        assert row["max_rel_diff"] <= 1e-5  # same model, same inputs: the fast paths keep the function
    assert rows[1]["tflop"] == pytest.approx(3 * rows[0]["tflop"], rel=0.05)


def test_bench_step_times_the_pipelines_loop_with_the_planned_modulation(tiny_cache, monkeypatch):
    from tilecast.runtime.models.families import flux_plan

    plans = []
    plan = flux_plan.ModulationPlanner._plan
    monkeypatch.setattr(flux_plan.ModulationPlanner, "_plan", lambda self, *a: (plans.append(1), plan(self, *a))[1])
    (row,) = flux_step_bench(width=32, height=32, batch_sizes=[2], attention_backend="sdpa_math", iters=2, loop_steps=3)
    assert row["loop_steps"] == 3 and row["tilecast_ms"] > 0 and row["diffusers_ms"] > 0
    assert row["max_rel_diff"] <= 1e-5  # the loops' latents: the fast paths and the plan keep the function
    assert len(plans) == 1 + 2  # one plan per tilecast loop: the warm-up's and the two timed


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model-path", "tiny/qwen-image"], "times FLUX's transformer"),
        (["--loop-steps", "-1"], "loop steps must be 0"),
        (["--width", "50"], "multiples of 16"),
        (["--batch-size", "0"], "positive integer"),
        (["--dtype", "float64"], "--dtype must be one of"),
    ],
)
def test_bench_step_refuses_bad_options(args, message, tiny_cache):
    from typer.testing import CliRunner

    from tilecast.launcher.cli import app

    result = CliRunner().invoke(app, ["bench", "step", *args])
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output


def test_the_single_blocks_output_projection_reads_its_two_parts_without_concatenating(
    tiny_cache, tmp_path, monkeypatch
):
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 16)
    layer = flux_fast.ConcatInputLinear(linear, [16, 32])
    attn, mlp = torch.randn(2, 5, 16), torch.randn(2, 5, 32)
    assert layer.weight is linear.weight
    assert torch.allclose(layer(attn, mlp), linear(torch.cat([attn, mlp], dim=-1)), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match=r"\[16, 16\] features do not add up to the layer's 48"):
        flux_fast.ConcatInputLinear(linear, [16, 16])

    family = FluxT2IPipeline.load("tiny/flux", make_context(tmp_path, dtype="float32"))
    (block,) = family.pipe.transformer.single_transformer_blocks
    assert isinstance(block.proj_out, flux_fast.ConcatInputLinear) and block.proj_out.sizes == [
        block.attn.inner_dim,
        block.mlp_hidden_dim,
    ]
    concatenated, inside = [], []
    block.register_forward_pre_hook(lambda *_: inside.append(True))
    block.register_forward_hook(lambda *_: inside.clear())
    cat = torch.cat  # inside the block: the text and image tokens joined (dim 1), never the features (the last dim)
    monkeypatch.setattr(
        torch, "cat", lambda tensors, dim=0, **kw: (inside and concatenated.append(dim), cat(tensors, dim=dim, **kw))[1]
    )
    _image(family)
    assert concatenated and set(concatenated) == {1}


def test_compiled_the_parts_are_accumulated_by_the_opaque_op_not_inductors_copying_addmm():
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 16)
    layer = flux_fast.ConcatInputLinear(linear, [16, 32])
    attn, mlp = torch.randn(2, 5, 16), torch.randn(2, 5, 32)
    with torch.inference_mode():
        got, code = run_and_get_code(torch.compile(layer, fullgraph=True), attn, mlp)
        expected = linear(torch.cat([attn, mlp], dim=-1))
    code = "\n".join(code)
    assert "tilecast.linear_of_parts" in code and "addmm" not in code  # ATen's out-of-place addmm copies its input
    assert torch.allclose(got, expected, atol=1e-6, rtol=0)
