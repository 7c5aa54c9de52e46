"""FastVideo's DMD few-step sampling for the FastWan releases, as a scheduler diffusers' Wan pipelines run.

FastWan2.1 T2V 1.3B and FastWan2.2 TI2V 5B Full Attn are DMD-distilled: FastVideo samples them at
the fixed timesteps 1000, 757, 522 without classifier-free guidance (``DmdStrategy``). At each
timestep ``t`` the transformer's flow prediction ``v`` gives the clean latents
``x0 = x_t - sigma(t) v``; before the next timestep ``t'`` they are noised again with fresh
Gaussian noise, ``x_t' = (1 - sigma(t')) x0 + sigma(t') noise``; the last ``x0`` is decoded.
``sigma(t)`` is the sigma of the nearest timestep of the full training schedule of a
flow-matching Euler scheduler with the release's shift (8 for FastWan2.1, 5 for FastWan2.2), as
FastVideo's ``pred_noise_to_pred_video`` / ``add_noise`` look it up; x0 is computed in float64
as there.

``DMDFlowScheduler`` is that sampler behind the scheduler interface ``WanPipeline`` /
``WanImageToVideoPipeline`` use (``set_timesteps``, ``timesteps``, ``sigmas``, ``order``,
``set_begin_index``, ``step``, ``config.num_train_timesteps``). The fresh noise of each request comes from that request's own
generator (the one that drew its starting noise, continuing its stream), so a request's video is
the same alone or in a merged batch (FastVideo draws the batch's noise from its first generator).
"""

from __future__ import annotations

from typing import Any

import torch

DMD_TIMESTEPS = (1000, 757, 522)
"""FastVideo's ``dmd_denoising_steps`` of the FastWan releases."""


class DMDFlowScheduler:
    """A few-step DMD sampler with the scheduler interface of diffusers' Wan pipelines."""

    order = 1

    def __init__(self, timesteps: tuple[int, ...] = DMD_TIMESTEPS, shift: float = 8.0, num_train_timesteps: int = 1000):
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.configuration_utils import FrozenDict

        train = FlowMatchEulerDiscreteScheduler(num_train_timesteps=num_train_timesteps, shift=shift)
        self.train_timesteps = train.timesteps.double()
        self.train_sigmas = train.sigmas.double()[: len(self.train_timesteps)]
        self.dmd_timesteps = tuple(int(t) for t in timesteps)
        self.config = FrozenDict(
            num_train_timesteps=num_train_timesteps, dmd_timesteps=list(self.dmd_timesteps), dmd_shift=shift
        )
        self.timesteps = torch.tensor(self.dmd_timesteps, dtype=torch.float32)
        self.sigmas = torch.tensor([self.sigma(t) for t in self.dmd_timesteps] + [0.0])
        """Each step's sigma (diffusers' Wan pipelines pass them to the transformer's cache context)."""
        self.generators: list[torch.Generator] | None = None
        """Each batch row's generator for the fresh noise (set per batch; None: the global RNG)."""

    def sigma(self, timestep) -> float:
        """The training schedule's sigma at the timestep nearest ``timestep``."""
        index = int((self.train_timesteps - float(timestep)).abs().argmin())
        return float(self.train_sigmas[index])

    def set_timesteps(self, num_inference_steps: int, device: Any = None, **_kwargs) -> None:
        if num_inference_steps != len(self.dmd_timesteps):
            raise ValueError(
                f"num_inference_steps must be {len(self.dmd_timesteps)}: the DMD timesteps are {self.dmd_timesteps}"
            )
        self.timesteps = torch.tensor(self.dmd_timesteps, dtype=torch.float32, device=device)

    def set_begin_index(self, begin_index: int = 0) -> None:
        """Diffusers' pipelines call this; the steps are found by timestep here."""

    def step(self, model_output: torch.Tensor, timestep, sample: torch.Tensor, return_dict: bool = False, **_kwargs):
        """``x0`` from the flow prediction, noised again to the next timestep (the last step: ``x0``)."""
        x0 = (sample.double() - self.sigma(timestep) * model_output.double()).to(sample.dtype)
        index = self.dmd_timesteps.index(int(round(float(timestep))))
        if index == len(self.dmd_timesteps) - 1:
            return (x0,)
        sigma_next = self.sigma(self.dmd_timesteps[index + 1])
        return ((1.0 - sigma_next) * x0 + sigma_next * self.noise_like(x0),)

    def noise_like(self, x: torch.Tensor) -> torch.Tensor:
        """Fresh Gaussian noise shaped like ``x``: row ``i`` from generator ``i``."""
        if self.generators is None:
            return torch.randn_like(x)
        if len(self.generators) != x.shape[0]:
            raise RuntimeError(f"{len(self.generators)} generators for a batch of {x.shape[0]}")
        rows = [
            torch.randn(x.shape[1:], generator=g, dtype=x.dtype, device=g.device).to(x.device) for g in self.generators
        ]
        return torch.stack(rows)
