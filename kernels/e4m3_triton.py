"""Rounding to e4m3 in float32, for the Triton kernels that write e4m3; imported on first use
(importing it needs Triton)."""

import os

import triton
import triton.language as tl


def interpreted() -> bool:
    """Whether Triton runs its kernels in its interpreter, as Triton itself reads ``TRITON_INTERPRET``
    (``triton.knobs`` from Triton 3.4 on: ``1``, ``true``, ``on``...; before it, ``1`` only)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        return os.environ.get("TRITON_INTERPRET", "0") == "1"
    return knobs.runtime.interpret


@triton.jit
def round_to_e4m3(q):
    # float32 ``q`` (within +-448) rounded to the nearest e4m3 value, ties to even, still float32, so
    # a cast to e4m3 after it is exact: 3 mantissa bits where e4m3 is normal (a carry moves into the
    # exponent), multiples of 2^-9 below 2^-6 (its subnormals; adding 1.5 * 2^23 rounds to an
    # integer). The GPU's own conversion agrees; Triton's interpreter rounds without the carry
    # (0.496 -> 0.25, 127.3 -> 64), so kernels run there round with this first.
    bits = q.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    subnormal = ((q * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
    return tl.where(tl.abs(q) < 0.015625, subnormal, bits.to(tl.float32, bitcast=True))
