"""Rank 0's control thread: requests in, job states, batch decisions, replies out.

It never touches a socket (``SocketThread`` does) and never runs a model (the compute loops
do). It answers status/health/stats/cancel/delete at once, even while batches are running.

The ranks form ``num_groups`` serving groups (data-parallel replicas, ``runtime/replicas.py``;
one group of all ranks by default). Each group runs one batch at a time; whenever a ready group is
idle and the batcher releases a batch, the scheduler hands it to that group (the one idle longest;
with several groups idle, the batch is shared among them, ``split_across_groups``):
group 0, which rank 0 belongs to, through ``work``; the others through ``dispatch(group, plan)``
(``ReplicaHub``). So different groups run different batches at the same time. The compute
thread of group 0 asks ``plan_cancelled(seq)`` at the pipeline's cancel points: true once every
job of the running batch was cancelled, so the batch stops there and writes nothing; the other
groups hear it through ``cancel_plan(group, seq)``. ``stats()["groups"]`` reports each group's load.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Any

import msgspec

from tilecast.scheduler import protocol as P
from tilecast.scheduler.batching import Batcher, BatchingConfig, Dispatch, QueuedRequest
from tilecast.scheduler.batching_metrics import BatchMetrics
from tilecast.scheduler.jobs import CANCELLED, COMPLETED, FAILED, QUEUED, RUNNING, Job, JobTable, Waiter
from tilecast.scheduler.lora import LoraRegistry
from tilecast.scheduler.outputs import OutputStore
from tilecast.scheduler.uploads import materialize, release

logger = logging.getLogger(__name__)

SERVING, STOPPING, DEAD = "serving", "stopping", "dead"


class _PlanCancelled:
    def __repr__(self) -> str:
        return "PLAN_CANCELLED"


PLAN_CANCELLED = _PlanCancelled()
"""The outcome the compute loop reports for a plan stopped at a cancel point (every job cancelled)."""


@dataclasses.dataclass(kw_only=True)
class GroupLoad:
    """One serving group as the scheduler sees it."""

    index: int
    ranks: tuple[int, ...] = ()
    """Global ranks of the group (for ``stats``)."""
    ready: bool = False
    """Its compute loop can take plans (group 0 at once; the others once their leader said hello)."""
    running: int | None = None
    """Seq of the plan it runs, None when idle."""
    busy_since: float | None = None
    idle_since: float = 0.0
    busy_s: float = 0.0
    """Time spent running plans (finished ones)."""
    plans_done: int = 0
    jobs_done: int = 0
    """Jobs of its finished plans, whatever their outcome."""
    jobs_completed: int = 0

    def snapshot(self, now: float) -> dict[str, Any]:
        busy_s = self.busy_s + (now - self.busy_since if self.busy_since is not None else 0.0)
        return {
            "group": self.index,
            "ranks": list(self.ranks),
            "ready": self.ready,
            "busy": self.running is not None,
            "plans_done": self.plans_done,
            "jobs_done": self.jobs_done,
            "jobs_completed": self.jobs_completed,
            "busy_seconds": round(busy_s, 6),
        }


class Scheduler(threading.Thread):
    """Owns the job table. Events arrive on ``inbox``:

    ``("msg", peer, frames)`` from the socket thread, ``("done", plan_seq, outputs | error)`` and
    ``("progress", plan_seq, fraction)`` from the compute loops (group 0's directly, the others'
    through ``ReplicaHub``), ``("replica_ready", group)`` from ``ReplicaHub``, ``("fatal", reason)``
    from the watchdog, ``("shutdown", reason)`` from whoever stops the server.

    ``peer`` is the socket thread's ``Peer``: replies go back through ``send(peer, frames)``, and a
    shutdown request is obeyed only from an authenticated or local peer.
    """

    def __init__(
        self,
        *,
        pipeline,
        send,
        batching: BatchingConfig,
        max_queued: int,
        world_size: int,
        outputs: OutputStore | None = None,
        max_queued_upload_bytes: int = 2**62,
        max_message_bytes: int = 0,
        wire_stats=dict,
        clock=time.monotonic,
        groups: tuple[tuple[int, ...], ...] | None = None,
        dispatch=None,
        cancel_plan=None,
        lora: LoraRegistry | None = None,
    ) -> None:
        super().__init__(name="tilecast-scheduler", daemon=True)
        self.pipeline = pipeline
        self.lora = (
            lora if lora is not None and "lora" in getattr(pipeline.params_type, "__struct_fields__", ()) else None
        )
        """The LoRA adapters (``scheduler/lora.py``); None for a pipeline without LoRA fields."""
        self.send = send
        self.inbox: "queue.Queue[tuple]" = queue.Queue()
        self.work: "queue.Queue[P.Plan | None]" = queue.Queue(maxsize=1)
        self.table = JobTable(max_queued=max_queued, max_queued_upload_bytes=max_queued_upload_bytes)
        self.outputs = outputs if outputs is not None else OutputStore(None, retention_s=None, max_stored=10_000)
        self.max_message_bytes = max_message_bytes
        self.wire_stats = wire_stats
        """Counters of the socket thread (dropped replies, oversize messages, refused handshakes)."""
        self.refused_shutdowns = 0
        self.batching = batching
        self.batcher = Batcher(batching, clock=clock)
        self.metrics = BatchMetrics(stats_every=batching.stats_every)
        self.world_size = world_size
        self.clock = clock
        self.status = SERVING
        self.status_detail = ""
        self._running: dict[int, list[Job]] = {}
        self._cancelled_plans: set[int] = set()
        """Running plans whose every job was cancelled (read by the compute thread)."""
        self._next_seq = 1
        groups = groups if groups is not None else (tuple(range(world_size)),)
        self.groups = [
            GroupLoad(index=g, ranks=tuple(ranks), ready=g == 0, idle_since=clock()) for g, ranks in enumerate(groups)
        ]
        """Serving groups (``runtime/replicas.py``); group 0 takes plans from ``work``."""
        self._dispatch_remote = dispatch
        """``dispatch(group, plan)`` for groups 1.. (``ReplicaHub.send_plan``)."""
        self._cancel_remote = cancel_plan
        """``cancel_plan(group, seq)`` for groups 1.. (``ReplicaHub.cancel``)."""
        self._group_of: dict[int, int] = {}
        """Running plan seq -> the group running it."""
        if len(self.groups) > 1:
            assert dispatch is not None and cancel_plan is not None, "several groups need dispatch and cancel_plan"
        self.stopped = threading.Event()
        """Set once shutdown has been handed to the compute loop (requests are still answered)."""
        self._halt = threading.Event()

    # ------------------------------------------------------------------ loop
    def halt(self) -> None:
        """End the thread (after the process's last replies)."""
        self._halt.set()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                event = self.inbox.get(timeout=self._wait_timeout())
            except queue.Empty:
                event = None
            try:
                if event is not None:
                    self._handle(event)
                self._dispatch()
                self.outputs.sweep()
            except Exception:  # noqa: BLE001 - one bad event must not kill the scheduler
                logger.exception("scheduler event %r failed", event and event[0])

    def _wait_timeout(self) -> float:
        if self._idle_group() is None or not self.table.queue:
            return 0.5
        deadline = self.batcher.next_deadline(self._queued_requests())
        if deadline is None:
            return 0.5
        return min(0.5, max(0.0, deadline - self.clock()))

    def _handle(self, event: tuple) -> None:
        kind = event[0]
        if kind == "msg":
            self._on_message(event[1], event[2])
        elif kind == "done":
            self._on_done(event[1], event[2])
        elif kind == "progress":
            for job in self._running.get(event[1], ()):
                job.progress = max(job.progress, min(1.0, float(event[2])))
        elif kind == "replica_ready":
            self.groups[event[1]].ready = True
            logger.debug("replica group %d ready", event[1])
        elif kind == "fatal":
            self._on_fatal(event[1])
        elif kind == "shutdown":
            self.begin_shutdown(event[1])
        else:
            raise AssertionError(f"unknown event {kind!r}")

    # ------------------------------------------------------------------ requests
    def _on_message(self, identity, frames: list) -> None:
        try:
            msg, payloads = P.decode(frames, allowed=P.REQUEST_TYPES)
        except P.WireError as exc:
            self._reply(identity, P.ErrorReply(req_id=P.peek_req_id(frames), code="bad_request", message=str(exc)))
            return
        handler = {
            P.SubmitRequest: self._on_submit,
            P.StatusRequest: self._on_status,
            P.ResultRequest: self._on_result,
            P.CancelRequest: self._on_cancel,
            P.DeleteRequest: self._on_delete,
            P.HealthRequest: self._on_health,
            P.StatsRequest: self._on_stats,
            P.LoraRequest: self._on_lora,
            P.ShutdownRequest: self._on_shutdown,
        }[type(msg)]
        handler(identity, msg, payloads)

    def _error(self, identity, req_id: int, code: str, message: str) -> None:
        self._reply(identity, P.ErrorReply(req_id=req_id, code=code, message=message))

    def _on_submit(self, identity, msg: P.SubmitRequest, payloads: list) -> None:
        if self.status != SERVING:
            code = "server_dead" if self.status == DEAD else "stopping"
            return self._error(identity, msg.req_id, code, f"server is {self.status}: {self.status_detail}")
        if self.table.full():
            return self._error(
                identity,
                msg.req_id,
                "overloaded",
                f"queue is full ({self.table.max_queued} requests waiting, --max-queued-requests); retry later",
            )
        try:
            job = self._build_job(msg, payloads)
        except ValueError as exc:
            return self._error(identity, msg.req_id, "bad_request", str(exc))
        refusal = self.table.add(job)
        if refusal is not None:
            return self._error(identity, msg.req_id, "overloaded", refusal)
        logger.debug("queued %s", job.id)
        self._reply(identity, self._info(job, msg.req_id))

    def _build_job(self, msg: P.SubmitRequest, payloads: list) -> Job:
        pipe = self.pipeline
        if msg.model is not None and msg.model not in (pipe.model_name, pipe.family):
            raise ValueError(f"this server serves {pipe.model_name!r}, not {msg.model!r}")
        if len(msg.uploads) != len(payloads):
            raise ValueError(f"{len(msg.uploads)} upload names but {len(payloads)} payload frames")
        unknown = [name for name in msg.uploads if name.partition(".")[0] not in pipe.upload_fields]
        if unknown:
            field = unknown[0].partition(".")[0]
            allowed = ", ".join(pipe.upload_fields) or "none"
            raise ValueError(
                f"{field}: {pipe.family} takes no {field} input (unexpected upload {unknown[0]!r}; uploads it accepts: {allowed})"
            )
        uploads = {name: bytes(data) for name, data in zip(msg.uploads, payloads)}
        fields = self.lora.resolve(dict(msg.params)) if self.lora is not None else msg.params
        try:
            params = msgspec.convert(fields, pipe.params_type)
        except msgspec.ValidationError as exc:
            raise ValueError(f"invalid request: {exc}") from exc
        params = pipe.prepare(params, uploads)  # may pin a server-side file into ``uploads``
        job_id = JobTable.new_id()
        width, height = getattr(params, "width", None), getattr(params, "height", None)
        batching_view = QueuedRequest(
            job_id=job_id,
            model=pipe.model_name,
            task=pipe.task,
            key=pipe.batch_key(params),
            resolution=f"{width}x{height}" if width and height else None,
            enqueued_at=self.clock(),
            family_max=pipe.max_batch_size,
        )
        return Job(
            id=job_id,
            params=params,
            wire_params=msgspec.to_builtins(params),
            uploads=uploads,
            batching_view=batching_view,
        )

    def _info(self, job: Job, req_id: int) -> P.JobInfo:
        return P.JobInfo(
            req_id=req_id,
            job_id=job.id,
            state=job.state,
            error=job.error,
            progress=job.progress,
            queue_position=self.table.position(job),
            created_at=job.created_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
        )

    def _lookup(self, identity, req_id: int, job_id: str) -> Job | None:
        job = self.table.get(job_id)
        if job is None:
            self._error(identity, req_id, "not_found", f"no job {job_id!r}")
        return job

    def _on_status(self, identity, msg: P.StatusRequest, _payloads: list) -> None:
        if (job := self._lookup(identity, msg.req_id, msg.job_id)) is not None:
            self._reply(identity, self._info(job, msg.req_id))

    def _on_result(self, identity, msg: P.ResultRequest, _payloads: list) -> None:
        job = self._lookup(identity, msg.req_id, msg.job_id)
        if job is None:
            return
        if job.expired is not None:
            return self._error(identity, msg.req_id, "gone", job.expired)
        waiter = Waiter(identity=identity, req_id=msg.req_id, as_paths=msg.as_paths)
        if job.terminal or not msg.wait:
            self._send_result(job, waiter)
        else:
            job.waiters.append(waiter)

    def _on_cancel(self, identity, msg: P.CancelRequest, _payloads: list) -> None:
        job = self._lookup(identity, msg.req_id, msg.job_id)
        if job is None:
            return
        self._cancel(job, "cancelled by client")
        self._reply(identity, self._info(job, msg.req_id))

    def _cancel(self, job: Job, reason: str) -> None:
        """Cancel a queued job now; a running one at its batch's next cancel point, once every job
        of the batch is cancelled (otherwise its output is discarded when the batch ends)."""
        if job.state == QUEUED:
            self._finish(job, CANCELLED, error=reason)
        elif job.state == RUNNING and not job.cancel_requested:
            job.cancel_requested = True
            for seq, jobs in self._running.items():
                if job in jobs and all(other.cancel_requested for other in jobs):
                    self._cancelled_plans.add(seq)
                    group = self._group_of.get(seq, 0)
                    if group:
                        self._cancel_remote(group, seq)

    def plan_cancelled(self, seq: int) -> bool:
        """Whether every job of running plan ``seq`` was cancelled (safe from the compute thread)."""
        return seq in self._cancelled_plans

    def _on_delete(self, identity, msg: P.DeleteRequest, _payloads: list) -> None:
        job = self._lookup(identity, msg.req_id, msg.job_id)
        if job is None:
            return
        self._cancel(job, "deleted by client")
        info = self._info(job, msg.req_id)
        job.deleted = True
        if job.terminal:
            self._forget(job)
        self._reply(identity, info)

    def _forget(self, job: Job) -> None:
        self.outputs.remove(job, f"job {job.id} was deleted")
        self.table.forget(job)

    def _on_health(self, identity, msg: P.HealthRequest, _payloads: list) -> None:
        self._reply(
            identity,
            P.HealthReply(
                req_id=msg.req_id,
                status=self.status,
                world_size=self.world_size,
                model=self.pipeline.model_name,
                queue_depth=len(self.table.queue),
                running=sum(len(jobs) for jobs in self._running.values()),
                detail=self.status_detail,
                max_message_bytes=self.max_message_bytes,
            ),
        )

    def stats(self) -> dict[str, Any]:
        now = self.clock()
        return {
            "status": self.status,
            "world_size": self.world_size,
            "model": self.pipeline.model_name,
            "queue_depth": len(self.table.queue),
            "jobs": self.table.counts(),
            "queued_upload_bytes": self.table.uploads.held,
            "refused": {
                "queued_upload_cap": self.table.uploads.refused,
                "shutdown": self.refused_shutdowns,
                **{key: value for key, value in self.wire_stats().items() if key != "dropped_replies"},
            },
            "dropped_replies": self.wire_stats().get("dropped_replies", 0),
            "stored_outputs": len(self.outputs),
            "deleted_outputs": self.outputs.deleted,
            "groups": [group.snapshot(now) for group in self.groups],
            "batching": {
                "mode": self.batching.mode,
                "max_size": self.batching.max_size,
                "delay_ms": self.batching.delay_ms,
                **self.metrics.snapshot(),
            },
        }

    def _on_lora(self, identity, msg: P.LoraRequest, _payloads: list) -> None:
        if self.lora is None:
            return self._error(
                identity, msg.req_id, "bad_request", f"{self.pipeline.model_name} takes no LoRA adapters"
            )
        operations = {
            "set": lambda: self.lora.set(msg.nickname, msg.path, msg.strength),
            "merge": lambda: self.lora.merge(msg.strength),
            "unmerge": self.lora.unmerge,
            "list": lambda: None,
        }
        if msg.op not in operations:
            return self._error(identity, msg.req_id, "bad_request", f"unknown LoRA operation {msg.op!r}")
        try:
            operations[msg.op]()
        except ValueError as exc:
            return self._error(identity, msg.req_id, "bad_request", str(exc))
        if msg.op != "list":
            logger.info("LoRA %s: %s", msg.op, self.lora.listing()["active"])
        self._reply(identity, P.LoraReply(req_id=msg.req_id, loras=self.lora.listing()))

    def _on_stats(self, identity, msg: P.StatsRequest, _payloads: list) -> None:
        self._reply(identity, P.StatsReply(req_id=msg.req_id, stats=self.stats()))

    def _on_shutdown(self, identity, msg: P.ShutdownRequest, _payloads: list) -> None:
        if not (identity.authenticated or identity.local):
            self.refused_shutdowns += 1
            return self._error(
                identity,
                msg.req_id,
                "forbidden",
                "shutdown over the network needs the server's API key (--api-key); without one"
                " it is accepted only from this machine",
            )
        self.begin_shutdown("shutdown requested by a client")
        self._on_health(identity, P.HealthRequest(req_id=msg.req_id), [])

    def begin_shutdown(self, reason: str) -> None:
        """Stop accepting work, cancel what is queued, let the running batch finish."""
        if self.status != SERVING:
            return
        logger.info("shutting down: %s", reason)
        self.status, self.status_detail = STOPPING, reason
        for job in list(self.table.queue):
            self._finish(job, CANCELLED, error=f"server shutting down ({reason})")

    # ------------------------------------------------------------------ dispatch
    def _queued_requests(self) -> list[QueuedRequest]:
        return [job.batching_view for job in self.table.queue]

    def _idle_groups(self) -> list[GroupLoad]:
        """The ready groups with nothing running, idle the longest first."""
        idle = [group for group in self.groups if group.ready and group.running is None]
        return sorted(idle, key=lambda group: (group.idle_since, group.index))

    def _idle_group(self) -> GroupLoad | None:
        """The ready group idle the longest, or None when every ready group is busy."""
        idle = self._idle_groups()
        return idle[0] if idle else None

    def _dispatch(self) -> None:
        if self.stopped.is_set():
            return
        if self.status == STOPPING and not self.table.queue and not self._running:
            for group in self.groups:
                if group.ready:
                    self._send_plan(group.index, P.Plan(seq=self._take_seq(), kind="stop"))
            self.stopped.set()
            return
        while self.status == SERVING and self.table.queue:
            idle = self._idle_groups()
            if not idle:
                return
            decision = self.batcher.select(self._queued_requests())
            if decision is None:
                return
            for group, share in zip(idle, split_across_groups(decision, len(idle))):
                self._start(group, share)

    def _start(self, group: GroupLoad, decision: Dispatch) -> None:
        """Send the batch ``decision`` names to ``group`` as one plan."""
        jobs = [self.table.get(job_id) for job_id in decision.job_ids]
        self.table.start(jobs)
        items = []
        for job in jobs:
            items.append(P.PlanItem(job_id=job.id, params=job.wire_params, uploads=materialize(job.uploads)))
            release(job.uploads)
            job.uploads = {}
        for line in self.metrics.record(decision, self.batching.user_max):
            if self.batching.enable_metrics:
                logger.info("%s", line)
        seq = self._take_seq()
        self._running[seq] = jobs
        self._group_of[seq] = group.index
        group.running, group.busy_since = seq, self.clock()
        if len(self.groups) > 1:
            logger.debug("plan %d (%s) -> replica group %d", seq, " ".join(job.id for job in jobs), group.index)
        self._send_plan(group.index, P.Plan(seq=seq, kind="run", items=items))

    def _take_seq(self) -> int:
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        return seq

    def _send_plan(self, group: int, plan: P.Plan) -> None:
        if group == 0:
            self.work.put(plan)  # group 0's compute loop is idle whenever we get here: never blocks
        else:
            self._dispatch_remote(group, plan)

    def _plan_ended(self, seq: int, jobs: list[Job] | None) -> GroupLoad | None:
        """Book the end of plan ``seq`` on its group (the group is idle again); that group."""
        index = self._group_of.pop(seq, None)
        if index is None:
            return None
        group = self.groups[index]
        now = self.clock()
        if group.running == seq:
            group.running = None
            if group.busy_since is not None:
                group.busy_s += now - group.busy_since
            group.busy_since, group.idle_since = None, now
        group.plans_done += 1
        group.jobs_done += len(jobs or ())
        return group

    def _on_done(self, seq: int, result) -> None:
        """A plan ended: ``result`` is its outputs, ``PLAN_CANCELLED``, or an error message."""
        jobs = self._running.pop(seq, None)
        self._cancelled_plans.discard(seq)
        group = self._plan_ended(seq, jobs)
        if jobs is None:  # the server died meanwhile (``_on_fatal`` failed these jobs already)
            return
        if result is PLAN_CANCELLED:
            for job in jobs:
                self._finish(job, CANCELLED, error="cancelled by client while running; stopped before the end")
            return
        if isinstance(result, BaseException) or isinstance(result, str):
            message = str(result)
            for job in jobs:
                self._finish(job, FAILED, error=message)
            return
        completed = 0
        for job, output in zip(jobs, result, strict=True):
            if job.cancel_requested:  # its batch companions ran on: its output is discarded
                self._finish(job, CANCELLED, error="cancelled by client while running", output=output)
            else:
                self._finish(job, COMPLETED, output=output)
                completed += 1
        if group is not None:
            group.jobs_completed += completed

    def _on_fatal(self, reason: str) -> None:
        if self.status == DEAD:
            return
        logger.error("server dead: %s", reason)
        self.status, self.status_detail = DEAD, reason
        self._running.clear()
        for job in self.table.active():
            self._finish(job, FAILED, error=f"server dead: {reason}")

    # ------------------------------------------------------------------ replies
    def _finish(self, job: Job, state: str, *, error: str | None = None, output=None) -> None:
        """Make ``job`` terminal, keep or drop its files, answer its waiters."""
        for evicted in self.table.finish(job, state, error=error, output=output):
            self.outputs.remove(evicted, f"job {evicted.id} was forgotten")
        self.outputs.add(job)  # a failed or cancelled job's files and folder go now
        if state != COMPLETED:
            job.output = None
        waiters, job.waiters = job.waiters, []
        for waiter in waiters:
            self._send_result(job, waiter)
        if job.deleted:
            self._forget(job)

    def _send_result(self, job: Job, waiter: Waiter) -> None:
        metas, frames, info = [], [], {}
        if job.state == COMPLETED and job.output is not None:
            info = dict(job.output.info)
            for item in job.output.files:
                if waiter.as_paths:
                    metas.append(
                        P.OutputMeta(
                            name=item.name,
                            kind="file",
                            mime=item.mime,
                            size=item.path.stat().st_size,
                            path=str(item.path),
                        )
                    )
                else:
                    data = item.path.read_bytes()
                    metas.append(P.OutputMeta(name=item.name, kind="file", mime=item.mime, size=len(data)))
                    frames.append(data)
            for name, tensor in job.output.tensors.items():
                meta, data = P.tensor_to_frame(name, tensor)
                metas.append(meta)
                frames.append(data)
        reply = P.ResultReply(req_id=waiter.req_id, job=self._info(job, waiter.req_id), outputs=metas, info=info)
        self.send(waiter.identity, P.encode(reply, *frames))

    def _reply(self, identity, msg: msgspec.Struct) -> None:
        self.send(identity, P.encode(msg))


def split_across_groups(decision: Dispatch, idle_groups: int) -> list[Dispatch]:
    """The released batch as one share per idle group (at most one per request), in queue order and
    as even as possible: a replica that would otherwise wait takes part of the batch now."""
    count = max(1, min(idle_groups, decision.size))
    if count == 1:
        return [decision]
    size, extra = divmod(decision.size, count)
    shares, start = [], 0
    for index in range(count):
        end = start + size + (index < extra)
        shares.append(dataclasses.replace(decision, job_ids=decision.job_ids[start:end]))
        start = end
    return shares
