"""``tilecast bench``: benchmarks (not tests), each comparing with its peer in the same run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks against their peers, ratios in one run.")
console = Console(width=max(160, Console().width))


def _save(rows: list[dict], path: Optional[Path]) -> None:
    if path is not None:
        path.write_text(json.dumps(rows, indent=2))
        console.print(f"saved {path}")


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.2e}" if 0 < abs(value) < 0.01 else f"{value:.3f}"
    return "" if value is None else str(value)


def _print_rows(rows: list[dict], columns: list[str], title: str, json_out: Optional[Path]) -> None:
    """Print ``rows`` as a table of ``columns``, then save them as JSON when asked."""
    table = Table(*columns, title=title)
    for row in rows:
        table.add_row(*(_fmt(row.get(c)) for c in columns))
    console.print(table)
    _save(rows, json_out)


@bench_app.command("k6sr")
def k6sr(
    workload: Annotated[list[str], typer.Option("--workload", help="small (384x256x33) | large (768x512x121), x2.")] = ["small"],  # noqa: B006
    peer: Annotated[str, typer.Option("--peer", help="diffusers | none.")] = "diffusers",
    repeats: Annotated[int, typer.Option("--repeats", help="Timed requests after one warm-up.")] = 1,
    compile_blocks: Annotated[bool, typer.Option("--compile", help="torch.compile tilecast's DiT blocks (compile time is in the warm-up).")] = False,
    json_out: Annotated[Optional[Path], typer.Option("--json-out", help="Write the rows as JSON.")] = None,
) -> None:
    """Released-size Kandinsky 6 SR (random weights): tilecast vs diffusers' pipeline, per stage."""
    from tilecast.runtime.k6sr.bench import STAGES, WORKLOADS, bench_k6sr

    for name in workload:
        if name not in WORKLOADS:
            raise typer.BadParameter(f"--workload {name!r}: choose from {', '.join(WORKLOADS)}")
    if peer not in ("diffusers", "none"):
        raise typer.BadParameter(f"--peer {peer!r}: choose diffusers or none")
    rows = bench_k6sr(list(workload), peer=None if peer == "none" else peer, repeats=repeats,
                      compile_blocks=compile_blocks)
    columns = ["workload", "side", "e2e_s", *(f"{s}_s" for s in (*STAGES, "other")), "peak_reserved_gib",
               "ratio_vs_diffusers", "psnr_vs_diffusers_db"]
    _print_rows(rows, columns, "Kandinsky 6 SR x2, one H200-class GPU", json_out)


@bench_app.command("attention")
def attention(
    seq_len: Annotated[list[int], typer.Option("--seq-len")] = [13_824, 47_616],  # noqa: B006
    head_dim: Annotated[list[int], typer.Option("--head-dim")] = [64, 128],  # noqa: B006
    iters: Annotated[int, typer.Option("--iters")] = 10,
    json_out: Annotated[Optional[Path], typer.Option("--json-out")] = None,
) -> None:
    """Forward TFLOP/s of every available attention backend (with log-sum-exp)."""
    from tilecast.kernels.backends import resolve_backend
    from tilecast.kernels.bench import H200_DENSE_BF16_TFLOPS, bench_attention

    import torch

    rows = bench_attention(tuple(seq_len), tuple(head_dim), iters=iters)
    table = Table("backend", "head_dim", "seq_len", "ms", "TFLOP/s", "of 989 peak", "note",
                  title=f"attention forward, bf16 (peak {H200_DENSE_BF16_TFLOPS:.0f} TFLOP/s)")
    for row in rows:
        table.add_row(row["backend"], str(row["head_dim"]), str(row["seq_len"]), _fmt(row.get("ms")),
                      _fmt(row.get("tflops")), _fmt(row.get("of_peak")), row.get("error", ""))
    console.print(table)
    console.print(f"default backend here: {resolve_backend(None, torch.device('cuda'), torch.bfloat16)}")
    _save(rows, json_out)


