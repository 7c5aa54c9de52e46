"""FLUX's modulation planned for a denoising loop (``families.flux_plan``), tiny/flux on the CPU in float32.

A whole ``FluxPipeline`` call with the plan equals the same call computing each step's
modulation (within 1e-5 of the latents: one product of more rows may sum in another order), and
computes the bank's product once, not once per step. Calls that are not the loop's compute their
own (another pooled embedding, a direct call), and a pipeline whose first timestep is not the one
the planner derives gets no plan and a warning, not wrong values.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tilecast.runtime.models.families import flux_fast, flux_plan
from tilecast.runtime.models.families.flux import FluxT2IPipeline

STEPS = 4


@pytest.fixture(scope="module")
def pipes(tiny_cache):
    """(planned, per-step) tiny ``FluxPipeline`` pairs with the same weights, fast paths installed on both."""
    planned, per_step = (FluxT2IPipeline.build_diffusers("tiny/flux", torch.device("cpu"), torch.float32) for _ in "ab")
    for pipe in (planned, per_step):
        flux_fast.install_fast_paths(pipe.transformer, backend="sdpa_math")
    assert flux_plan.install(planned.transformer, planned.scheduler) is not None
    return planned, per_step


def _products(pipe, monkeypatch) -> list[tuple[int, ...]]:
    """The shapes of ``temb`` every product of ``pipe``'s bank is computed from, from now on."""
    bank, shapes = pipe.transformer.modulation_bank, []
    product = bank.product
    monkeypatch.setattr(bank, "product", lambda temb: (shapes.append(tuple(temb.shape)), product(temb))[1])
    return shapes


def _latents(pipe, prompts=("a lighthouse at dusk", "a red kite")) -> torch.Tensor:
    with torch.inference_mode():
        return pipe(
            prompt=list(prompts),
            width=32,
            height=32,
            num_inference_steps=STEPS,
            max_sequence_length=FluxT2IPipeline.max_sequence_length,
            generator=torch.Generator().manual_seed(3),
            output_type="latent",
        ).images


def _embeddings(pipe) -> list[int]:
    """The row counts of every timestep embedding ``pipe``'s ``time_text_embed`` computes from now on."""
    rows = []
    embedder = pipe.transformer.time_text_embed.timestep_embedder
    handle = embedder.register_forward_hook(lambda module, args, out: rows.append(out.shape[0]))
    return rows, handle


def test_a_planned_loop_equals_the_per_step_one_with_one_product(pipes, monkeypatch):
    planned, per_step = pipes
    shapes, reference_shapes = _products(planned, monkeypatch), _products(per_step, monkeypatch)
    (embedded, handle), (reference_embedded, reference_handle) = _embeddings(planned), _embeddings(per_step)
    got, want = _latents(planned), _latents(per_step)
    handle.remove()
    reference_handle.remove()
    width = planned.transformer.inner_dim
    assert reference_shapes == [(2, width)] * STEPS
    assert shapes == [(STEPS, 2, width)]  # the loop's every step at once, no per-step product
    assert reference_embedded == [2] * STEPS
    assert embedded == [STEPS * 2]  # the plan's; a staged step does not embed its timestep again
    assert planned.transformer.modulation_bank.plan_SBN is None  # dropped after the last step
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    assert not torch.equal(got, _latents(per_step, prompts=("a red kite", "a lighthouse at dusk")))


def test_the_plan_follows_each_loop_and_other_calls_compute_their_own(pipes, monkeypatch):
    planned, per_step = pipes
    shapes = _products(planned, monkeypatch)
    for prompts in (("a lighthouse at dusk",), ("a red kite", "a blue door", "snow")):  # a new plan per loop
        got, want = _latents(planned, prompts), _latents(per_step, prompts)
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    width = planned.transformer.inner_dim
    assert shapes == [(STEPS, 1, width), (STEPS, 3, width)]

    # after a loop: a direct call with the pipeline's tensors but its own pooled embedding
    shapes.clear()
    dims = planned.transformer.config
    inputs = dict(
        hidden_states=torch.randn(3, 4, dims.in_channels),
        encoder_hidden_states=torch.randn(3, 2, dims.joint_attention_dim),
        pooled_projections=torch.randn(3, dims.pooled_projection_dim),
        timestep=torch.full((3,), 0.25),
        guidance=torch.full((3,), 3.5),
        img_ids=torch.zeros(4, 3),
        txt_ids=torch.zeros(2, 3),
        return_dict=False,
    )
    with torch.inference_mode():
        got, want = planned.transformer(**inputs)[0], per_step.transformer(**inputs)[0]
    assert shapes == [(3, width)] and torch.allclose(got, want, atol=1e-6)


class _Halved:
    """A transformer as a pipeline that scales its timesteps otherwise would call it."""

    def __init__(self, transformer):
        self.transformer = transformer

    def __getattr__(self, name):
        return getattr(self.transformer, name)

    def __call__(self, *args, timestep, **kwargs):
        return self.transformer(*args, timestep=timestep * 0.5, **kwargs)


def test_a_first_timestep_it_cannot_derive_gets_no_plan_and_a_warning(pipes, monkeypatch, caplog):
    planned, per_step = pipes
    shapes = _products(planned, monkeypatch)
    for pipe in pipes:
        monkeypatch.setattr(pipe, "transformer", _Halved(pipe.transformer))
    with caplog.at_level(logging.WARNING, logger=flux_plan.__name__):
        got, want = _latents(planned), _latents(per_step)
    assert torch.equal(got, want)
    assert len(shapes) == STEPS and "computed per step (no plan)" in caplog.text


def test_a_plan_too_large_is_not_made(pipes, monkeypatch):
    planned, per_step = pipes
    shapes = _products(planned, monkeypatch)
    monkeypatch.setattr(flux_plan, "PLAN_MAX_BYTES", 1000)
    got, want = _latents(planned), _latents(per_step)
    assert torch.equal(got, want) and len(shapes) == STEPS
