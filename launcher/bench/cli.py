"""``tilecast bench``: benchmarks (not tests), each comparing with its peer in the same run.

The commands only parse flags; each benchmark lives in its own module of this package
(``k6sr``, ``attention``, ``narrow_conv``, ``fp8_conv``, ``step``, ``batching`` with ``peer``, ``placement``, ``scheduler``), imported when its
command runs, so mounting ``bench_app`` imports no torch. Tables and ``--json-out`` go through
``report``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from tilecast.launcher.bench.placement import COLUMNS as PLACEMENT_COLUMNS
from tilecast.launcher.bench.placement import CONFIGS as PLACEMENTS
from tilecast.launcher.bench.report import print_table, save_json

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks against their peers, ratios in one run.")

K6SR_WORKLOADS = "small (384x256x33) | large (768x512x121), x2."
"""Help text of ``--workload`` (``k6sr.WORKLOADS``)."""


def _print_rows(rows: list[dict], columns: list[str], title: str, json_out: Optional[Path]) -> None:
    """Print ``rows`` as a table of ``columns``, then save them as JSON when asked."""
    print_table(rows, columns, title)
    save_json(rows, json_out)


def _check_workloads(workload: list[str]) -> None:
    from tilecast.launcher.bench.k6sr import WORKLOADS

    for name in workload:
        if name not in WORKLOADS:
            raise typer.BadParameter(f"--workload {name!r}: choose from {', '.join(WORKLOADS)}")


@bench_app.command("k6sr")
def k6sr(
    workload: Annotated[list[str], typer.Option("--workload", help=K6SR_WORKLOADS)] = ["small"],  # noqa: B006
    peer: Annotated[str, typer.Option("--peer", help="diffusers | none.")] = "diffusers",
    repeats: Annotated[int, typer.Option("--repeats", help="Timed requests after one warm-up.")] = 1,
    compile_blocks: Annotated[
        bool, typer.Option("--compile", help="torch.compile tilecast's DiT blocks (compile time is in the warm-up).")
    ] = False,
    attention_backend: Annotated[
        Optional[str],
        typer.Option(
            "--attention-backend",
            help="tilecast's attention: a dense kernel (default: the fastest) or nabla (NABLA block-sparse; "
            "its rows carry nabla_density, the kept fraction of blocks).",
        ),
    ] = None,
    vae_fp8_convs: Annotated[
        bool,
        typer.Option("--vae-fp8-convs", help="tilecast's K-VAE decode with FP8 convolutions (--vae-config.fp8-convs)."),
    ] = False,
    quantize: Annotated[
        Optional[str], typer.Option("--quantize", help="fp8: tilecast's DiT blocks' linear layers in FP8 (as serve's).")
    ] = None,
    default_too: Annotated[
        bool,
        typer.Option(
            "--default-too",
            help="With an opt-in: also time tilecast's defaults in the same run (PSNR of the opt-in against them).",
        ),
    ] = False,
    profile: Annotated[
        Optional[Path],
        typer.Option("--profile", help="Also profile one tilecast request per workload; tables into this folder."),
    ] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json-out", help="Write the rows as JSON.")] = None,
) -> None:
    """Released-size Kandinsky 6 SR (random weights): tilecast vs diffusers' pipeline, per stage."""
    from tilecast.launcher.bench.k6sr import STAGES, bench_k6sr

    _check_workloads(workload)
    if peer not in ("diffusers", "none"):
        raise typer.BadParameter(f"--peer {peer!r}: choose diffusers or none")
    try:  # a ValueError names the bad option (or the missing GPU)
        rows = bench_k6sr(
            list(workload),
            peer=None if peer == "none" else peer,
            repeats=repeats,
            compile_blocks=compile_blocks,
            attention_backend=attention_backend,
            vae_fp8_convs=vae_fp8_convs,
            quantize=quantize,
            default_too=default_too,
            profile_dir=profile,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    columns = [
        "workload",
        "side",
        "attention",
        "vae_convs",
        "dit_linears",
        "e2e_s",
        *(f"{s}_s" for s in (*STAGES, "other")),
        "decode_tflops",
        "peak_reserved_gib",
        "ratio_vs_diffusers",
        "psnr_vs_diffusers_db",
        *(["psnr_vs_default_db"] if default_too else []),
        *(["nabla_density"] if any("nabla_density" in row for row in rows) else []),
        *(["sm_mhz", "power_w"] if any("sm_mhz" in row for row in rows) else []),
    ]
    _print_rows(rows, columns, "Kandinsky 6 SR x2, one H200-class GPU", json_out)


@bench_app.command("attention")
def attention(
    seq_len: Annotated[list[int], typer.Option("--seq-len")] = [13_824, 47_616],  # noqa: B006
    head_dim: Annotated[list[int], typer.Option("--head-dim")] = [64, 128],  # noqa: B006
    iters: Annotated[int, typer.Option("--iters")] = 10,
    backend: Annotated[
        Optional[list[str]],
        typer.Option(
            "--backend",
            help="Backends to time (repeatable; default: every available); fp8:128x64w4s3 times the fp8 kernel "
            "at that tiling (BLOCK_MxBLOCK_NwWARPSsSTAGES).",
        ),
    ] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json-out")] = None,
) -> None:
    """Forward TFLOP/s of every available attention backend (with log-sum-exp), against the default one."""
    import torch

    from tilecast.kernels.backends import resolve_backend
    from tilecast.launcher.bench.attention import H200_DENSE_BF16_TFLOPS, bench_attention

    try:  # a ValueError names what is missing
        rows = bench_attention(tuple(seq_len), tuple(head_dim), backends=backend, iters=iters)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    print_table(
        rows,
        [
            "backend",
            "head_dim",
            "seq_len",
            "ms",
            "tflops",
            "of_peak",
            "x_default",
            "psnr_vs_default",
            "sm_mhz",
            "error",
        ],
        f"attention forward, bf16 inputs (dense-equivalent TFLOP/s; peak {H200_DENSE_BF16_TFLOPS:.0f})",
        headers=[
            "backend",
            "head_dim",
            "seq_len",
            "ms",
            "TFLOP/s",
            f"of {H200_DENSE_BF16_TFLOPS:.0f} peak",
            "x default",
            "PSNR vs default (dB)",
            "SM MHz",
            "note",
        ],
    )
    print(f"default backend here: {resolve_backend(None, torch.device('cuda'), torch.bfloat16)}")
    save_json(rows, json_out)


DecodeOption = Annotated[
    bool, typer.Option("--decode", help="Also time one large tile's whole decode both ways (same run).")
]
DecodeProfileOption = Annotated[
    Optional[Path],
    typer.Option("--profile", help="With --decode: also profile each decode (per decoder level); tables here."),
]
ConvColumns = ["layer", "kernel", "ms", "tflops", "x_cudnn", "psnr_vs_fp32_db"]


def _conv_bench(run, columns: list[str], title: str, json_out: Optional[Path]) -> None:
    """Run a convolution bench (``run()``: its rows) and print them; a ``ValueError`` (a bad tiling,
    no GPU, ``--profile`` without ``--decode``) is a bad parameter."""
    try:
        rows = run()
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    _print_rows(rows, [*columns, "sm_mhz", "power_w", "error"], title, json_out)


@bench_app.command("fp8-conv")
def fp8_conv(
    tiling: Annotated[
        Optional[list[str]],
        typer.Option("--tiling", help="Also time the FP8 kernel at this tiling (repeatable): BMxBNkBKwWARPSsSTAGES."),
    ] = None,
    frames: Annotated[int, typer.Option("--frames", help="Output frames per convolution.")] = 8,
    iters: Annotated[int, typer.Option("--iters")] = 10,
    decode: DecodeOption = False,
    profile: DecodeProfileOption = None,
    json_out: Annotated[Optional[Path], typer.Option("--json-out")] = None,
) -> None:
    """The K-VAE decoder's wide 3x3x3 convolutions: cuDNN bf16 vs the FP8 kernel (GPU)."""
    from tilecast.launcher.bench.fp8_conv import bench_fp8_conv

    _conv_bench(
        lambda: bench_fp8_conv(list(tiling or []), frames=frames, iters=iters, decode=decode, profile_dir=profile),
        [*ConvColumns, "quantize_ms"],
        "K-VAE wide convolutions, bf16 cuDNN vs FP8",
        json_out,
    )


@bench_app.command("narrow-conv")
def narrow_conv(
    tiling: Annotated[
        Optional[list[str]],
        typer.Option(
            "--tiling",
            help="Also time the Triton kernel at this tiling (repeatable): BHxBWkBKwWARPSsSTAGES, r at the end for "
            "the reuse kernel (one input load for the three column taps).",
        ),
    ] = None,
    frames: Annotated[
        Optional[int], typer.Option("--frames", help="Output frames (default: one decoder segment).")
    ] = None,
    iters: Annotated[int, typer.Option("--iters")] = 10,
    decode: DecodeOption = False,
    profile: DecodeProfileOption = None,
    json_out: Annotated[Optional[Path], typer.Option("--json-out")] = None,
) -> None:
    """The K-VAE decoder's full-resolution convolutions (16 and 3 output channels): cuDNN vs Triton."""
    from tilecast.launcher.bench.narrow_conv import bench_narrow_conv

    _conv_bench(
        lambda: bench_narrow_conv(list(tiling or []), frames=frames, iters=iters, decode=decode, profile_dir=profile),
        ConvColumns,
        "K-VAE full-resolution convolutions, one segment of a large tile (bf16)",
        json_out,
    )


@bench_app.command("step")
def step(
    model_path: Annotated[
        str, typer.Option("--model-path", help="tiny/flux (CPU) | random/flux (released size, GPU).")
    ] = "tiny/flux",
    width: Annotated[int, typer.Option("--width")] = 512,
    height: Annotated[int, typer.Option("--height")] = 512,
    batch_size: Annotated[list[int], typer.Option("--batch-size", help="Repeat for several.")] = [1],  # noqa: B006
    device: Annotated[str, typer.Option("--device")] = "cpu",
    dtype: Annotated[str, typer.Option("--dtype", help="float32 | bfloat16 | float16.")] = "float32",
    compile_blocks: Annotated[
        bool, typer.Option("--compile", help="Compile tilecast's transformer blocks (compile time is in the warm-up).")
    ] = False,
    attention_backend: Annotated[
        Optional[str], typer.Option("--attention-backend", help="tilecast's attention kernel (default: the fastest).")
    ] = None,
    quantize: Annotated[
        Optional[str],
        typer.Option(
            "--quantize", help="fp8: tilecast's blocks with FP8 linear layers (diffusers' side stays in --dtype)."
        ),
    ] = None,
    cuda_graphs: Annotated[
        bool, typer.Option("--cuda-graphs", help="Replay tilecast's forward as a CUDA graph (captured in the warm-up).")
    ] = False,
    iters: Annotated[int, typer.Option("--iters", help="Timed steps (with --loop-steps: loops).")] = 10,
    loop_steps: Annotated[
        int,
        typer.Option(
            "--loop-steps",
            help="Time the pipeline's own loop of this many steps and report a step as its share (0: one call).",
        ),
    ] = 0,
    profile: Annotated[
        Optional[Path],
        typer.Option(
            "--profile",
            help="Also profile one tilecast step (loop) per batch size; tables into this folder, on CUDA "
            "the trace too and, with --loop-steps, the loop's GPU timeline step by step.",
        ),
    ] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json-out")] = None,
) -> None:
    """One FLUX denoising step: diffusers' eager transformer vs tilecast's fast paths, same model, one run."""
    from tilecast.launcher.bench.step import run_step_bench
    from tilecast.runtime.config import DTYPES

    if dtype not in DTYPES:
        raise typer.BadParameter(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    try:  # a ValueError names the bad option
        rows = run_step_bench(
            model_path,
            width=width,
            height=height,
            batch_sizes=list(batch_size),
            device=device,
            dtype=dtype,
            compile_blocks=compile_blocks,
            attention_backend=attention_backend,
            quantize=quantize,
            cuda_graphs=cuda_graphs,
            iters=iters,
            loop_steps=loop_steps,
            profile_dir=profile,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    columns = [
        "batch",
        "loop_steps",
        "tflop",
        "diffusers_ms",
        "tilecast_ms",
        "ratio",
        "tilecast_ms_per_image",
        "diffusers_tflops",
        "tilecast_tflops",
        "tilecast_warmup_s",
        "max_rel_diff",
        "psnr_db",
        "diffusers_sm_mhz",
        "tilecast_sm_mhz",
    ]
    _print_rows(
        rows,
        columns,
        f"FLUX step: {model_path} {width}x{height}, {dtype}, {device}"
        f"{', compiled' if compile_blocks else ''}{f', {quantize}' if quantize else ''}"
        f"{', CUDA graphs' if cuda_graphs else ''}",
        json_out,
    )


@bench_app.command("batching")
def batching(
    model_path: Annotated[
        str, typer.Option("--model-path", help="tiny/flux (CPU), random/flux (released size, GPU), ...")
    ] = "tiny/flux",
    num_clients: Annotated[int, typer.Option("--num-clients", help="Concurrent clients.")] = 8,
    requests_per_client: Annotated[int, typer.Option("--requests-per-client")] = 3,
    width: Annotated[int, typer.Option("--width")] = 64,
    height: Annotated[int, typer.Option("--height")] = 64,
    steps: Annotated[int, typer.Option("--steps")] = 2,
    device: Annotated[str, typer.Option("--device")] = "cpu",
    dtype: Annotated[
        Optional[str],
        typer.Option("--dtype", help="Passed to the servers (and the peer): float32 | bfloat16 | float16."),
    ] = None,
    num_gpus: Annotated[
        int, typer.Option("--num-gpus", help="Ranks of the measured servers (more than 1: one rank is measured too).")
    ] = 1,
    dp_degree: Annotated[
        Optional[int], typer.Option("--dp-degree", help="Data-parallel replica groups of the measured servers.")
    ] = None,
    ulysses_degree: Annotated[
        Optional[int], typer.Option("--ulysses-degree", help="Ulysses degree of the measured servers.")
    ] = None,
    topology: Annotated[
        Optional[list[str]],
        typer.Option(
            "--topology",
            help="Measure this layout (repeatable; one rank is measured first): dp2, ulysses2, dp2xulysses2.",
        ),
    ] = None,
    batching_max_size: Annotated[
        int, typer.Option("--batching-max-size", help="Largest merged batch of the dynamic server.")
    ] = 8,
    batching_delay_ms: Annotated[float, typer.Option("--batching-delay-ms")] = 20.0,
    peer: Annotated[
        str,
        typer.Option(
            "--peer",
            help="diffusers: also time diffusers' pipeline one request at a time and with the whole batch offline | none.",
        ),
    ] = "none",
    compile_blocks: Annotated[
        bool, typer.Option("--compile", help="Serve with --compile (the peer stays eager, as diffusers ships).")
    ] = False,
    quantize: Annotated[
        Optional[str], typer.Option("--quantize", help="Serve with --quantize (fp8; the peer stays in --dtype).")
    ] = None,
    cuda_graphs: Annotated[
        bool, typer.Option("--cuda-graphs", help="Serve with --cuda-graphs (the peer stays eager).")
    ] = False,
    json_out: Annotated[Optional[Path], typer.Option("--json-out")] = None,
) -> None:
    """N concurrent clients against one server: --batching-max-size 1 versus dynamic, per topology, in one run."""
    from tilecast.launcher.bench.batching import BenchTopology, run_batching_bench

    try:  # a ValueError names the bad option
        result = run_batching_bench(
            model_path,
            topologies=[BenchTopology.parse(text) for text in topology or ()],
            num_clients=num_clients,
            requests_per_client=requests_per_client,
            width=width,
            height=height,
            steps=steps,
            device=device,
            num_gpus=num_gpus,
            dp_degree=dp_degree,
            ulysses_degree=ulysses_degree,
            dtype=dtype,
            peer=None if peer == "none" else peer,
            batching_max_size=batching_max_size,
            batching_delay_ms=batching_delay_ms,
            extra_serve_args=(["--compile"] if compile_blocks else [])
            + (["--quantize", quantize] if quantize else [])
            + (["--cuda-graphs"] if cuda_graphs else []),
            print_table=True,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    save_json(result, json_out)


@bench_app.command("placement")
def placement(
    workload: Annotated[list[str], typer.Option("--workload", help=K6SR_WORKLOADS)] = ["small"],  # noqa: B006
    placement: Annotated[
        Optional[list[str]],
        typer.Option(
            "--placement", help="Rows to run (default all): " + "; ".join(repr(name) for name in PLACEMENTS) + "."
        ),
    ] = None,
    repeats: Annotated[int, typer.Option("--repeats", help="Timed requests after one warm-up.")] = 3,
    json_out: Annotated[Optional[Path], typer.Option("--json-out", help="Write the rows as JSON.")] = None,
) -> None:
    """GPU: peak memory and hot time of each weight placement (released-size Kandinsky 6 SR)."""
    from tilecast.launcher.bench.placement import bench_placement

    _check_workloads(workload)
    try:  # a ValueError names the bad option
        rows = bench_placement(list(workload), configs=list(placement or []), repeats=repeats)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    _print_rows(rows, list(PLACEMENT_COLUMNS), "Kandinsky 6 SR x2 weight placement, one GPU", json_out)


@bench_app.command("scheduler")
def scheduler(
    scenario: Annotated[
        Optional[list[str]],
        typer.Option("--scenario", help="Queues to decide on (default all): mixed, one-model, one-size."),
    ] = None,
    num_queued: Annotated[int, typer.Option("--num-queued", help="Queued requests at every decision.")] = 1000,
    decisions: Annotated[int, typer.Option("--decisions", help="Timed decisions per repeat.")] = 500,
    round_trips: Annotated[int, typer.Option("--round-trips", help="Timed health / status calls per repeat.")] = 500,
    upload_mb: Annotated[float, typer.Option("--upload-mb", help="Size of the upload (MiB).")] = 64.0,
    uploads: Annotated[int, typer.Option("--uploads", help="Timed uploads to the server per repeat.")] = 5,
    repeats: Annotated[int, typer.Option("--repeats", help="Repeats of every measurement (the spread).")] = 5,
    server: Annotated[
        bool, typer.Option("--server/--no-server", help="Also time the round trips against an in-process server.")
    ] = True,
    json_out: Annotated[Optional[Path], typer.Option("--json-out", help="Write the rows as JSON.")] = None,
) -> None:
    """CPU: rank 0's batch decision at a deep queue, client round trips, and the wire for a large upload."""
    from tilecast.launcher.bench.scheduler import (
        DISPATCH_COLUMNS,
        SCENARIOS,
        TARGET_DECISION_US,
        WIRE_COLUMNS,
        run_scheduler_bench,
    )

    for name in scenario or ():
        if name not in SCENARIOS:
            raise typer.BadParameter(f"--scenario {name!r}: choose from {', '.join(SCENARIOS)}")
    try:  # a ValueError names the bad option
        result = run_scheduler_bench(
            scenarios=list(scenario or SCENARIOS),
            num_queued=num_queued,
            decisions=decisions,
            round_trips=round_trips,
            upload_mb=upload_mb,
            uploads=uploads,
            repeats=repeats,
            server=server,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    print_table(
        result["dispatch"],
        list(DISPATCH_COLUMNS),
        f"rank 0's batch decision at {num_queued} queued, microseconds (target p95 <= {TARGET_DECISION_US:.0f})",
        headers=list(DISPATCH_COLUMNS.values()),
    )
    print_table(
        result["wire"],
        list(WIRE_COLUMNS),
        "round trips and the wire, microseconds",
        headers=list(WIRE_COLUMNS.values()),
    )
    save_json(result, json_out)
