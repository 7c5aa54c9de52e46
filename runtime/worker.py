"""The compute loop every rank runs: receive its group leader's plan, execute it, agree on the outcome.

Each serving group (``runtime/replicas.py``; one group of all ranks unless the run has data-parallel
replicas) runs a loop of its own. Its leader takes the next plan from the scheduler (rank 0, group
0: the scheduler's handoff queue; other groups: ``ReplicaLink``), or an ``idle`` plan after
``idle_tick_s``, which keeps every rank's heartbeat progress moving and bounds how long the others
sit in a broadcast. The group's ranks then run the same plan in the same order, so their
collectives line up. On the leader the plan's ``PlanHooks`` carry its progress to the scheduler and
tell the pipeline's cancel points whether to stop; a plan stopped there is reported as
``PLAN_CANCELLED``.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import time
import traceback
from pathlib import Path
from typing import Callable

import msgspec
import torch

from tilecast.runtime.distributed import Ranks, broadcast_plan_in, group_ok
from tilecast.runtime.pipeline import Pipeline, PlanCancelled, PlanHooks, RankContext, WorkItem
from tilecast.runtime.replicas import Replica
from tilecast.runtime.watchdog import ProgressBeat
from tilecast.scheduler import protocol as P
from tilecast.scheduler.scheduler import PLAN_CANCELLED

logger = logging.getLogger(__name__)


def execute_plan(plan: P.Plan, pipeline: Pipeline, ctx: RankContext) -> list:
    """Run one plan's items through the pipeline. Each output's ``info`` gains the batch's
    ``inference_time_s`` (this rank's wall time for the whole batch) and ``peak_memory_mb`` (the
    device's peak allocated memory during it; ``None`` off CUDA, where torch keeps no such count)."""
    items = [
        WorkItem(
            job_id=item.job_id,
            params=msgspec.convert(item.params, pipeline.params_type),
            uploads=dict(item.uploads),
        )
        for item in plan.items
    ]
    cuda = getattr(ctx.device, "type", None) == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    began = time.perf_counter()
    outputs = pipeline.run(items, ctx)
    if len(outputs) != len(items):
        raise RuntimeError(f"pipeline returned {len(outputs)} outputs for {len(items)} requests")
    facts = {
        "inference_time_s": round(time.perf_counter() - began, 4),
        "peak_memory_mb": round(torch.cuda.max_memory_allocated(ctx.device) / 2**20, 1) if cuda else None,
    }
    for output in outputs:
        if hasattr(output, "info"):
            output.info = {**facts, **output.info}
    return outputs


def compute_loop(
    *,
    ranks: Ranks,
    pipeline: Pipeline,
    ctx: RankContext,
    beat: ProgressBeat,
    next_plan: Callable[[float], P.Plan | None] | None,
    on_done: Callable[[int, object], None] | None,
    hooks: Callable[[int], PlanHooks] | None = None,
    idle_tick_s: float = 1.0,
    replica: Replica | None = None,
) -> None:
    """Run until a ``stop`` plan. On the group's leader ``next_plan(timeout)`` supplies plans,
    ``on_done(seq, outputs | PLAN_CANCELLED | error_message)`` receives outcomes and ``hooks(seq)``
    gives the plan's ``PlanHooks``; other ranks pass None for all three.

    ``replica`` is this rank's serving group (``runtime/replicas.py``): plans come from its leader
    and every collective of the loop stays on its CPU group. None: one group of all ranks, led by
    rank 0.

    A failure inside a pipeline fails that plan's jobs on every rank and the loop goes on; a
    failure of the collectives themselves (a peer died) propagates to the caller.
    """
    if replica is None:
        replica = Replica(
            index=0,
            ranks=tuple(range(ranks.world_size)),
            rank=ranks.rank,
            num_groups=1,
            cpu_group=ranks.cpu_group if ranks.distributed else None,
            device_group=ranks.device_group,
        )
    leader, group = replica.is_leader, replica.cpu_group
    record = PlanRecord.from_env(ranks.rank, replica)
    seq_seen = 0
    ctx.heartbeat = beat.tick  # ``ctx.alive()`` inside long stages feeds the stuck watchdog
    while True:
        plan = None
        if leader:
            plan = next_plan(idle_tick_s) or P.Plan(seq=0, kind="idle")
        plan = broadcast_plan_in(plan, group=group, src=replica.leader, is_src=leader)
        if plan.kind == "stop":
            logger.debug("rank %d: stop", ranks.rank)
            return
        if plan.kind == "idle":
            beat.tick()
            continue
        assert plan.seq > seq_seen, (plan.seq, seq_seen)
        seq_seen = plan.seq
        beat.set_busy(True)
        started, started_wall = time.perf_counter(), time.time()
        outputs, error, cancelled = None, None, False
        ctx.plan = hooks(plan.seq) if hooks is not None else None
        try:
            outputs = execute_plan(plan, pipeline, ctx)
        except PlanCancelled:
            cancelled = True
            logger.info("rank %d: plan %d stopped: every job was cancelled", ranks.rank, plan.seq)
        except Exception as exc:  # noqa: BLE001 - reported to the job, the server goes on
            error = f"{type(exc).__name__}: {exc}"
            level = logging.WARNING if isinstance(exc, ValueError) else logging.ERROR
            logger.log(level, "rank %d: plan %d failed: %s", ranks.rank, plan.seq, error)
            logger.debug("%s", traceback.format_exc())
        finally:
            ctx.plan = None
        ok = group_ok(error is None and not cancelled, group)
        beat.set_busy(False)
        logger.debug(
            "rank %d (group %d): plan %d done in %.3fs ok=%s",
            ranks.rank,
            replica.index,
            plan.seq,
            time.perf_counter() - started,
            ok,
        )
        record.write(plan, started_wall, "ok" if ok else "cancelled" if cancelled else "failed")
        if leader and on_done is not None:
            if ok:
                on_done(plan.seq, outputs)
            elif cancelled:
                on_done(plan.seq, PLAN_CANCELLED)
            else:
                on_done(plan.seq, error or "the batch failed on another rank (see that rank's log)")


class PlanRecord:
    """With ``TILECAST_PLAN_LOG_DIR`` set, every rank appends one JSON line per plan it ran to
    ``rank<N>.jsonl`` there: ``rank``, ``group``, ``seq``, ``job_ids``, wall-clock ``start``/``end``
    and ``outcome`` (which group ran which jobs, and when: operators and tests read it)."""

    def __init__(self, path: Path | None, rank: int, group: int) -> None:
        self.path, self.rank, self.group = path, rank, group

    @classmethod
    def from_env(cls, rank: int, replica: Replica) -> "PlanRecord":
        directory = os.environ.get("TILECAST_PLAN_LOG_DIR")
        return cls(Path(directory, f"rank{rank}.jsonl") if directory else None, rank, replica.index)

    def write(self, plan: P.Plan, start: float, outcome: str) -> None:
        if self.path is None:
            return
        line = json.dumps(
            {
                "rank": self.rank,
                "group": self.group,
                "seq": plan.seq,
                "job_ids": [item.job_id for item in plan.items],
                "start": start,
                "end": time.time(),
                "outcome": outcome,
            }
        )
        with open(self.path, "a") as log:
            log.write(line + "\n")


def queue_source(work: "queue.Queue[P.Plan | None]") -> Callable[[float], P.Plan | None]:
    """``next_plan`` for rank 0: the scheduler's handoff queue."""

    def next_plan(timeout: float) -> P.Plan | None:
        try:
            return work.get(timeout=timeout)
        except queue.Empty:
            return None

    return next_plan
