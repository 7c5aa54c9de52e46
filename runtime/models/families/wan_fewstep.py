"""The distilled Wan releases' few-step sampling, as a scheduler diffusers' Wan pipelines run.

Both samplers predict the clean latents from the transformer's flow prediction ``v`` at the
current noise level ``s`` (``x0 = x - s v``, in float64 as the releases do) and, before the next
level ``s'``, noise them again with fresh Gaussian noise: ``x' = (1 - s') x0 + s' noise``; the last
``x0`` is decoded. Neither runs classifier-free guidance.

- **DMD** (FastVideo's ``DmdStrategy``: FastWan2.1 T2V 1.3B, FastWan2.2 TI2V 5B Full Attn): three
  steps at the timesteps 1000, 757, 522; ``s`` is the sigma of the nearest timestep of the full
  training schedule of a flow-matching Euler scheduler with the release's shift (8, 5), as
  FastVideo's ``pred_noise_to_pred_video`` / ``add_noise`` look it up. The start is ``N(0, 1)``.
- **rCM** (TurboDiffusion's inference scripts: TurboWan2.1 T2V, TurboWan2.2 I2V A14B): 1..4 steps
  at the TrigFlow times ``atan(sigma_max), 1.5, 1.4, 1.0`` (the first ``steps - 1`` of the last
  three) turned into rectified-flow levels ``sin t / (cos t + sin t)``; the transformer gets
  ``1000 s`` as its timestep; the start is ``N(0, 1)`` scaled by the first level (``sigma_max`` 80
  for T2V, 200 for I2V).

``FewStepFlowScheduler`` has the interface ``WanPipeline`` / ``WanImageToVideoPipeline`` use
(``set_timesteps``, ``timesteps``, ``sigmas``, ``order``, ``set_begin_index``, ``step``,
``config.num_train_timesteps``). The fresh noise of each request comes from that request's own
generator (the one that drew its starting noise, continuing its stream), so a request's video is
the same alone or in a merged batch (the releases draw a batch's noise from one generator).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

DMD_TIMESTEPS = (1000, 757, 522)
"""FastVideo's ``dmd_denoising_steps`` of the FastWan releases."""
RCM_MID_TIMES = (1.5, 1.4, 1.0)
"""TurboDiffusion's TrigFlow times after the first (``mid_t``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class FewStep:
    """A distilled release's sampler: ``kind`` ``dmd`` (with ``shift``) or ``rcm`` (with ``sigma_max``)."""

    kind: str
    shift: float = 8.0
    """DMD: the flow shift of the training schedule its sigmas are read from."""
    sigma_max: float = 80.0
    """rCM: the starting noise level (TrigFlow ``tan``)."""

    @property
    def step_counts(self) -> tuple[int, ...]:
        """The step counts the release samples with."""
        return (len(DMD_TIMESTEPS),) if self.kind == "dmd" else (1, 2, 3, 4)

    def describe(self) -> str:
        if self.kind == "dmd":
            return f"DMD at the timesteps {'/'.join(map(str, DMD_TIMESTEPS))}"
        return f"rCM with sigma_max {self.sigma_max:g}"


def dmd(shift: float) -> FewStep:
    return FewStep(kind="dmd", shift=shift)


def rcm(sigma_max: float) -> FewStep:
    return FewStep(kind="rcm", sigma_max=sigma_max)


class FewStepFlowScheduler:
    """A few-step distilled sampler with the scheduler interface of diffusers' Wan pipelines."""

    order = 1

    def __init__(self, spec: FewStep, num_train_timesteps: int = 1000) -> None:
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.configuration_utils import FrozenDict

        self.spec = spec
        self.num_train_timesteps = num_train_timesteps
        if spec.kind == "dmd":
            train = FlowMatchEulerDiscreteScheduler(num_train_timesteps=num_train_timesteps, shift=spec.shift)
            self._train = (train.timesteps.double(), train.sigmas.double()[: len(train.timesteps)])
        elif spec.kind != "rcm":
            raise ValueError(f"unknown few-step sampler {spec.kind!r}")
        self.config = FrozenDict(num_train_timesteps=num_train_timesteps, few_step=dataclasses.asdict(spec))
        self.generators: list[torch.Generator] | None = None
        """Each batch row's generator for the fresh noise (set per batch; None: the global RNG)."""
        self.set_timesteps(spec.step_counts[-1])

    def levels(self, steps: int) -> list[float]:
        """The noise levels of ``steps`` steps, then 0."""
        if self.spec.kind == "dmd":
            timesteps, sigmas = self._train
            return [float(sigmas[(timesteps - t).abs().argmin()]) for t in DMD_TIMESTEPS] + [0.0]
        times = torch.tensor([math.atan(self.spec.sigma_max), *RCM_MID_TIMES[: steps - 1], 0.0], dtype=torch.float64)
        return (torch.sin(times) / (torch.cos(times) + torch.sin(times))).tolist()

    @property
    def initial_sigma(self) -> float:
        """What the starting ``N(0, 1)`` noise is scaled by (rCM: its first level)."""
        return self.levels(1)[0] if self.spec.kind == "rcm" else 1.0

    def set_timesteps(self, num_inference_steps: int, device: Any = None, **_kwargs) -> None:
        if num_inference_steps not in self.spec.step_counts:
            counts = ", ".join(map(str, self.spec.step_counts))
            raise ValueError(f"num_inference_steps must be one of {counts} for {self.spec.describe()}")
        levels = self.levels(num_inference_steps)
        self.sigmas = torch.tensor(levels, dtype=torch.float64)
        if self.spec.kind == "dmd":
            self.timesteps = torch.tensor(DMD_TIMESTEPS, dtype=torch.float32, device=device)
        else:
            self.timesteps = (self.sigmas[:-1] * self.num_train_timesteps).to(torch.float32).to(device)
        self._index = 0

    def set_begin_index(self, begin_index: int = 0) -> None:
        self._index = begin_index

    def step(self, model_output: torch.Tensor, timestep, sample: torch.Tensor, return_dict: bool = False, **_kwargs):
        """``x0`` from the flow prediction, noised again to the next level (the last step: ``x0``)."""
        sigma, sigma_next = float(self.sigmas[self._index]), float(self.sigmas[self._index + 1])
        self._index += 1
        x0 = sample.double() - sigma * model_output.double()
        if sigma_next == 0.0:
            return (x0.to(sample.dtype),)
        return (((1.0 - sigma_next) * x0 + sigma_next * self.noise_like(sample).double()).to(sample.dtype),)

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
