"""8-bit attention with the log-sum-exp: INT8 Q·K and FP8 P·V on tensor cores (Triton); Q and K scaled per block, V per channel.

Opt-in (``--attention-backend fp8``), never what ``auto`` picks: the output moves by a few percent
where bf16 moves by 0.4% (tolerances: ``tests/test_fp8_attention.py``; ``tilecast bench attention``
/ ``bench step`` / ``bench k6sr`` print the PSNR against the bf16 path). The recipe is
SageAttention2's split: Q·K in INT8, P·V in FP8 e4m3. A float emulation on random inputs
(relative output error, log-sum-exp error) with logits of std 1 / 3 / 6: INT8 Q·K 3.7% / 3.8% / 4.4%
and 0.005 / 0.10 / 0.29, e4m3 Q·K 5.3% / 8.8% / 11% and 0.03 / 0.26 / 0.79: e4m3's 3 mantissa bits
make a score's error grow with its size, INT8's step is fixed per block.

How it quantizes (one Triton pass per tensor before the attention kernel; V's scales first take one
PyTorch reduction over its keys):
  * ``Q`` is first multiplied by ``scale * log2(e)`` (so scores come out in log2 units for
    ``exp2``); each block of ``QUANT_BLOCK`` rows of one head gets one float32 scale and int8
    values (rounded to nearest). ``K`` the same. A score is ``dot(q8, k8) * q_scale * k_scale``
    (int32 accumulation): one multiply per score, folded into the ``exp2``'s FMA. The int32 becomes a
    float without a conversion instruction: an integer add onto the bits of ``1.5 * 2^23`` makes it
    that float plus the score, exactly (so head dims stop at 256), and the offset joins the row's
    bias in the same FMA; the row maximum is taken on the integers. On an H100 that is as fast as the
    conversion at head dim 64 and 11-13% faster at 128 (47,616 tokens; with the row maximum in
    floats and a float subtraction per score the same trick measured slower: 478-486 against 522
    TFLOP/s). Computing ``exp2`` on the FMA pipe, a cubic on the fraction with the integer part
    added to the exponent bits, measured slower still: 335-338 against 500 TFLOP/s, head dim 64.
  * ``V``: e4m3 with one scale per channel of each head (its largest magnitude over all keys, over
    448), stored transposed (``D`` by keys): 8-bit tensor cores want the reduction dimension
    contiguous in both operands. With one scale for all keys, each key block's P·V product joins
    the output in the one multiply-add that rescales it (``acc * alpha + pv``), and V's scale is
    applied once at the end: with a scale per key block that was a multiply and a multiply-add per
    output value and block, 8.96 instructions per score in the loop's sm_90 SASS at head dim 64
    against 8.33 then.
  * ``P``: the softmax numerator is computed as ``exp2(s - m + log2(448))``, i.e. already on
    e4m3's range, so it is cast without a multiply; the row sum carries the same factor and cancels
    it in the division. The log-sum-exp removes it again. Its keys are reordered within every 16
    (V stored in the same order) so that the registers a thread holds of the Q·K product already
    are its part of P·V's 8-bit operand: no shuffles between threads (8.98 -> 8.23 instructions per
    score at head dim 64).
The buffers are padded to whole blocks with zeros, so every load in the loop is unmasked; only the
last key block masks its padding with ``-inf``. Under ``torch.compile`` the call is one opaque
custom op (``tilecast::fp8_attention``): Inductor does not recompile the Triton kernels.

Shapes: ``q_BSHD`` / ``k_BKHD`` / ``v_BKHD`` as every backend (``kernels/backends.py``); inside,
``BH`` is batch times heads, ``Sp``/``Kp`` the padded lengths, ``Dp`` the head dim padded to a power
of two (at least 32, the 8-bit dots' smallest reduction).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import torch

from .fp8 import E4M3_MAX
from .opaque_attention import opaque_attention

LOG2E = 1.4426950408889634
"""Q is pre-multiplied by it (with the softmax scale): the kernel's scores are in log2 units, for ``exp2``."""
MIN_CUDA_CAPABILITY = (8, 9)
"""FP8 tensor cores: Ada (8.9) and Hopper (9.0) or newer."""
QUANT_BLOCK = 128
"""Rows per Q scale and per K scale (one block of one head); the buffers are padded to it."""


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """The attention kernel's tiling: ``block_m`` query rows per program, ``block_n`` keys per step
    (both divide ``QUANT_BLOCK``), Triton's warps and pipeline stages, and a cap on registers per
    thread (``max_registers``; 0: the compiler's choice), which decides how many programs share an SM."""

    block_m: int = 64
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3
    max_registers: int = 0

    @classmethod
    def parse(cls, text: str) -> "KernelConfig":
        """``"128x64w4s3"``: ``block_m`` x ``block_n``, warps, stages, optionally ``r<registers>``
        (``ValueError`` naming the form)."""
        match = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)(?:r(\d+))?", text.strip())
        if match is None:
            raise ValueError(
                f"fp8 kernel config {text!r}: write it as BLOCK_MxBLOCK_NwWARPSsSTAGES[rREGISTERS], e.g. 64x128w4s3"
            )
        config = cls(*(int(group or 0) for group in match.groups()))
        if QUANT_BLOCK % config.block_m or QUANT_BLOCK % config.block_n:
            raise ValueError(f"fp8 kernel config {text!r}: BLOCK_M and BLOCK_N must divide {QUANT_BLOCK}")
        if config.block_m < 16 or config.block_n < 32:
            raise ValueError(f"fp8 kernel config {text!r}: 8-bit products need BLOCK_M >= 16 and BLOCK_N >= 32")
        if match.group(5) is not None and not 24 <= config.max_registers <= 255:
            # ptxas raises a smaller cap to 24 and cannot give a thread more than 255: not honoured
            raise ValueError(f"fp8 kernel config {text!r}: a register cap runs from r24 to r255")
        return config

    def compile_options(self) -> dict:
        """Triton's launch options for this tiling (the register cap only when set: ``maxnreg``)."""
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        return options | ({"maxnreg": self.max_registers} if self.max_registers else {})

    def __str__(self) -> str:
        registers = f"r{self.max_registers}" if self.max_registers else ""
        return f"{self.block_m}x{self.block_n}w{self.num_warps}s{self.num_stages}{registers}"


