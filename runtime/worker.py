"""The compute loop every rank runs: receive rank 0's plan, execute it, agree on the outcome.

Rank 0 takes its next plan from the scheduler (or an ``idle`` plan after ``idle_tick_s``, which
keeps every rank's heartbeat progress moving and bounds how long workers sit in a broadcast).
All ranks then run the same plan in the same order, so their collectives line up. On rank 0 the
plan's ``PlanHooks`` carry its progress to the scheduler and tell the pipeline's cancel points
whether to stop; a plan stopped there is reported as ``PLAN_CANCELLED``.
"""

from __future__ import annotations

import logging
import queue
import time
import traceback
from typing import Callable

import msgspec

from tilecast.runtime.distributed import Ranks, all_ranks_ok, broadcast_plan
from tilecast.runtime.pipeline import Pipeline, PlanCancelled, PlanHooks, RankContext, WorkItem
from tilecast.runtime.watchdog import ProgressBeat
from tilecast.scheduler import protocol as P
from tilecast.scheduler.scheduler import PLAN_CANCELLED

logger = logging.getLogger(__name__)


def execute_plan(plan: P.Plan, pipeline: Pipeline, ctx: RankContext) -> list:
    items = [
        WorkItem(
            job_id=item.job_id,
            params=msgspec.convert(item.params, pipeline.params_type),
            uploads=dict(item.uploads),
        )
        for item in plan.items
    ]
    outputs = pipeline.run(items, ctx)
    if len(outputs) != len(items):
        raise RuntimeError(f"pipeline returned {len(outputs)} outputs for {len(items)} requests")
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
) -> None:
    """Run until a ``stop`` plan. On rank 0 ``next_plan(timeout)`` supplies plans, ``on_done(seq,
    outputs | PLAN_CANCELLED | error_message)`` receives outcomes and ``hooks(seq)`` gives the plan's
    ``PlanHooks``; other ranks pass None for all three.

    A failure inside a pipeline fails that plan's jobs on every rank and the loop goes on; a
    failure of the collectives themselves (a peer died) propagates to the caller.
    """
    seq_seen = 0
    ctx.heartbeat = beat.tick  # ``ctx.alive()`` inside long stages feeds the stuck watchdog
    while True:
        plan = None
        if ranks.rank == 0:
            plan = next_plan(idle_tick_s) or P.Plan(seq=0, kind="idle")
        plan = broadcast_plan(plan, ranks)
        if plan.kind == "stop":
            logger.debug("rank %d: stop", ranks.rank)
            return
        if plan.kind == "idle":
            beat.tick()
            continue
        assert plan.seq > seq_seen, (plan.seq, seq_seen)
        seq_seen = plan.seq
        beat.set_busy(True)
        started = time.perf_counter()
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
        ok = all_ranks_ok(error is None and not cancelled, ranks)
        beat.set_busy(False)
        logger.debug("rank %d: plan %d done in %.3fs ok=%s", ranks.rank, plan.seq, time.perf_counter() - started, ok)
        if ranks.rank == 0 and on_done is not None:
            if ok:
                on_done(plan.seq, outputs)
            elif cancelled:
                on_done(plan.seq, PLAN_CANCELLED)
            else:
                on_done(plan.seq, error or "the batch failed on another rank (see that rank's log)")


def queue_source(work: "queue.Queue[P.Plan | None]") -> Callable[[float], P.Plan | None]:
    """``next_plan`` for rank 0: the scheduler's handoff queue."""

    def next_plan(timeout: float) -> P.Plan | None:
        try:
            return work.get(timeout=timeout)
        except queue.Empty:
            return None

    return next_plan
