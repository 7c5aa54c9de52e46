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
    uploads: dict[str, bytes]
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
    waiters: list[Waiter] = dataclasses.field(default_factory=list)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL


class JobTable:
    """All jobs by id plus the FIFO queue of waiting ones."""

    def __init__(self, *, max_queued: int, max_finished: int = 10_000) -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {max_queued}")
        self.max_queued = max_queued
        self.max_finished = max_finished
        self.jobs: dict[str, Job] = {}
        self.queue: list[Job] = []
        self._finished_order: list[str] = []

    @staticmethod
    def new_id() -> str:
        return "job_" + secrets.token_hex(12)

    def full(self) -> bool:
        return len(self.queue) >= self.max_queued

    def add(self, job: Job) -> None:
        assert job.id not in self.jobs
        self.jobs[job.id] = job
        self.queue.append(job)

    def get(self, job_id: str) -> Job | None:
        return self.jobs.get(job_id)

    def start(self, jobs: list[Job]) -> None:
        now = time.time()
        for job in jobs:
            assert job.state == QUEUED, job.state
            self.queue.remove(job)
            job.state = RUNNING
            job.started_at = now

    def finish(self, job: Job, state: str, *, error: str | None = None, output: Any = None) -> None:
        assert state in TERMINAL and not job.terminal, (job.state, state)
        if job in self.queue:
            self.queue.remove(job)
        job.state, job.error, job.output = state, error, output
        job.finished_at = time.time()
        if state == COMPLETED:
            job.progress = 1.0
        job.uploads = {}
        self._finished_order.append(job.id)
        while len(self._finished_order) > self.max_finished:
            self.jobs.pop(self._finished_order.pop(0), None)

    def active(self) -> list[Job]:
        return [job for job in self.jobs.values() if not job.terminal]

    def counts(self) -> dict[str, int]:
        counts = Counter(job.state for job in self.jobs.values())
        return {state: counts.get(state, 0) for state in (QUEUED, RUNNING, COMPLETED, FAILED, CANCELLED)}

    def position(self, job: Job) -> int | None:
        try:
            return self.queue.index(job)
        except ValueError:
            return None
