"""``tilecast bench placement``: peak device memory and hot end-to-end time per weight placement.

Released-size Kandinsky 6 SR networks (seeded random weights, bf16; ``k6sr.build_released``) on
one GPU, x2 of ``k6sr.pattern_video``, through ``k6sr.run_tilecast``. Each placement gets freshly
built networks (placement is one-way), one warm-up request, then ``repeats`` timed requests:

- ``e2e_s``: median hot request, synchronized;
- ``peak_allocated_gib`` / ``peak_reserved_gib``: PyTorch peaks over the timed requests (weights
  on the device included);
- ``weights_on_device_gib``: ``memory_allocated`` after placement, before any request;
- ``host_gib``: weights kept in (pinned) host memory;
- ``equal_to_resident`` / ``max_abs_diff``: output versus the resident row (streamed weights are
  the same values, so it should be exact).

Imports no torch at module import time: ``CONFIGS`` names the ``--placement`` choices in
``tilecast bench --help``.
"""

from __future__ import annotations

import functools
import gc
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from tilecast.launcher.bench.report import synchronize, time_repeated

if TYPE_CHECKING:
    import torch

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
"""Row name → placement settings (``ServeConfig`` fields); ``resident`` must come first."""
GIB = 2**30


def _context(device: torch.device, placement: dict):
    from tilecast.runtime.config import ServeConfig
    from tilecast.runtime.pipeline import RankContext

    return RankContext(
        rank=0,
        world_size=1,
        device=device,
        cpu_group=None,
        device_group=None,
        output_dir=Path("outputs"),
        settings=ServeConfig(device=device.type, **placement),
    )


def _measure_one(
    name: str, placement: dict, frames, *, device, dtype, repeats: int, seed: int, build: Callable
) -> tuple[dict, torch.Tensor]:
    import torch

    from tilecast.launcher.bench.k6sr import run_tilecast
    from tilecast.runtime.models.k6sr.attention import install_dense_attention
    from tilecast.runtime.placement import apply_placement

    cuda = device.type == "cuda"
    parts = build(device, dtype)
    install_dense_attention(parts.transformer)
    applied = apply_placement(parts, _context(device, placement))
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    synchronize(device)
    weights_on_device = torch.cuda.memory_allocated() / GIB if cuda else float("nan")
    host = sum(s.streamed_bytes for s in applied.streamers.values()) + sum(
        o.group.num_bytes for o in applied.offloads.values()
    )

    timing = time_repeated(
        functools.partial(run_tilecast, parts, frames, seed),
        repeats=repeats,
        warmup=1,
        device=device,
        after_warmup=torch.cuda.reset_peak_memory_stats if cuda else None,
    )
    row = {
        "placement": name,
        "e2e_s": timing.median_s,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB if cuda else float("nan"),
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB if cuda else float("nan"),
        "weights_on_device_gib": weights_on_device,
        "host_gib": host / GIB,
        "late_groups": sum(s.late for s in applied.streamers.values()),
    }
    output = timing.result.float().cpu()
    del parts, applied, timing
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row, output


def bench_placement(
    workloads: list[str],
    *,
    configs: list[str] | None = None,
    repeats: int = 3,
    seed: int = 42,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    build: Callable | None = None,
) -> list[dict]:
    """One row per (workload, placement); ``configs`` are ``CONFIGS`` names (default all; resident is
    always measured first as the reference). ``dtype`` defaults to bfloat16, ``build`` to
    ``k6sr.build_released``."""
    import torch

    from tilecast.launcher.bench.k6sr import WORKLOADS, build_released, pattern_video

    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"--repeats must be a positive integer, got {repeats!r}")
    if device is None:
        if not torch.cuda.is_available():
            raise ValueError("tilecast bench placement needs a CUDA GPU (the released-size model)")
        device = torch.device("cuda")
    names = list(CONFIGS) if not configs else ["resident", *[c for c in configs if c != "resident"]]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown placement(s) {unknown}; choose from {list(CONFIGS)}")
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise ValueError(f"--workload {unknown[0]!r}: choose from {', '.join(WORKLOADS)}")
    rows = []
    for workload in workloads:
        width, height, num_frames = WORKLOADS[workload]
        frames = pattern_video(width, height, num_frames)
        reference = None
        for name in names:
            row, output = _measure_one(
                name,
                CONFIGS[name],
                frames,
                device=device,
                dtype=dtype or torch.bfloat16,
                repeats=repeats,
                seed=seed,
                build=build or build_released,
            )
            if reference is None:
                reference = output
            row["equal_to_resident"] = bool(torch.equal(output, reference))
            row["max_abs_diff"] = float((output - reference).abs().max())
            rows.append({"workload": workload, **row})
            logger.info("%s", rows[-1])
    return rows


COLUMNS = (
    "workload",
    "placement",
    "e2e_s",
    "peak_allocated_gib",
    "peak_reserved_gib",
    "weights_on_device_gib",
    "host_gib",
    "late_groups",
    "equal_to_resident",
    "max_abs_diff",
)
"""The report's columns, in order."""
