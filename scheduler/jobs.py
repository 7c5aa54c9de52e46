"""Jobs and their states on rank 0.

queued -> running -> completed | failed | cancelled, and queued -> cancelled | failed. Every
accepted job reaches exactly one terminal state; ``JobTable.finish`` enforces it.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections import Counter
from typing import Any

from tilecast.scheduler.uploads import UploadBudget, held_bytes, release

QUEUED, RUNNING, COMPLETED, FAILED, CANCELLED = "queued", "running", "completed", "failed", "cancelled"
TERMINAL = frozenset({COMPLETED, FAILED, CANCELLED})


@dataclasses.dataclass(kw_only=True, eq=False)
class Waiter:
    """A client parked on ``result(wait=True)``."""

    identity: bytes
    req_id: int
    as_paths: bool


@dataclasses.dataclass(kw_only=True, eq=False)
class Job:
    id: str
    params: Any
    """The pipeline's validated parameter Struct."""
    wire_params: dict
    """The same parameters as plain builtins, for the broadcast plan."""
    uploads: dict
    """Upload name -> bytes or ``uploads.PinnedFile``; emptied (files closed) once the job is dispatched or ends."""
    upload_bytes: int = 0
    """Bytes of ``uploads`` held in memory while queued (counted against ``--max-queued-upload-mb``)."""
    state: str = QUEUED
    created_at: float = dataclasses.field(default_factory=time.time)
    batching_view: Any = None
    """The batcher's ``QueuedRequest`` for this job, built once at submit (params never change)."""
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None
    progress: float = 0.0
    output: Any = None
    """The pipeline's ``Output`` once completed."""
    cancel_requested: bool = False
    deleted: bool = False
    """A client deleted the job: lookups no longer find it; a running one is forgotten when its batch ends."""
    expired: str | None = None
    """Why the output files of this completed job are gone (``outputs.OutputStore``), else None."""
    waiters: list[Waiter] = dataclasses.field(default_factory=list)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL


class JobTable:
    """All jobs by id plus the FIFO queue of waiting ones."""

    def __init__(self, *, max_queued: int, max_queued_upload_bytes: int = 2**62, max_finished: int = 10_000) -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {max_queued}")
        self.max_queued = max_queued
        self.uploads = UploadBudget(max_queued_upload_bytes)
        """Upload bytes held by queued jobs (``--max-queued-upload-mb``)."""
        self.max_finished = max_finished
        self.jobs: dict[str, Job] = {}
        self.queue: list[Job] = []
        self._finished_order: dict[str, None] = {}
        """Ids of terminal jobs, oldest first (a dict: ordered, O(1) removal)."""

    @staticmethod
    def new_id() -> str:
        return "job_" + secrets.token_hex(12)

    def full(self) -> bool:
        return len(self.queue) >= self.max_queued

    def add(self, job: Job) -> str | None:
        """Queue ``job``; or return why not (its uploads would pass the queued-upload cap)."""
        assert job.id not in self.jobs
        job.upload_bytes = held_bytes(job.uploads)
        refusal = self.uploads.admit(job.upload_bytes)
        if refusal is not None:
            release(job.uploads)
            return refusal
        self.jobs[job.id] = job
        self.queue.append(job)
        return None

    def _unqueue(self, job: Job) -> None:
        self.queue.remove(job)
        self.uploads.give_back(job.upload_bytes)
        job.upload_bytes = 0

    def get(self, job_id: str) -> Job | None:
        """The job, unless it is unknown or was deleted."""
        job = self.jobs.get(job_id)
        return None if job is None or job.deleted else job

    def start(self, jobs: list[Job]) -> None:
        now = time.time()
        for job in jobs:
            assert job.state == QUEUED, job.state
            self._unqueue(job)
            job.state = RUNNING
            job.started_at = now

    def finish(self, job: Job, state: str, *, error: str | None = None, output: Any = None) -> list[Job]:
        """Make ``job`` terminal; returns the oldest terminal jobs forgotten to keep ``max_finished``."""
        assert state in TERMINAL and not job.terminal, (job.state, state)
        if job.state == QUEUED:
            self._unqueue(job)
        release(job.uploads)
        job.state, job.error, job.output = state, error, output
        job.finished_at = time.time()
        if state == COMPLETED:
            job.progress = 1.0
        job.uploads = {}
        self._finished_order[job.id] = None
        evicted = []
        while len(self._finished_order) > self.max_finished:
            oldest = next(iter(self._finished_order))
            del self._finished_order[oldest]
            evicted.append(self.jobs.pop(oldest))
        return evicted

    def forget(self, job: Job) -> None:
        """Drop a terminal job's record (it was deleted)."""
        assert job.terminal, job.state
        self.jobs.pop(job.id, None)
        self._finished_order.pop(job.id, None)

    def active(self) -> list[Job]:
        return [job for job in self.jobs.values() if not job.terminal]

    def counts(self) -> dict[str, int]:
        counts = Counter(job.state for job in self.jobs.values())
        return {state: counts.get(state, 0) for state in (QUEUED, RUNNING, COMPLETED, FAILED, CANCELLED)}

    def position(self, job: Job) -> int | None:
        """Index of ``job`` in the queue; None once it left it (looked up only while queued: a failed
        ``list.index`` formats the job's repr, outputs included, into its error)."""
        if job.state != QUEUED:
            return None
        try:
            return self.queue.index(job)
        except ValueError:
            return None
