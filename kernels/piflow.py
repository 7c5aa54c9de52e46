"""PiFlow's policy rollout in one pass: one ``PiflowScheduler.step`` of diffusers, per element.

A PiFlow step integrates a network-free policy between two DiT evaluations: up to
``num_policy_substeps`` Euler substeps, each interpolating the model's ``n_grid`` predictions at
the current time. diffusers runs every substep as about fifteen broadcast PyTorch operations on
the whole latent, about 1,300 kernel launches per step (times: README, Performance). Every substep's time arithmetic is the
same for every element (one schedule per step), and every element's update reads only its own
``n_grid`` predictions, so the rollout is one elementwise pass: each element keeps its value in a
register through all substeps and reads the two predictions the current time interpolates.

Both functions here compute diffusers' step bit for bit: every operation in diffusers' order, in
float32, each rounded once (the Triton kernel is compiled without FMA contraction and divides with
IEEE rounding), and the result cast back to the sample's dtype. ``reference`` is that computation
in PyTorch; ``triton_rollout`` is the kernel; ``rollout`` picks the kernel for CUDA tensors when
Triton is importable.

Shapes: ``sample_NC`` (any leading dims, latent channels ``C`` last); ``output_NGC`` (the same
leading dims, ``n_grid * C`` last: prediction ``g`` of channel ``c`` at ``g * C + c``, the DiT's
channels-last widened output). ``PiflowStep`` holds the step's scalars (the diffusers schedule
values as Python floats, which are exact float32 values).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from tilecast.kernels.spatial_norm import triton_available


@dataclasses.dataclass(frozen=True)
class PiflowStep:
    """The schedule of one step: ``sigmas[i]``, ``raw[i]``, ``raw[i + 1]`` (``eps`` after the
    last step) and the scheduler's config values."""

    sigma_src: float
    raw_src: float
    raw_dst: float
    shift: float
    eps: float
    n_grid: int
    num_policy_substeps: int

    @property
    def num_substeps(self) -> int:
        """Euler substeps of this step: ``round((raw_src - raw_dst) * num_policy_substeps)``, at least 1."""
        delta = torch.tensor(self.raw_src, dtype=torch.float32) - torch.tensor(self.raw_dst, dtype=torch.float32)
        return int((delta * self.num_policy_substeps).round().to(torch.long).clamp(min=1))


def _check(sample_NC: torch.Tensor, output_NGC: torch.Tensor, step: PiflowStep) -> int:
    channels = sample_NC.shape[-1]
    if step.n_grid < 2:
        raise ValueError(f"PiFlow rollout needs n_grid >= 2, got {step.n_grid}")
    if output_NGC.shape[:-1] != sample_NC.shape[:-1] or output_NGC.shape[-1] != step.n_grid * channels:
        raise ValueError(
            f"PiFlow output {tuple(output_NGC.shape)} does not hold {step.n_grid} predictions per channel of "
            f"sample {tuple(sample_NC.shape)}"
        )
    return channels


def reference(sample_NC: torch.Tensor, output_NGC: torch.Tensor, step: PiflowStep) -> torch.Tensor:
    """The step in PyTorch, per element (what diffusers computes, with the schedule as scalars)."""
    channels = _check(sample_NC, output_NGC, step)
    f32 = functools.partial(torch.tensor, dtype=torch.float32)
    shift, eps, n_grid = step.shift, step.eps, step.n_grid
    sigma, raw_src, raw_dst = f32(step.sigma_src), f32(step.raw_src), f32(step.raw_dst)
    x = sample_NC.float()
    grid_GNC = output_NGC.unflatten(-1, (n_grid, channels)).movedim(-2, 0).float()
    x0_GNC = x - sigma * grid_GNC  # the policy's x_0 at each grid point (diffusers promotes to float32 too)

    def unwarp(sigma_t):
        return sigma_t / (shift + (1 - shift) * sigma_t)

    policy_raw_src = unwarp(sigma)
    policy_raw_dst = (policy_raw_src - (raw_src - raw_dst)).clamp(min=0)
    segment = (policy_raw_src - policy_raw_dst).clamp(min=eps)
    num_substeps = step.num_substeps
    substep = (raw_src - raw_dst) / num_substeps
    raw_t, sigma_t = raw_src, sigma
    for _ in range(num_substeps):
        t = ((unwarp(sigma_t) - policy_raw_dst) / segment).clamp(min=0, max=1) * (n_grid - 1)
        t0 = t.floor().to(torch.long).clamp(min=0, max=n_grid - 2)
        t1 = t0 + 1
        x0 = (t1 - t) * x0_GNC[int(t0)] + (t - t0) * x0_GNC[int(t1)]
        velocity = (x - x0) / sigma_t.clamp(min=eps)
        raw_t = (raw_t - substep).clamp(min=0)
        sigma_next = shift * raw_t / (1 + (shift - 1) * raw_t)
        x = x + velocity * (sigma_next - sigma_t)
        sigma_t = sigma_next
    return x.to(sample_NC.dtype)


