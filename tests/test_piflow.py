"""The one-pass PiFlow step (``kernels/piflow.py``) against diffusers' ``PiflowScheduler.step``, and
the noise drawn ahead (``stages.NoiseAhead``) against ``chunk_noise``. The Triton kernel's own
comparison is CUDA-marked, in ``test_cuda_fast_paths.py``."""

from __future__ import annotations

import pytest
import torch

from tilecast.kernels import piflow
from tilecast.runtime.models.k6sr import stages

CHANNELS = 4


def _scheduler(num_steps: int, **config):
    from diffusers import PiflowScheduler

    scheduler = PiflowScheduler(**config)
    scheduler.set_timesteps(num_steps)
    return scheduler


def _inputs(scheduler, dtype, seed: int = 0, leading=(2, 3, 4, 5)):
    generator = torch.Generator().manual_seed(seed)
    sample = torch.randn((*leading, CHANNELS), generator=generator).to(dtype)
    output = torch.randn((*leading, scheduler.n_grid * CHANNELS), generator=generator).to(dtype)
    return sample, output


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "num_steps,config",
    [
        (2, {}),
        (1, {}),
        (4, {"shift": 3.0, "n_grid": 6, "num_policy_substeps": 40}),
    ],
)
def test_reference_is_diffusers_step_bit_for_bit(dtype, num_steps, config):
    scheduler = _scheduler(num_steps, **config)
    schedule = stages.piflow_schedule(scheduler, num_steps)
    assert len(schedule) == num_steps
    for index, timestep in enumerate(scheduler.timesteps):
        sample, output = _inputs(scheduler, dtype, seed=index)
        expected = scheduler.step(output, timestep, sample, return_dict=False)[0]
        got = piflow.reference(sample, output, schedule[index])
        assert got.dtype == sample.dtype
        assert torch.equal(got, expected), f"step {index}: max diff {(got.float() - expected.float()).abs().max()}"


def test_schedule_is_read_from_a_cpu_copy_and_only_for_piflow():
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = _scheduler(2)
    step = stages.piflow_schedule(scheduler, 2)[1]
    assert step.sigma_src == float(scheduler.sigmas[1]) and step.raw_dst == float(torch.tensor(scheduler.eps))
    assert (step.shift, step.n_grid, step.num_policy_substeps) == (5.0, 10, 128)
    assert stages.piflow_schedule(FlowMatchEulerDiscreteScheduler(), 2) is None


def test_rollout_refuses_an_output_of_the_wrong_width():
    scheduler = _scheduler(2)
    sample, output = _inputs(scheduler, torch.float32)
    step = stages.piflow_schedule(scheduler, 2)[0]
    with pytest.raises(ValueError, match="10 predictions per channel"):
        piflow.rollout(sample, output[..., :-1], step)
    with pytest.raises(ValueError, match="n_grid >= 2"):
        piflow.rollout(sample, output, piflow.PiflowStep(**{**step.__dict__, "n_grid": 1}))


def test_noise_ahead_draws_chunk_noise_in_the_given_order():
    tiles_NCTHW = torch.zeros((5, 3, 2, 4, 6), dtype=torch.bfloat16)
    ranges = stages.chunk_starts(5, 2)  # [0, 1], [2, 3], [4]
    settings = stages.SRSettings(seed=7)
    with stages.NoiseAhead(tiles_NCTHW, ranges, [0, 2], settings, torch.device("cpu")) as noises:
        for chunk in (0, 2):
            shape = (len(ranges[chunk]), 2, 4, 6, 3)
            expected = stages.chunk_noise(shape, 7, ranges[chunk].start, torch.bfloat16, "cpu")
            assert torch.equal(noises.take(chunk), expected)
    with stages.NoiseAhead(tiles_NCTHW, ranges, [0, 1], settings, torch.device("cpu")) as noises:
        with pytest.raises(RuntimeError, match="chunk 1 taken out of order"):
            noises.take(1)


def test_denoise_steps_through_the_one_pass_rollout_and_matches_diffusers_step(monkeypatch):
    from tilecast.runtime.models.k6sr.loading import load_components
    from tilecast.runtime.models.k6sr.tiny import ensure_tiny_k6sr

    parts = load_components(ensure_tiny_k6sr(), device=torch.device("cpu"), dtype=torch.float32)
    channels = parts.transformer.config.in_visual_dim
    tiles_NCTHW = torch.randn((3, channels, 2, 8, 8), generator=torch.Generator().manual_seed(1))
    settings = stages.SRSettings(num_inference_steps=2, seed=5, tiles_batch_size=2)
    calls = []
    rollout = piflow.rollout
    monkeypatch.setattr(piflow, "rollout", lambda *args: calls.append(args[2]) or rollout(*args))
    with torch.no_grad():
        fused = stages.denoise_tiles(parts, tiles_NCTHW, settings)
    assert len(calls) == 2 * 2  # two chunks, two steps each
    monkeypatch.setattr(stages, "piflow_schedule", lambda *args: None)  # diffusers' scheduler.step
    with torch.no_grad():
        stepped = stages.denoise_tiles(parts, tiles_NCTHW, settings)
    assert [indices for indices, _ in fused] == [range(0, 2), range(2, 3)]
    for (_, a), (_, b) in zip(fused, stepped):
        assert torch.equal(a, b)
