"""``test/allreduce``: a small pipeline that does real work on every rank, for testing the spine.

Each rank contributes a seeded partial tensor; an all-reduce over the device group sums them;
the output rank writes the sum to a file and returns it as a tensor. Knobs make a unit of work
slow, fail, or hang on one rank, or add a long stage that only beats the watchdog, so the
scheduler's failure, cancel and watchdog paths can be exercised for real. Every step ends at a
cancel point.
When ``TILECAST_PROBE_LOG_DIR`` is set, every rank appends the job ids it executed, in order.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from tilecast.runtime.pipeline import Output, OutputFile, Pipeline, RankContext, WorkItem

logger = logging.getLogger(__name__)


class ProbeParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    size: int = 4
    """Length of the summed vector."""
    seed: int = 0
    """Seeds each rank's partial tensor (per request)."""
    steps: int = 1
    """All-reduces per request (progress ticks)."""
    sleep_s: float = 0.0
    """Sleep per step on every rank, then ``ctx.alive()`` (a slow unit of work)."""
    fail: str | None = None
    """Raise ValueError with this message on every rank (a failing request)."""
    hang_rank: int | None = None
    """This rank stops making progress (a stuck rank)."""
    stage_s: float = 0.0
    """After the steps, a stage this long on every rank with no progress units (like a VAE decode):
    0.05 s sleeps, each followed by ``ctx.alive()``."""


class AllReducePipeline(Pipeline):
    family = "probe"
    task = "probe"
    builtin_name = "test/allreduce"
    params_type = ProbeParams
    max_batch_size = 8
    per_request_fields = ("seed",)

    def __init__(self, ctx: RankContext) -> None:
        self.log_dir = os.environ.get("TILECAST_PROBE_LOG_DIR")

    @classmethod
    def load(cls, model_path: str, ctx: RankContext) -> "AllReducePipeline":
        return cls(ctx)

    def prepare(self, params: ProbeParams, uploads: dict[str, bytes]) -> ProbeParams:
        if params.size < 0 or params.size > 1 << 20:
            raise ValueError(f"size must be in 0..{1 << 20}, got {params.size}")
        if params.steps < 1:
            raise ValueError(f"steps must be >= 1, got {params.steps}")
        if not 0 <= params.stage_s <= 3600:
            raise ValueError(f"stage_s must be in 0..3600, got {params.stage_s}")
        return params

    def _partial(self, params: ProbeParams, rank: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(params.seed * 1000 + rank)
        return torch.randn(params.size, generator=gen, dtype=torch.float64) + rank

    def run(self, items: list[WorkItem], ctx: RankContext) -> list[Output]:
        if self.log_dir:
            with open(Path(self.log_dir, f"rank{ctx.rank}.log"), "a") as log:
                log.write(json.dumps([item.job_id for item in items]) + "\n")
        outputs = []
        for item in items:
            params: ProbeParams = item.params
            if params.fail:
                raise ValueError(params.fail)
            total = torch.zeros(params.size, dtype=torch.float64)
            for step in range(params.steps):
                if params.hang_rank == ctx.rank:
                    logger.warning("rank %d: hanging on purpose (hang_rank)", ctx.rank)
                    while True:
                        time.sleep(3600)
                if params.sleep_s:
                    time.sleep(params.sleep_s)
                    ctx.alive()  # compute that moved on
                partial = self._partial(params, ctx.rank).to(ctx.device)
                if ctx.device_group is not None:
                    dist.all_reduce(partial, group=ctx.device_group)
                total = partial.cpu()
                ctx.progress(step + 1, params.steps)
                ctx.cancel_point()
            deadline = time.monotonic() + params.stage_s
            while time.monotonic() < deadline:
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
                ctx.alive()
            out = Output(tensors={"sum": total}, info={"world_size": ctx.world_size})
            if ctx.is_output_rank:
                path = ctx.output_dir / f"{item.job_id}.json"
                path.write_text(json.dumps(total.tolist()))
                out.files.append(OutputFile(name=path.name, path=path, mime="application/json"))
            outputs.append(out)
        return outputs

    @staticmethod
    def expected_sum(params: ProbeParams, world_size: int) -> torch.Tensor:
        """What a correct run over ``world_size`` ranks returns (for tests)."""
        probe = AllReducePipeline.__new__(AllReducePipeline)
        return sum(probe._partial(params, rank) for rank in range(world_size))
