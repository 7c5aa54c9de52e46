"""``python tests/hopper_codegen.py``: compile ``kernels/narrow_conv.py``'s kernel (plain and reuse) for sm_90 ahead of
time (no GPU needed) at the K-VAE decoder's layers, as the JIT specializes them there (pointers,
strides and the width divisible by 16), and print, as one JSON line, how often each operation that
matters for speed appears in their TTGIR, and the most warp-group products a wait in them leaves in
flight: ``{"<in_channels> <tiling>": {op: count, "in_flight": n}}``. Run without
``TRITON_INTERPRET`` (``tests/test_narrow_conv.py``).

``python tests/hopper_codegen.py rows``: the K-VAE decoder's memory-bound kernels (spatial norm in
bf16 and e4m3, phase interleave, frame repeat, bias add) in sm_90 SASS, disassembled with the
``nvdisasm`` Triton ships, as ``{"<kernel> <channels>": {"per_value": instructions per value a
thread computes, "calls": subroutine calls}}`` (a 64-bit division per pixel compiles to a call;
``tests/test_triton_kernels.py``).

``python tests/hopper_codegen.py attention``: ``kernels/fp8_attention.py``'s attention kernel at head
dim 64 and 128 (default tiling) in sm_90 SASS, as ``{"fp8 <head dim>": {"per_score": instructions per
score in its key loop, "ops": the commonest opcodes per score, "stack": its stack frame in bytes,
"loop_spills": local-memory loads and stores in the loop, "conversions" / "shuffles": its integer-to-float conversions / warp shuffles per score}}``
(``tests/test_fp8_attention.py``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from tilecast.kernels import channel_bias, spatial_norm, upsample
from tilecast.kernels.narrow_conv import Tiling, _triton_kernel, default_tiling, reuse_tiling

OPS = ("warp_group_dot", "async_copy_global_to_local")


def hopper_compile(kernel, types: dict[str, str], constants: dict, aligned: list[str], **options):
    """``kernel`` compiled for sm_90: arguments ``i32`` unless ``types`` says otherwise, ``constants``
    as constexprs, the ``aligned`` ones marked divisible by 16 (as the JIT sees them at the decoder's sizes),
    FP fusion on as every launch in ``kernels/`` asks for it."""
    names = kernel.arg_names
    source = ASTSource(
        fn=kernel,
        signature={name: "constexpr" if name in constants else types.get(name, "i32") for name in names},
        constexprs={(names.index(name),): value for name, value in constants.items()},
        attrs={(names.index(name),): [["tt.divisibility", 16]] for name in aligned},
    )
    return compile(source, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": True} | options)


def hopper_ttgir(in_channels: int, tiling: Tiling) -> str:
    kernel = _triton_kernel()
    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "stride_xb": "i64", "stride_yb": "i64"}
    constants = dict(CIN=in_channels, KT=3, KH=3, KW=3, KP=3 * in_channels, NP=16, PH=1, PW=1)
    constants |= dict(BH=tiling.bh, BW=tiling.bw, BK=tiling.bk, PRECISION="tf32", REUSE=tiling.reuse)
    aligned = [
        name for name in kernel.arg_names if name.endswith("_ptr") or name.startswith("stride") or name == "width"
    ]
    compiled = hopper_compile(
        kernel, types, constants, aligned, num_warps=tiling.num_warps, num_stages=tiling.num_stages
    )
    return compiled.asm["ttgir"]


INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")
"""An instruction line of ``nvdisasm -c``: its opcode (without modifiers, after any predicate)."""


def cubin_tool(tool: str, option: str, cubin: bytes) -> str:
    """What Triton's own ``tool`` (``nvdisasm``, ``cuobjdump``) prints for ``cubin`` with ``option``."""
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run([path, option, file.name], capture_output=True, text=True, check=True).stdout


def disassemble(cubin: bytes) -> str:
    """``nvdisasm -c`` of ``cubin``."""
    return cubin_tool("nvdisasm", "-c", cubin)


def hopper_sass(kernel, types: dict[str, str], constants: dict, num_warps: int) -> list[str]:
    """``hopper_compile`` of ``kernel`` (pointers and ``channels`` / ``frame_size`` aligned), disassembled:
    one opcode per instruction."""
    aligned = [name for name in kernel.arg_names if name.endswith("_ptr") or name in ("channels", "frame_size")]
    listing = disassemble(hopper_compile(kernel, types, constants, aligned, num_warps=num_warps).asm["cubin"])
    return [match.group(1) for line in listing.splitlines() if (match := INSTRUCTION.match(line))]


def largest_loop(listing: str) -> list[str]:
    """The opcodes of the longest loop in an ``nvdisasm -c`` listing: from a label to the last branch
    back to it."""
    ops, labels, longest = [], {}, []
    for line in listing.splitlines():
        if label := re.match(r"^\s*(\.L_x_\d+):", line):
            labels[label.group(1)] = len(ops)
        elif match := INSTRUCTION.match(line):
            ops.append(match.group(1))
            target = re.search(r"(\.L_x_\d+)", line) if match.group(1) == "BRA" else None
            if target and target.group(1) in labels and len(ops) - labels[target.group(1)] > len(longest):
                longest = ops[labels[target.group(1)] :]
    return longest


def fp8_attention_sass(head_dim: int) -> dict:
    """``kernels/fp8_attention.py``'s attention kernel at ``head_dim`` and its default tiling, in sm_90
    SASS: its key loop's instructions per score a thread computes (``per_score``), the five commonest
    opcodes' share of that, the stack frame in bytes (spilled registers) and the local-memory loads
    and stores in the loop (``loop_spills``)."""
    from tilecast.kernels import fp8_attention, fp8_attention_triton

    config = fp8_attention.default_config(head_dim)
    dp = fp8_attention.padded_head_dim(head_dim)
    kernel = fp8_attention_triton.attend
    types = {"q_ptr": "*i8", "k_ptr": "*i8", "vt_ptr": "*fp8e4nv", "out_ptr": "*bf16"}
    types |= {name: "*fp32" for name in ("qs_ptr", "ks_ptr", "vs_ptr", "lse_ptr")}
    constants = dict(head_dim=head_dim, DP=dp, QUANT=fp8_attention.QUANT_BLOCK)
    constants |= dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, INTERPRETED=False)
    aligned = [name for name in kernel.arg_names if name.endswith("_ptr") or name.startswith(("stride", "padded"))]
    compiled = hopper_compile(kernel, types, constants, aligned, **config.compile_options())
    loop = largest_loop(disassemble(compiled.asm["cubin"]))
    scores = config.block_m * config.block_n / (32 * config.num_warps)  # per thread and key block
    common = Counter(loop).most_common(5)
    stack = re.search(r"STACK:(\d+)", cubin_tool("cuobjdump", "-res-usage", compiled.asm["cubin"]))
    return {
        "per_score": round(len(loop) / scores, 2),
        "ops": {op: round(count / scores, 2) for op, count in common},
        "stack": int(stack.group(1)) if stack else None,
        "loop_spills": sum(op.startswith(("LDL", "STL")) for op in loop),
        "conversions": round(sum(op.startswith("I2F") for op in loop) / scores, 3),
        "shuffles": round(sum(op.startswith("SHFL") for op in loop) / scores, 3),
    }


