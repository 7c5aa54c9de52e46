"""The contract every pipeline implements, and the per-rank context it runs in.

A pipeline is built once on every rank (``Pipeline.load``). Rank 0 validates each request
(``Pipeline.prepare``) before it is queued, so bad input is refused at submit time. The batch
plan that rank 0 broadcasts names the work items; every rank then calls ``Pipeline.run`` with
the same items in the same order, and issues the same collectives. Only the output rank's
return value is used.

Settings arrive typed (``RankContext.settings``, the frozen ``ServeConfig``). A pipeline names the
fields it reads in ``honoured_settings``; its ``load`` calls ``check_settings`` first, so a setting it
cannot honour stops start-up on every rank with an error naming the flag.

While it runs, a pipeline tells its ``RankContext``: ``progress(done, total)`` after each unit
(step, tile) — job progress and the stuck watchdog; ``alive()`` inside long stages that have no
units (a VAE decode) — the watchdog only; and ``cancel_point()`` at boundaries every rank reaches
together, where a batch whose jobs were all cancelled stops (``PlanCancelled``) before writing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator

import msgspec

from tilecast.runtime.config import ServeConfig, UnsupportedSettingError, check_honoured

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
    settings: ServeConfig = dataclasses.field(default_factory=ServeConfig)
    """The server's settings (frozen; every rank has the same). A pipeline reads the fields its
    ``honoured_settings`` names and refuses the others set away from their defaults (``check_settings``)."""
    flat_output: bool = False
    """Write a job's files into ``output_dir`` itself instead of a folder per job (``tilecast generate``)."""
    cache_dir: Path | None = None
    """Where built-in tiny checkpoints are generated (None: ``$TILECAST_CACHE`` or ``~/.cache/tilecast``)."""
    on_progress: Callable[[int, int], None] | None = None
    """Called with (done, total) units; drives progress bars and the stuck watchdog."""
    heartbeat: Callable[[], None] | None = None
    """Tells the stuck watchdog this rank is making progress inside a long stage (no job progress)."""
    plan: "PlanHooks | None" = None
    """Rank 0 while serving: where the running plan's progress goes and whether it was cancelled."""

    @property
    def is_output_rank(self) -> bool:
        return self.rank == 0

    def job_dir(self, job_id: str) -> Path:
        """Where a job's files go: a folder per job when serving (names never collide), the output
        directory itself for ``tilecast generate`` (``flat_output``)."""
        directory = self.output_dir if self.flat_output else self.output_dir / job_id
        directory.mkdir(parents=True, exist_ok=True)
        return directory

    def progress(self, done: int, total: int) -> None:
        """``done`` of ``total`` units of the running plan are finished."""
        if self.on_progress is not None:
            self.on_progress(done, total)
        if self.plan is not None and total > 0:
            self.plan.progress(done / total)

    def alive(self) -> None:
        """A long stage is still moving (feeds the stuck watchdog; cheap, call it often)."""
        if self.heartbeat is not None:
            self.heartbeat()

    def alive_during(self, module) -> contextlib.AbstractContextManager:
        """While inside, every forward of ``module`` or of one of its submodules calls ``alive``
        (a VAE decode is one long stage of many module calls). Nothing is hooked without a heartbeat."""
        return alive_during(module, self.alive if self.heartbeat is not None else None)

    def cancel_point(self) -> None:
        """Stop here on every rank when every job of the running plan was cancelled.

        With several ranks this is one broadcast of one int on the CPU group (rank 0 decides), so
        call it only where every rank of the run is at the same point of the same plan: between
        denoising steps that all ranks take together, between tile rounds, between stages. One rank
        only asks the scheduler's flag. Raises ``PlanCancelled``.
        """
        cancelled = self.plan is not None and self.plan.cancelled()
        if self.world_size > 1 and self.cpu_group is not None:
            from tilecast.runtime.distributed import broadcast_flag  # lazily: this module imports no torch

            cancelled = broadcast_flag(cancelled and self.rank == 0, self.cpu_group)
        if cancelled:
            raise PlanCancelled("every job of this batch was cancelled")


def uncompiled_modules(module) -> list:
    """``module`` and its submodules, except a ``Module.compile()``-d one and everything inside it."""
    compiled: list[str] = []
    kept = []
    for name, sub in module.named_modules():
        if any(name == c or name.startswith(c + ".") for c in compiled):
            continue
        if getattr(sub, "_compiled_call_impl", None) is not None:
            compiled.append(name)
            continue
        kept.append(sub)
    return kept