@functools.cache
def _triton_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def piflow_rollout_kernel(
        sample_ptr,
        output_ptr,
        out_ptr,
        numel,
        channels,
        sigma,
        raw_src,
        raw_dst,
        shift,
        one_minus_shift,
        shift_minus_one,
        eps,
        num_substeps,
        N_GRID: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        grid_base = (offsets // channels) * (N_GRID * channels) + offsets % channels
        x_src = tl.load(sample_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        x = x_src
        # The step's schedule: the same scalar arithmetic in every program.
        policy_raw_src = tl.math.div_rn(sigma, shift + one_minus_shift * sigma)  # diffusers' _unwarp_t
        policy_raw_dst = tl.maximum(policy_raw_src - (raw_src - raw_dst), 0.0)
        segment = tl.maximum(policy_raw_src - policy_raw_dst, eps)
        substep = tl.math.div_rn(raw_src - raw_dst, num_substeps.to(tl.float32))
        raw_t = raw_src
        sigma_t = sigma
        for _ in range(num_substeps):
            raw_of_sigma = tl.math.div_rn(sigma_t, shift + one_minus_shift * sigma_t)
            t = tl.math.div_rn(raw_of_sigma - policy_raw_dst, segment)
            t = tl.minimum(tl.maximum(t, 0.0), 1.0) * (N_GRID - 1.0)
            t0 = tl.minimum(tl.maximum(tl.floor(t), 0.0), N_GRID - 2.0)
            t1 = t0 + 1.0
            p0 = tl.load(output_ptr + grid_base + t0.to(tl.int64) * channels, mask=mask, other=0.0).to(tl.float32)
            p1 = tl.load(output_ptr + grid_base + t1.to(tl.int64) * channels, mask=mask, other=0.0).to(tl.float32)
            x0 = (t1 - t) * (x_src - sigma * p0) + (t - t0) * (x_src - sigma * p1)
            velocity = tl.math.div_rn(x - x0, tl.maximum(sigma_t, eps))
            raw_t = tl.maximum(raw_t - substep, 0.0)
            sigma_next = tl.math.div_rn(shift * raw_t, 1.0 + shift_minus_one * raw_t)
            x = x + velocity * (sigma_next - sigma_t)
            sigma_t = sigma_next
        tl.store(out_ptr + offsets, x.to(out_ptr.dtype.element_ty), mask=mask)

    return piflow_rollout_kernel


def triton_rollout(sample_NC: torch.Tensor, output_NGC: torch.Tensor, step: PiflowStep) -> torch.Tensor:
    """``reference`` in one Triton kernel (CUDA tensors)."""
    import triton

    channels = _check(sample_NC, output_NGC, step)
    sample_NC, output_NGC = sample_NC.contiguous(), output_NGC.contiguous()
    out_NC = torch.empty_like(sample_NC)
    block = 1024
    _triton_kernel()[(triton.cdiv(sample_NC.numel(), block),)](
        sample_NC,
        output_NGC,
        out_NC,
        sample_NC.numel(),
        channels,
        step.sigma_src,
        step.raw_src,
        step.raw_dst,
        step.shift,
        1 - step.shift,
        step.shift - 1,
        step.eps,
        step.num_substeps,
        N_GRID=step.n_grid,
        BLOCK=block,
        num_warps=4,
        enable_fp_fusion=False,
    )
    return out_NC


def rollout(sample_NC: torch.Tensor, output_NGC: torch.Tensor, step: PiflowStep) -> torch.Tensor:
    """One PiFlow step: ``triton_rollout`` for CUDA tensors when Triton is importable, else ``reference``."""
    kernel = triton_rollout if sample_NC.is_cuda and triton_available() else reference
    return kernel(sample_NC, output_NGC, step)
