"""The contract every pipeline implements, and the per-rank context it runs in.

A pipeline is built once on every rank (``Pipeline.load``). Rank 0 validates each request
(``Pipeline.prepare``) before it is queued, so bad input is refused at submit time. The batch
plan that rank 0 broadcasts names the work items; every rank then calls ``Pipeline.run`` with
the same items in the same order, and issues the same collectives. Only the output rank's
return value is used.
"""

from __future__ import annotations

import dataclasses
import logging
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable, ClassVar

import msgspec

logger = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True)
class RankContext:
    """What a pipeline needs to know about the rank it runs on."""

    rank: int
    """Global rank of this process."""
    world_size: int
    """Number of ranks."""
    device: Any
    """``torch.device`` the pipeline computes on."""
    cpu_group: Any
    """A gloo process group over all ranks (plans, small CPU collectives)."""
    device_group: Any
    """The process group for device tensors (NCCL on CUDA, the gloo group on CPU)."""
    output_dir: Path
    """Where the output rank writes result files."""
    groups: Any = None
    """``tilecast.runtime.topology.ParallelGroups`` of this run's mesh (None with one rank)."""
    options: dict = dataclasses.field(default_factory=dict)
    """Server-wide pipeline options (topology, attention backend, vae config, ...)."""
    on_progress: Callable[[int, int], None] | None = None
    """Called with (done, total) units; drives progress bars, job progress and the stuck watchdog."""

    @property
    def is_output_rank(self) -> bool:
        return self.rank == 0

    def job_dir(self, job_id: str) -> Path:
        """Where a job's files go: a folder per job when serving (names never collide), the output
        directory itself for ``tilecast generate`` (option ``flat_output``)."""
        directory = self.output_dir if self.options.get("flat_output") else self.output_dir / job_id
        directory.mkdir(parents=True, exist_ok=True)
        return directory

    def progress(self, done: int, total: int) -> None:
        if self.on_progress is not None:
            self.on_progress(done, total)


@dataclasses.dataclass(kw_only=True)
class WorkItem:
    """One request inside a broadcast batch plan."""

    job_id: str
    params: msgspec.Struct
    """The pipeline's validated parameter struct (``Pipeline.params_type``)."""
    uploads: dict[str, bytes] = dataclasses.field(default_factory=dict)
    """Client-uploaded payloads by name (``video`` for SR)."""


@dataclasses.dataclass(kw_only=True)
class OutputFile:
    """A file produced for a request; ``path`` lives on the output rank's filesystem."""

    name: str
    path: Path
    mime: str


@dataclasses.dataclass(kw_only=True)
class Output:
    """A pipeline's result for one work item (meaningful on the output rank)."""

    files: list[OutputFile] = dataclasses.field(default_factory=list)
    tensors: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Named ``torch.Tensor`` results sent back as raw frames (tests, raw-frame clients)."""
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Small JSON-able facts (sizes, timings) returned with the result."""


class Pipeline(ABC):
    """Base class of all pipelines. Subclasses set the class attributes and implement the hooks."""

    family: ClassVar[str]
    """Model family name, e.g. ``"k6sr"``, ``"flux"``."""
    task: ClassVar[str]
    """``"sr"``, ``"t2i"`` or ``"t2v"``."""
    params_type: ClassVar[type[msgspec.Struct]]
    """msgspec Struct of the request fields (``forbid_unknown_fields=True``); defaults live here."""
    upload_fields: ClassVar[tuple[str, ...]] = ()
    """Request fields that may carry uploaded bytes (sent as extra frames), e.g. ``("video",)``."""

    model_name: str = ""
    """The model path or id this pipeline was loaded from (used in batching rules)."""

    @classmethod
    @abstractmethod
    def load(cls, model_path: str, ctx: RankContext) -> "Pipeline":
        """Build the pipeline on this rank (every rank calls this once at start-up)."""

    def prepare(self, params: msgspec.Struct, uploads: dict[str, bytes]) -> msgspec.Struct:
        """Rank 0, before queueing: check the request beyond types; raise ``ValueError`` naming the problem.

        May return an updated params struct (e.g. with defaults resolved)."""
        return params

    def batch_key(self, params: msgspec.Struct) -> dict[str, Any]:
        """Fields that must be equal for two requests to share a batch (ordered, first differing field
        is the reject reason). Default: every field except the per-request ones."""
        per_request = set(self.per_request_fields)
        return {
            field: getattr(params, field)
            for field in params.__struct_fields__
            if field not in per_request
        }

    per_request_fields: ClassVar[tuple[str, ...]] = ("seed", "prompt", "negative_prompt", "output_file_name")
    """Fields each request keeps for itself inside a merged batch."""

    max_batch_size: ClassVar[int] = 1
    """Largest batch ``run`` accepts (1: the family does not batch)."""

    @abstractmethod
    def run(self, items: list[WorkItem], ctx: RankContext) -> list[Output]:
        """Execute a batch on every rank, same order everywhere; return one Output per item."""

    def close(self) -> None:
        """Release resources at shutdown."""