@contextlib.contextmanager
def alive_during(module, alive: Callable[[], None] | None) -> Iterator[None]:
    """Call ``alive()`` before every forward of ``module`` and its submodules while inside
    (``None``: hook nothing). A Python call per module call: microseconds against a convolution.

    Compiled submodules (``--compile`` compiles FLUX's VAE decoder) are left alone: a hook added
    inside a compiled region changes what its graph was guarded on, so every call recompiled it
    (seconds per batch on the H200), and a hook traced into it would break the graph."""
    if alive is None or module is None:
        yield
        return

    def hook(_module, _args) -> None:
        alive()

    handles = [sub.register_forward_pre_hook(hook) for sub in uncompiled_modules(module)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class PlanCancelled(Exception):
    """Raised on every rank at a cancel point of a plan whose jobs were all cancelled."""


class PlanHooks:
    """Rank 0's link from a running plan back to the scheduler (set by the compute loop)."""

    def __init__(self, seq: int, *, report: Callable[[int, float], None], cancelled: Callable[[int], bool]) -> None:
        self.seq, self._report, self._cancelled = seq, report, cancelled

    def progress(self, fraction: float) -> None:
        self._report(self.seq, fraction)

    def cancelled(self) -> bool:
        return self._cancelled(self.seq)


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
    num_frames_rule: ClassVar[tuple[int, int]] = (1, 0)
    """Frame counts ``m*k + r`` a video model accepts, as ``(m, r)`` (HTTP's ``seconds`` rounds to one)."""

    model_name: str = ""
    """The model path or id this pipeline was loaded from (used in batching rules)."""

    # How ``--model-path`` reaches this pipeline (``runtime/registry.py`` reads these; nothing else
    # lists the pipelines).
    builtin_name: ClassVar[str | None] = None
    """Built-in ``--model-path`` this pipeline serves without a directory (``tiny/flux``, ``test/allreduce``)."""
    diffusers_class: ClassVar[str | None] = None
    """``model_index.json`` ``_class_name`` of the checkpoints it serves (``FluxPipeline``, ...)."""
    model_id_hints: ClassVar[tuple[str, ...]] = ()
    """Substrings of a model id (``--model-id``, or the directory name) that name it, case-insensitively."""

    @classmethod
    def ensure_builtin(cls, cache_dir: Path | None = None) -> Path | None:
        """Generate (or verify) the checkpoint ``builtin_name`` names and return its directory; None
        when the built-in has none on disk. The launcher calls it on one process before the ranks start."""
        return None

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
        return {field: getattr(params, field) for field in params.__struct_fields__ if field not in per_request}

    per_request_fields: ClassVar[tuple[str, ...]] = ("seed", "prompt", "negative_prompt", "output_file_name")
    """Fields each request keeps for itself inside a merged batch."""

    max_batch_size: ClassVar[int] = 1
    """Largest batch ``run`` accepts (1: the family does not batch)."""

    honoured_settings: ClassVar[frozenset[str]] = frozenset({"dtype"})
    """The ``ServeConfig`` fields this pipeline reads (``vae`` for every ``--vae-config.*`` field,
    ``vae.<field>`` for one). Any other pipeline setting (``setting(..., pipeline=True)``) set away
    from its default stops start-up on every rank (``check_settings``), never silently ignored."""
    unsupported_reasons: ClassVar[dict[str, str]] = {}
    """Field name → why this pipeline cannot honour it (added to the refusal)."""
    model_attention_backends: ClassVar[frozenset[str]] = frozenset()
    """The model-specific ``--attention-backend`` names this pipeline serves (``kernels/capabilities.py``
    marks them with their model, e.g. ``nabla`` for Kandinsky 6 SR); any other pipeline refuses them."""

    @classmethod
    def check_settings(cls, settings: ServeConfig, model_path: str | None = None) -> None:
        """Raise ``config.UnsupportedSettingError`` (a ``ValueError``) naming each setting of
        ``settings`` this pipeline does not honour and listing those it does. ``load`` calls it first."""
        check_honoured(
            settings,
            cls.honoured_settings,
            pipeline=getattr(cls, "family", cls.__name__),
            model=model_path,
            reasons=cls.unsupported_reasons,
        )
        backend = getattr(settings, "attention_backend", None)
        from tilecast.kernels import capabilities

        if capabilities.model_attention(backend) is not None:
            if backend not in cls.model_attention_backends:
                raise UnsupportedSettingError(
                    f"{capabilities.model_attention_message(backend)} ({model_path or settings.model_path} is "
                    f"served by {getattr(cls, 'family', cls.__name__)})"
                )
        elif backend is not None:
            from tilecast.kernels.backends import resolve_backend

            # Before any weight loads: an unknown name, or a kernel this machine lacks (fp8 or fa
            # without a GPU, ...): ValueError / BackendUnavailableError naming it and why.
            resolve_backend(backend, getattr(settings, "device", "cpu"))

    @abstractmethod
    def run(self, items: list[WorkItem], ctx: RankContext) -> list[Output]:
        """Execute a batch on every rank, same order everywhere; return one Output per item."""

    def health_request(self) -> tuple[dict[str, Any], dict[str, bytes]] | None:
        """The fields and uploads of the smallest real request (one step), which
        ``GET /health_generate`` submits; None: this pipeline has none."""
        return None

    def close(self) -> None:  # noqa: B027 - a no-op default; pipelines that hold resources override it
        """Release resources at shutdown."""