def default_config(head_dim: int) -> KernelConfig:
    """The tiling measured on an H100 (``tilecast bench attention``, 2026-12-07): 64 query rows a
    program, 4 warps, 3 stages, at every head dim. Against 128 rows (4 warps at head dim 64, 8 above),
    47,616 / 13,824 tokens: head dim 64 about the same / 2.88-3.12 against 3.40-3.84 ms, head dim 128
    22.2-22.5 against 22.6-23.0 / 2.21-2.22 against 2.63-2.71 ms. Two stages capped at 128 registers
    (``64x128w4s2r128``: 4 programs an SM against 3 at head dim 64) measured within two rounds' noise
    of it (26.88-27.05 against 26.88-27.29 ms at 47,616 tokens) and spills inside the key loop under
    Triton 3.9 (not under 3.6): not the default. At head dim 128 a cap spills (r168)."""
    return KernelConfig()


def unavailable_reason() -> str | None:
    """Why the FP8 kernel cannot run here, or ``None`` when it can."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "backend 'fp8' needs Triton, which is not installed"
    if not torch.cuda.is_available():
        return "backend 'fp8' needs a CUDA GPU, which is not available"
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CUDA_CAPABILITY:
        return f"backend 'fp8' needs FP8 tensor cores (compute capability 8.9 or newer), this GPU has {capability}"
    return None


MAX_HEAD_DIM = 256
"""int8 Q·K sums stay below 2^22 in magnitude up to here (127 * 127 * 256), where the kernel's
integer-add conversion to float is exact."""


def padded_head_dim(head_dim: int) -> int:
    """The head dim the kernels run at: the next power of two, at least 32."""
    return max(32, 1 << (head_dim - 1).bit_length())


@functools.cache
def _kernels():
    """The Triton kernels, imported on first use: importing this module needs no Triton."""
    from tilecast.kernels import fp8_attention_triton as kernels

    return kernels.quantize_blocks, kernels.attend


def _quantize(x_BSHD: torch.Tensor, dp: int, *, multiplier: float = 1.0, transposed: bool = False):
    """``(x8, scales)``: int8 ``[BH, Sp, Dp]`` with float32 scales ``[BH, blocks]``, or (``transposed``,
    for V) e4m3 ``[BH, Dp, Sp]`` with a scale per channel, ``[BH, Dp]`` (padded channels: 1)."""
    from .e4m3_triton import interpreted

    quantize_blocks, _ = _kernels()
    batch, length, heads, head_dim = x_BSHD.shape
    if x_BSHD.stride(-1) != 1:
        x_BSHD = x_BSHD.contiguous()
    block = QUANT_BLOCK
    blocks = math.ceil(length / block)
    padded = blocks * block
    if transposed:
        out = torch.empty(batch * heads, dp, padded, device=x_BSHD.device, dtype=torch.float8_e4m3fn)
        amax_BHD = torch.linalg.vector_norm(x_BSHD, float("inf"), dim=1)  # exact in x's dtype: no copy of x
        scales = torch.ones(batch * heads, dp, device=x_BSHD.device, dtype=torch.float32)
        scales[:, :head_dim] = (amax_BHD.float() * abs(multiplier) / E4M3_MAX).clamp_min(1e-12).flatten(0, 1)
        strides = (dp * padded, 1, padded)
    else:
        out = torch.empty(batch * heads, padded, dp, device=x_BSHD.device, dtype=torch.int8)
        scales = torch.empty(batch * heads, blocks, device=x_BSHD.device, dtype=torch.float32)
        strides = (padded * dp, dp, 1)
    quantize_blocks[(blocks, batch * heads)](
        x_BSHD,
        out,
        scales,
        length,
        heads,
        x_BSHD.stride(0),
        x_BSHD.stride(1),
        x_BSHD.stride(2),
        *strides,
        multiplier,
        head_dim=head_dim,
        BLOCK=block,
        DP=dp,
        PER_CHANNEL=transposed,
        INTERPRETED=interpreted(),
        num_warps=4,
        enable_fp_fusion=True,
    )
    return out, scales


def run_kernels(
    q_BSHD: torch.Tensor,
    k_BKHD: torch.Tensor,
    v_BKHD: torch.Tensor,
    *,
    scale: float,
    config: KernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The three quantization passes and the attention kernel, tiled by ``config`` (default:
    ``default_config``)."""
    batch, num_q, heads, head_dim = q_BSHD.shape
    if v_BKHD.shape[-1] != head_dim:
        raise ValueError(f"fp8 attention needs V's head dim ({v_BKHD.shape[-1]}) equal to Q's ({head_dim})")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"fp8 attention runs head dims up to {MAX_HEAD_DIM}, this one is {head_dim}")
    from .e4m3_triton import interpreted

    _, attend = _kernels()
    config = config or default_config(head_dim)
    num_k = k_BKHD.shape[1]
    if num_k == 0:  # attention over no key: zero output, -inf log-sum-exp (an empty part to Ring's merge)
        lse = torch.full((batch, heads, num_q), -math.inf, device=q_BSHD.device, dtype=torch.float32)
        return torch.zeros_like(q_BSHD), lse
    dp = padded_head_dim(head_dim)
    q8, q_scales = _quantize(q_BSHD, dp, multiplier=scale * LOG2E)
    k8, k_scales = _quantize(k_BKHD, dp)
    vt8, v_scales = _quantize(v_BKHD, dp, transposed=True)
    out = torch.empty_like(q_BSHD)
    lse = torch.empty(batch, heads, num_q, device=q_BSHD.device, dtype=torch.float32)
    attend[(math.ceil(num_q / config.block_m), batch * heads)](
        q8,
        k8,
        vt8,
        q_scales,
        k_scales,
        v_scales,
        out,
        lse,
        num_q,
        num_k,
        q8.shape[1],
        k8.shape[1],
        heads,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        head_dim=head_dim,
        DP=dp,
        QUANT=QUANT_BLOCK,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        INTERPRETED=interpreted(),
        enable_fp_fusion=True,
        **config.compile_options(),
    )
    return out, lse


fp8_attention = opaque_attention("fp8_attention", run_kernels)
"""``(out_BSHD, lse_BHS)`` as every backend, on 8-bit tensor cores (int32 / fp32 accumulation, fp32
softmax), as one custom op; ``out`` has ``q``'s dtype, ``lse`` is float32 in natural-log units."""
