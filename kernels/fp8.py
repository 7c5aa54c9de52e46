"""FP8 linear layers: e4m3 weights with a scale per output channel, activations with a scale per row.

``Fp8Linear`` replaces an ``nn.Linear`` for inference. Its weight is quantized once, at install,
to ``float8_e4m3fn`` with one float32 scale per output row (``w_NK ~ w8_NK * scale_N1``). Each call
quantizes its input the same way, one scale per token row, and runs ``torch._scaled_mm``: on
Hopper, cuBLAS' FP8 tensor cores, accumulating in float32, applying both scales and the bias in
the epilogue, and writing bf16 (the input's dtype on CPU). Eager, the row quantization is extra
memory passes; under ``torch.compile`` Inductor fuses it (speeds: README, Performance).

Accuracy: e4m3 keeps 3 mantissa bits, so each product is rounded to about 6% and a layer's output
moves by a few percent of its scale, against bf16's 0.4%. That is an opt-in precision trade
(``--quantize fp8``), never a default: ``tests/test_fp8.py`` and the CUDA tests state the
tolerance, and ``tilecast bench step`` prints the difference it makes on the real model.

Shape legend: ``M`` rows (tokens), ``K`` input features, ``N`` output features.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
"""Largest finite e4m3 value (448): a row's largest magnitude maps onto it."""
ALIGNMENT = 16
"""``_scaled_mm`` needs both feature counts to be multiples of this; other layers stay as they are."""
MIN_CUDA_CAPABILITY = (8, 9)
"""FP8 tensor cores: Ada (8.9) and Hopper (9.0) or newer."""


def to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` rounded to e4m3, saturating at its largest finite value (``scale`` broadcasts)."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_rows(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_MK, scale_M1)``: e4m3 values and float32 scales with ``x ~ q * scale``, one scale per row.

    An all-zero row gets a tiny scale, so it quantizes to zeros instead of dividing by zero."""
    amax_M1 = x_MK.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale_M1 = amax_M1 / E4M3_MAX
    return to_e4m3(x_MK, scale_M1), scale_M1


@functools.cache
def cpu_scaled_mm_error(out_dtype: torch.dtype = torch.float32) -> str | None:
    """``None`` where this PyTorch runs ``Fp8Linear``'s row-scaled ``_scaled_mm`` (with a bias) on the
    CPU into ``out_dtype``, else the first line of its error (not every release has that CPU path)."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(
            a,
            a.t(),
            scale_a=torch.ones(16, 1),
            scale_b=torch.ones(1, 16),
            bias=torch.zeros(16, dtype=out_dtype),
            out_dtype=out_dtype,
        )
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return None


def check_supported(device: torch.device, dtype: torch.dtype = torch.float32) -> None:
    """Raise ``ValueError`` naming why FP8 matmuls cannot run on ``device`` (CPU runs them, slowly,
    where this PyTorch has the CPU path, for activations of ``dtype``)."""
    if device.type == "cpu":
        error = cpu_scaled_mm_error(dtype)
        if error is not None:
            raise ValueError(
                f"--quantize fp8 on the CPU needs PyTorch's CPU torch._scaled_mm with row scales, which "
                f"torch {torch.__version__} refuses for {dtype}: {error}"
            )
    elif device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CUDA_CAPABILITY:
            raise ValueError(
                f"--quantize fp8 needs FP8 tensor cores (compute capability >= 8.9); "
                f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}"
            )
    else:
        raise ValueError(f"--quantize fp8 runs on cuda or cpu, not {device.type}")


class Fp8Linear(nn.Module):
    """``nn.Linear``'s function with e4m3 weights and per-row activation scales (see the module doc)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if self.in_features % ALIGNMENT or self.out_features % ALIGNMENT:
            raise ValueError(
                f"Fp8Linear needs feature counts that are multiples of {ALIGNMENT}, "
                f"got {self.in_features} -> {self.out_features}"
            )
        weight_q_NK, weight_scale_N1 = quantize_rows(linear.weight.detach())
        self.register_buffer("weight_q_NK", weight_q_NK)
        self.register_buffer("weight_scale_1N", weight_scale_N1.t().contiguous())
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_q_MK, x_scale_M1 = quantize_rows(x.reshape(-1, self.in_features))
        # cuBLAS' row-scaled FP8 GEMM writes bf16 only; CPU writes any float dtype.
        out_dtype = x.dtype if x.device.type == "cpu" else torch.bfloat16
        y_MN = torch._scaled_mm(
            x_q_MK,
            self.weight_q_NK.t(),
            scale_a=x_scale_M1,
            scale_b=self.weight_scale_1N,
            bias=None if self.bias is None else self.bias.to(out_dtype),
            out_dtype=out_dtype,
        )
        return y_MN.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """What ``forward`` computes, in float32: the product of the dequantized operands plus the
        bias, before the output rounding (the tests' yardstick)."""
        x_q_MK, x_scale_M1 = quantize_rows(x.reshape(-1, self.in_features))
        weight_NK = self.weight_q_NK.float() * self.weight_scale_1N.t()
        y_MN = (x_q_MK.float() * x_scale_M1) @ weight_NK.t()
        if self.bias is not None:
            y_MN = y_MN + self.bias.float()
        return y_MN.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_linears(root: nn.Module, *, keep: Callable[[str], bool] = lambda name: False) -> int:
    """Replace every ``nn.Linear`` under ``root`` by an ``Fp8Linear`` in place; returns how many.

    Skipped: layers named (relative to ``root``) where ``keep(name)`` is true, and layers whose
    feature counts ``_scaled_mm`` cannot take. The bf16 weights are released as each layer is
    replaced, so memory shrinks instead of growing."""
    targets = [
        (name, module)
        for name, module in root.named_modules()
        if type(module) is nn.Linear
        and not keep(name)
        and not module.in_features % ALIGNMENT
        and not module.out_features % ALIGNMENT
    ]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        setattr(parent, child, Fp8Linear(linear))
    return len(targets)