@bench_app.command("step")
def step(
    model_path: Annotated[str, typer.Option("--model-path", help="tiny/flux (CPU) | random/flux (released size, GPU).")] = "tiny/flux",
    width: Annotated[int, typer.Option("--width")] = 512,
    height: Annotated[int, typer.Option("--height")] = 512,
    batch_size: Annotated[list[int], typer.Option("--batch-size", help="Repeat for several.")] = [1],  # noqa: B006
    device: Annotated[str, typer.Option("--device")] = "cpu",
    dtype: Annotated[str, typer.Option("--dtype", help="float32 | bfloat16 | float16.")] = "float32",
    compile_blocks: Annotated[bool, typer.Option("--compile", help="Compile tilecast's transformer blocks (compile time is in the warm-up).")] = False,
    attention_backend: Annotated[Optional[str], typer.Option("--attention-backend", help="tilecast's attention kernel (default: the fastest).")] = None,
    quantize: Annotated[Optional[str], typer.Option("--quantize", help="fp8: tilecast's blocks with FP8 linear layers (diffusers' side stays in --dtype).")] = None,
    cuda_graphs: Annotated[bool, typer.Option("--cuda-graphs", help="Replay tilecast's forward as a CUDA graph (captured in the warm-up).")] = False,
    iters: Annotated[int, typer.Option("--iters")] = 10,
    json_out: Annotated[Optional[Path], typer.Option("--json-out")] = None,
) -> None:
    """One FLUX denoising step: diffusers' eager transformer vs tilecast's fast paths, same model, one run."""
    from tilecast.runtime.config import DTYPES
    from tilecast.runtime.families.bench_step import run_step_bench

    if dtype not in DTYPES:
        raise typer.BadParameter(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    try:  # a ValueError names the bad option
        rows = run_step_bench(model_path, width=width, height=height, batch_sizes=list(batch_size), device=device,
                              dtype=dtype, compile_blocks=compile_blocks, attention_backend=attention_backend,
                              quantize=quantize, cuda_graphs=cuda_graphs, iters=iters)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    columns = ["batch", "tflop", "diffusers_ms", "tilecast_ms", "ratio", "tilecast_ms_per_image", "diffusers_tflops",
               "tilecast_tflops", "tilecast_warmup_s", "max_rel_diff", "psnr_db"]
    _print_rows(rows, columns, f"FLUX step: {model_path} {width}x{height}, {dtype}, {device}"
                               f"{', compiled' if compile_blocks else ''}{f', {quantize}' if quantize else ''}"
                               f"{', CUDA graphs' if cuda_graphs else ''}", json_out)


@bench_app.command("batching")
def batching(
    model_path: Annotated[str, typer.Option("--model-path", help="tiny/flux (CPU), random/flux (released size, GPU), ...")] = "tiny/flux",
    num_clients: Annotated[int, typer.Option("--num-clients", help="Concurrent clients.")] = 8,
    requests_per_client: Annotated[int, typer.Option("--requests-per-client")] = 3,
    width: Annotated[int, typer.Option("--width")] = 64,
    height: Annotated[int, typer.Option("--height")] = 64,
    steps: Annotated[int, typer.Option("--steps")] = 2,
    device: Annotated[str, typer.Option("--device")] = "cpu",
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="Passed to the servers (and the peer): float32 | bfloat16 | float16.")] = None,
    num_gpus: Annotated[int, typer.Option("--num-gpus")] = 1,
    batching_max_size: Annotated[int, typer.Option("--batching-max-size", help="Largest merged batch of the dynamic server.")] = 8,
    batching_delay_ms: Annotated[float, typer.Option("--batching-delay-ms")] = 20.0,
    peer: Annotated[str, typer.Option("--peer", help="diffusers: also time diffusers' pipeline one request at a time and with the whole batch offline | none.")] = "none",
    compile_blocks: Annotated[bool, typer.Option("--compile", help="Serve with --compile (the peer stays eager, as diffusers ships).")] = False,
    quantize: Annotated[Optional[str], typer.Option("--quantize", help="Serve with --quantize (fp8; the peer stays in --dtype).")] = None,
    cuda_graphs: Annotated[bool, typer.Option("--cuda-graphs", help="Serve with --cuda-graphs (the peer stays eager).")] = False,
    json_out: Annotated[Optional[Path], typer.Option("--json-out")] = None,
) -> None:
    """N concurrent clients against one server: --batching-max-size 1 versus dynamic, in one run."""
    from tilecast.runtime.families.bench_batching import run_batching_bench

    try:  # a ValueError names the bad option
        result = run_batching_bench(
            model_path, num_clients=num_clients, requests_per_client=requests_per_client, width=width,
            height=height, steps=steps, device=device, num_gpus=num_gpus, dtype=dtype,
            peer=None if peer == "none" else peer, batching_max_size=batching_max_size,
            batching_delay_ms=batching_delay_ms,
            extra_serve_args=(["--compile"] if compile_blocks else []) + (["--quantize", quantize] if quantize else [])
            + (["--cuda-graphs"] if cuda_graphs else []),
            print_table=True,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if json_out is not None:
        json_out.write_text(json.dumps(result, indent=2, default=str))


def _mount_placement() -> None:
    from tilecast.runtime.k6sr.bench_placement import placement_command

    bench_app.command("placement", help="GPU: peak memory and hot time of each weight placement (released size).")(
        placement_command
    )


_mount_placement()
