"""``tilecast bench batching --peer diffusers``: the bench's traffic on the diffusers pipeline alone.

Run in the bench process before any server starts. It builds the very model the servers load
(the family's ``build_diffusers``: same builder, seed, device and dtype) and calls that diffusers
pipeline object directly with the arguments the family passes it when serving (``call_args``:
the prompts, one generator seeded per prompt, and ``call_kwargs``: size, steps, guidance, text
length, output type), so both sides do the same work. Same traffic shape as the servers get
(width, height, steps; distinct prompts and seeds, ``batching.bench_request``):

- ``one_at_a_time``: ``num_clients * requests_per_client`` sequential calls with one prompt each,
  what serving without batching amounts to;
- ``offline_batch``: ``requests_per_client`` calls with all ``num_clients`` prompts at once,
  batching with the whole batch known up front (no queueing, no waiting for companions).

Each mode is warmed up first, not counted, like the servers (``WARMUP_SEQUENTIAL`` single calls;
one whole-batch call). Throughput is outputs per second of wall time; latency is per call, so the
offline batch's p50 is one whole-batch call. The model is freed, and the CUDA cache emptied,
before returning: the servers get the whole device.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Any

import torch

from tilecast.launcher.bench.batching import WARMUP_SEQUENTIAL, bench_request
from tilecast.launcher.bench.report import time_calls
from tilecast.runtime.config import ServeConfig
from tilecast.runtime.models.families.common import DiffusersBatchPipeline
from tilecast.runtime.pipeline import RankContext, WorkItem
from tilecast.runtime.registry import resolve_pipeline
from tilecast.scheduler.batching_metrics import percentile_nearest_rank

logger = logging.getLogger(__name__)


def _call(family: DiffusersBatchPipeline, items: list[WorkItem]) -> None:
    """``items`` as one call of the diffusers pipeline object."""
    with torch.inference_mode():
        family.pipe(**family.call_args(items), return_dict=False)


def _mode(family: DiffusersBatchPipeline, warmup: list[list[WorkItem]], batches: list[list[WorkItem]]) -> dict:
    """Each batch as one diffusers call, one after the other, after the untimed ``warmup`` calls."""
    time_calls([lambda items=items: _call(family, items) for items in warmup], device=family.device)
    timing = time_calls([lambda items=items: _call(family, items) for items in batches], device=family.device)
    requests = sum(len(items) for items in batches)
    return {
        "requests": requests,
        "batch_size": len(batches[0]),
        "wall_s": timing.total_s,
        "throughput_rps": requests / timing.total_s if timing.total_s > 0 else 0.0,
        "p50_ms": percentile_nearest_rank(list(timing.calls_s), 50.0) * 1000.0,
    }


def _measure(family: DiffusersBatchPipeline, *, num_clients: int, requests_per_client: int, fields: dict) -> dict:
    def items(requests: list[dict]) -> list[WorkItem]:
        return [
            WorkItem(job_id=f"peer-{i}", params=family.prepare(family.params_type(**request, **fields), {}))
            for i, request in enumerate(requests)
        ]

    warmup = [dict(prompt=f"warm-up {i}", seed=i) for i in range(WARMUP_SEQUENTIAL)]
    wave = [dict(prompt=f"warm-up wave {i}", seed=i) for i in range(num_clients)]
    rounds = [[bench_request(client, k) for client in range(num_clients)] for k in range(requests_per_client)]
    logger.info(
        "diffusers peer: %d calls of one request, then %d calls of %d",
        num_clients * requests_per_client,
        requests_per_client,
        num_clients,
    )
    return {
        "one_at_a_time": _mode(
            family, [items([r]) for r in warmup], [items([request]) for batch in rounds for request in batch]
        ),
        "offline_batch": _mode(family, [items(wave)], [items(batch) for batch in rounds]),
    }


def measure_diffusers_peer(
    model_path: str,
    *,
    num_clients: int,
    requests_per_client: int,
    fields: dict,
    device: str,
    dtype: str,
) -> dict[str, Any]:
    """Throughput and p50 latency of diffusers called one request at a time and offline with the
    whole batch (see the module doc). ``fields`` are the request fields every bench request shares."""
    family_cls = resolve_pipeline(model_path)
    if not issubclass(family_cls, DiffusersBatchPipeline):
        raise ValueError(
            f"--peer diffusers needs a model of a diffusers text-to-image/video family (tiny/flux, random/flux, ...);"
            f" {model_path!r} is served by {family_cls.__name__}"
        )
    ctx = RankContext(
        rank=0,
        world_size=1,
        device=torch.device(device),
        cpu_group=None,
        device_group=None,
        output_dir=Path("."),
        settings=ServeConfig(model_path=model_path, device=device, dtype=dtype),
    )
    family = family_cls(family_cls.build_diffusers(model_path, ctx.device, getattr(torch, dtype)), ctx)
    try:
        return _measure(family, num_clients=num_clients, requests_per_client=requests_per_client, fields=fields)
    finally:
        del family  # the servers get the whole device
        gc.collect()
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
