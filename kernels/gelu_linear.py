"""A linear layer and the tanh-approximated GELU after it, as one cuBLASLt call on CUDA.

``GeluLinear(linear)`` computes ``F.gelu(linear(x), approximate="tanh")`` with ``linear``'s own
weight and bias (shared, not copied). On CUDA it is ``torch._addmm_activation(..., use_gelu=True)``:
cuBLASLt applies the bias and the GELU in the matrix multiply's epilogue, so the product is written
once, already activated, instead of written, read back by a separate bias-and-GELU kernel and
written again. Inductor keeps that call as it is (a fallback kernel, not decomposed), so the fusion
survives ``--compile`` and CUDA graphs. Elsewhere (the CPU, where ``_addmm_activation`` applies the
exact GELU instead) it is the two PyTorch operations.

cuBLASLt's epilogue is the same tanh formula evaluated in float32 on the float32 accumulator
before the output rounding; PyTorch's rounds the product to the output dtype first. The two differ
by at most an output rounding (``tests/test_gelu_linear.py``).

Shapes: ``x_MK`` (rows, input features); ``weight_NK`` as ``nn.Linear`` stores it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

EPILOGUE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Dtypes cuBLASLt's bias-and-GELU epilogue takes."""


class GeluLinear(nn.Module):
    """``gelu_tanh(linear(x))`` as one kernel on CUDA (see the module doc); weight and bias are ``linear``'s."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if linear.bias is None:
            raise ValueError("GeluLinear needs a linear layer with a bias (cuBLASLt's epilogue adds it)")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dtype in EPILOGUE_DTYPES:
            x_MK = x.reshape(-1, self.in_features)
            y_MN = torch._addmm_activation(self.bias, x_MK, self.weight.t(), use_gelu=True)
            return y_MN.reshape(*x.shape[:-1], self.out_features)
        return F.gelu(F.linear(x, self.weight, self.bias), approximate="tanh")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, activation=gelu_tanh"
