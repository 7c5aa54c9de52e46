"""The output files of finished jobs on rank 0's disk, and how long they stay there.

Pipelines write a served job's files into ``<output dir>/<job id>/`` (or name them by job id in the
output directory). ``OutputStore`` keeps track of the completed jobs whose files are on disk and
deletes them when the client deletes the job (OpenAI's ``DELETE``), when they are older than
``--output-retention-s``, or when more than ``--max-stored-outputs`` jobs hold files (oldest
first). A failed or cancelled job's folder (partial or empty) is removed at once. A job whose
files were deleted keeps its record, with ``expired`` saying why; asking for its result is then a
``gone`` error.
"""

from __future__ import annotations

import collections
import logging
import shutil
import time
from pathlib import Path

from tilecast.scheduler.jobs import COMPLETED

logger = logging.getLogger(__name__)


class OutputStore:
    def __init__(self, root: Path | None, *, retention_s: float | None, max_stored: int, clock=time.time) -> None:
        if max_stored < 1:
            raise ValueError(f"max_stored_outputs must be >= 1, got {max_stored}")
        self.root = Path(root).resolve() if root is not None else None
        self.retention_s, self.max_stored, self.clock = retention_s, max_stored, clock
        self._stored: collections.OrderedDict[str, object] = collections.OrderedDict()
        """Completed jobs whose files are on disk, oldest first."""
        self.deleted = 0
        """Jobs whose files were deleted (expired, evicted or deleted by a client)."""

    def __len__(self) -> int:
        return len(self._stored)

    def add(self, job) -> None:
        """A job reached a terminal state: keep a completed job's files, drop anything else's folder.
        Called before the job's waiters hear of it, so the count bound holds whenever they look."""
        if job.state == COMPLETED and job.output is not None and job.output.files:
            self._stored[job.id] = job
        else:
            self._remove_files(job)
        self.sweep()

    def sweep(self) -> None:
        """Delete the files of the jobs past the age or count bound."""
        now = self.clock()
        while self._stored:
            job = next(iter(self._stored.values()))
            too_many = len(self._stored) > self.max_stored
            too_old = self.retention_s is not None and now - job.finished_at >= self.retention_s
            if not (too_many or too_old):
                return
            reason = (
                f"older than {self.retention_s:g} s (--output-retention-s)"
                if too_old
                else f"more than {self.max_stored} jobs kept their files (--max-stored-outputs)"
            )
            self.remove(job, f"the outputs of job {job.id} were deleted: {reason}")

    def remove(self, job, reason: str) -> None:
        """Delete ``job``'s files now; its record says ``reason`` from then on."""
        self._stored.pop(job.id, None)
        self._remove_files(job)
        if job.output is not None:
            job.output = None
            job.expired = reason
            self.deleted += 1

    def _remove_files(self, job) -> None:
        if self.root is None:
            return
        for item in job.output.files if job.output is not None else ():
            path = Path(item.path)
            if self._inside(path):
                path.unlink(missing_ok=True)
        folder = self.root / job.id
        if folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder, ignore_errors=True)

    def _inside(self, path: Path) -> bool:
        try:
            return path.resolve().is_relative_to(self.root)
        except OSError:
            return False
