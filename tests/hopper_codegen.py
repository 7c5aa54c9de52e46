"""``python tests/hopper_codegen.py``: compile ``kernels/narrow_conv.py``'s kernel (plain and reuse) for sm_90 ahead of
time (no GPU needed) at the K-VAE decoder's layers, as the JIT specializes them there (pointers,
strides and the width divisible by 16), and print, as one JSON line, how often each operation that
matters for speed appears in their TTGIR, and the most warp-group products a wait in them leaves in
flight: ``{"<in_channels> <tiling>": {op: count, "in_flight": n}}``. Run without
``TRITON_INTERPRET`` (``tests/test_narrow_conv.py``)."""

from __future__ import annotations

import json
import re

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from tilecast.kernels.narrow_conv import Tiling, _triton_kernel, default_tiling, reuse_tiling

OPS = ("warp_group_dot", "async_copy_global_to_local")


def hopper_ttgir(in_channels: int, tiling: Tiling) -> str:
    kernel = _triton_kernel()
    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "stride_xb": "i64", "stride_yb": "i64"}
    constants = dict(CIN=in_channels, KT=3, KH=3, KW=3, KP=3 * in_channels, NP=16, PH=1, PW=1)
    constants |= dict(BH=tiling.bh, BW=tiling.bw, BK=tiling.bk, PRECISION="tf32", REUSE=tiling.reuse)
    names = kernel.arg_names
    aligned = [name for name in names if name.endswith("_ptr") or name.startswith("stride") or name == "width"]
    source = ASTSource(
        fn=kernel,
        signature={name: "constexpr" if name in constants else types.get(name, "i32") for name in names},
        constexprs={(names.index(name),): value for name, value in constants.items()},
        attrs={(names.index(name),): [["tt.divisibility", 16]] for name in aligned},
    )
    options = {"num_warps": tiling.num_warps, "num_stages": tiling.num_stages}
    return compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ttgir"]


if __name__ == "__main__":
    counts = {}
    for in_channels in (256, 16):
        for tiling in (default_tiling(in_channels), reuse_tiling(in_channels)):
            ttgir = hopper_ttgir(in_channels, tiling)
            pendings = [int(n) for n in re.findall(r"warp_group_dot_wait[^{]*\{pendings = (\d+)", ttgir)]
            counts[f"{in_channels} {tiling}"] = {op: ttgir.count(op) for op in OPS} | {"in_flight": max(pendings)}
    print(json.dumps(counts))
