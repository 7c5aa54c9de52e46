"""``tilecast bench placement``: peak device memory and hot end-to-end time per weight placement.

Released-size Kandinsky 6 SR networks (seeded random weights, bf16; ``bench.build_released``) on
one GPU, x2 of ``bench.pattern_video``, through ``bench.run_tilecast``. Each placement gets freshly
built networks (placement is one-way), one warm-up request, then ``repeats`` timed requests:

- ``e2e_s``: median hot request, synchronized;
- ``peak_allocated_gib`` / ``peak_reserved_gib``: PyTorch peaks over the timed requests (weights
  on the device included);
- ``weights_on_device_gib``: ``memory_allocated`` after placement, before any request;
- ``host_gib``: weights kept in (pinned) host memory;
- ``equal_to_resident`` / ``max_abs_diff``: output versus the resident row (streamed weights are
  the same values, so it should be exact).

Mount: ``bench_app.command("placement")(placement_command)`` in ``launcher/bench/cli.py``, or run
``python -m tilecast.runtime.k6sr.bench_placement --workload small``.
"""

from __future__ import annotations

import gc
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Annotated, Callable, Optional

import torch
import typer

from tilecast.runtime.k6sr.bench import WORKLOADS, build_released, pattern_video, run_tilecast

logger = logging.getLogger(__name__)

CONFIGS: dict[str, dict] = {
    "resident": {},
    "layerwise all, prefetch 1, resident 0": dict(layerwise_offload_components="all"),
    "layerwise all, prefetch 2, resident 0": dict(layerwise_offload_components="all", dit_offload_prefetch_size=2),
    "layerwise all, prefetch 1, resident 4": dict(layerwise_offload_components="all", dit_layerwise_resident_layers=4),
    "layerwise all, prefetch 2, resident 4": dict(
        layerwise_offload_components="all", dit_offload_prefetch_size=2, dit_layerwise_resident_layers=4
    ),
    "layerwise vae latent_upscaler": dict(layerwise_offload_components="vae latent_upscaler"),
    "component all": dict(cpu_offload_components="all"),
}
"""Row name → placement options (``RankContext.options`` keys); ``resident`` must come first."""
GIB = 2**30


def _context(device: torch.device, options: dict):
    from tilecast.runtime.pipeline import RankContext

    return RankContext(rank=0, world_size=1, device=device, cpu_group=None, device_group=None,
                       output_dir=Path("outputs"), options=options)


def _measure_one(name: str, options: dict, frames, *, device, dtype, repeats: int, seed: int,
                 build: Callable) -> tuple[dict, torch.Tensor]:
    from tilecast.runtime.k6sr.attention import install_dense_attention
    from tilecast.runtime.placement import apply_placement

    cuda = device.type == "cuda"
    parts = build(device, dtype)
    install_dense_attention(parts.transformer)
    applied = apply_placement(parts, _context(device, options))
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
    weights_on_device = torch.cuda.memory_allocated() / GIB if cuda else float("nan")
    host = sum(s.streamed_bytes for s in applied.streamers.values()) + sum(
        o.group.num_bytes for o in applied.offloads.values())

    run_tilecast(parts, frames, seed)  # warm-up
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, output = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        output = run_tilecast(parts, frames, seed)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    row = {
        "placement": name,
        "e2e_s": statistics.median(times),
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB if cuda else float("nan"),
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB if cuda else float("nan"),
        "weights_on_device_gib": weights_on_device,
        "host_gib": host / GIB,
        "late_groups": sum(s.late for s in applied.streamers.values()),
    }
    output = output.float().cpu()
    del parts, applied
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row, output


def bench_placement(
    workloads: list[str], *, configs: list[str] | None = None, repeats: int = 3, seed: int = 42,
    device: torch.device | None = None, dtype: torch.dtype = torch.bfloat16, build: Callable = build_released,
) -> list[dict]:
    """One row per (workload, placement); ``configs`` are ``CONFIGS`` names (default all; resident is
    always measured first as the reference)."""
    if device is None:
        if not torch.cuda.is_available():
            raise ValueError("tilecast bench placement needs a CUDA GPU (the released-size model)")
        device = torch.device("cuda")
    names = list(CONFIGS) if not configs else ["resident", *[c for c in configs if c != "resident"]]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown placement(s) {unknown}; choose from {list(CONFIGS)}")
    rows = []
    for workload in workloads:
        width, height, num_frames = WORKLOADS[workload]
        frames = pattern_video(width, height, num_frames)
        reference = None
        for name in names:
            row, output = _measure_one(name, CONFIGS[name], frames, device=device, dtype=dtype, repeats=repeats,
                                       seed=seed, build=build)
            if reference is None:
                reference = output
            row["equal_to_resident"] = bool(torch.equal(output, reference))
            row["max_abs_diff"] = float((output - reference).abs().max())
            rows.append({"workload": workload, **row})
            logger.info("%s", rows[-1])
    return rows


COLUMNS = ("workload", "placement", "e2e_s", "peak_allocated_gib", "peak_reserved_gib", "weights_on_device_gib",
           "host_gib", "late_groups", "equal_to_resident", "max_abs_diff")


def placement_command(
    workload: Annotated[list[str], typer.Option("--workload", help="small (384x256x33) | large (768x512x121), x2.")] = ["small"],  # noqa: B006
    placement: Annotated[Optional[list[str]], typer.Option("--placement", help=f"Rows to run (default all): {', '.join(CONFIGS)}.")] = None,
    repeats: Annotated[int, typer.Option("--repeats", help="Timed requests after one warm-up.")] = 3,
    json_out: Annotated[Optional[Path], typer.Option("--json-out", help="Write the rows as JSON.")] = None,
) -> None:
    """Released-size Kandinsky 6 SR on one GPU: peak memory and hot E2E per weight placement."""
    from rich.console import Console
    from rich.table import Table

    for name in workload:
        if name not in WORKLOADS:
            raise typer.BadParameter(f"--workload {name!r}: choose from {', '.join(WORKLOADS)}")
    rows = bench_placement(list(workload), configs=list(placement or []), repeats=repeats)
    table = Table(*COLUMNS, title="Kandinsky 6 SR x2 weight placement, one GPU")
    for row in rows:
        table.add_row(*(f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c]) for c in COLUMNS))
    Console().print(table)
    if json_out is not None:
        json_out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    typer.run(placement_command)