def row_kernel_sass(channels: int) -> dict[str, dict[str, float]]:
    """SASS counts of the decoder's memory-bound kernels at ``channels`` (bf16), as their launchers tile them."""
    bf16 = {name: "*bf16" for name in ("h_ptr", "h_bias_ptr", "gamma_ptr", "y_ptr", "b_ptr", "out_ptr", "x_ptr")}
    bf16 |= {"bias_ptr": "*bf16", "residual_ptr": "*bf16", "out_scale_ptr": "*fp32", "scale": "fp32"}
    _, block_c, cols = spatial_norm.line_tiling(1, 768, channels)
    _, _, rows = spatial_norm.row_tiling(1, channels)
    norm = dict(RW=2, HAS_BIAS=True, INTERPRETED=False, BLOCK_C=block_c, COLS=cols)
    norm_warps = spatial_norm.num_warps(block_c)
    kernels = {  # name: (kernel, types, constants, warps, values per program)
        "norm": (spatial_norm._triton_kernel(), bf16, norm | {"E4M3": False}, norm_warps, cols * block_c),
        "norm_e4m3": (
            spatial_norm._triton_kernel(),
            bf16 | {"out_ptr": "*fp8e4nv"},
            norm | {"E4M3": True},
            norm_warps,
            cols * block_c,
        ),
        "interleave": (upsample._triton_phases_kernel(), bf16, dict(BLOCK_C=block_c, COLS=cols), 4, cols * block_c),
        "repeat": (upsample._triton_kernel(), bf16, dict(BLOCK=upsample.FRAME_BLOCK), 4, upsample.FRAME_BLOCK),
        "add_bias": (
            channel_bias._triton_kernel(),
            bf16,
            dict(HAS_RESIDUAL=True, BLOCK_C=block_c, ROWS=rows),
            4,
            rows * block_c,
        ),
    }
    counts = {}
    for name, (kernel, types, constants, warps, values) in kernels.items():
        ops = hopper_sass(kernel, types, constants, warps)
        per_thread = values / (32 * warps)
        counts[f"{name} {channels}"] = {"per_value": round(len(ops) / per_thread, 1), "calls": ops.count("CALL")}
    return counts


if __name__ == "__main__" and sys.argv[1:] == ["attention"]:
    print(json.dumps({f"fp8 {head_dim}": fp8_attention_sass(head_dim) for head_dim in (64, 128)}))
elif __name__ == "__main__" and sys.argv[1:] == ["rows"]:
    print(json.dumps({key: value for channels in (16, 256, 2048) for key, value in row_kernel_sass(channels).items()}))
elif __name__ == "__main__":
    counts = {}
    for in_channels in (256, 16):
        for tiling in (default_tiling(in_channels), reuse_tiling(in_channels)):
            ttgir = hopper_ttgir(in_channels, tiling)
            pendings = [int(n) for n in re.findall(r"warp_group_dot_wait[^{]*\{pendings = (\d+)", ttgir)]
            counts[f"{in_channels} {tiling}"] = {op: ttgir.count(op) for op in OPS} | {"in_flight": max(pendings)}
    print(json.dumps(counts))
