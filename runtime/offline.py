"""``tilecast generate`` on one rank: the same ranks and pipeline as ``serve``, one request, no server.

Rank 0 validates the request exactly as the scheduler would, broadcasts it as a one-item plan,
all ranks run it, rank 0 writes the output. What the user sees (progress bar, the saved paths, the
error) is the launcher's (``launcher/generate.py``): this module only reports through callbacks and
its ``OfflineResult``, so ``runtime/`` imports no terminal UI.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
from pathlib import Path
from typing import Callable

import msgspec
import numpy as np

from tilecast.runtime.config import ServeConfig
from tilecast.runtime.distributed import all_ranks_ok, broadcast_plan, shutdown_ranks
from tilecast.runtime.rank import SignalWatcher, configure_logging, start_rank
from tilecast.runtime.worker import execute_plan
from tilecast.scheduler import protocol as P
from tilecast.scheduler.uploads import materialize, release

logger = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True)
class OfflineResult:
    """What one rank's ``generate`` did (meaningful for the user on rank 0)."""

    rank: int
    """This process's global rank."""
    saved: list[Path] = dataclasses.field(default_factory=list)
    """Rank 0: the files written (the pipeline's outputs, then any ``.npy`` tensors), absolute."""
    error: str | None = None
    """Rank 0: why the request was refused or failed (None: it succeeded)."""
    failed: bool = False
    """The request failed on some rank (every rank agrees)."""

    @property
    def exit_code(self) -> int:
        return 1 if self.failed or self.error else 0


def generate(
    config: ServeConfig,
    fields: dict,
    *,
    on_progress: Callable[[int, int], None] | None = None,
    display: contextlib.AbstractContextManager | None = None,
) -> OfflineResult:
    """Run one request (``fields``: the request's fields) on every rank. ``on_progress(done, total)``
    after each unit of work; ``display`` is entered while the plan runs (a progress bar)."""
    SignalWatcher.install(lambda signum: os._exit(128 + signum if signum != signal.SIGINT else 130))
    rank = int(os.environ.get("RANK", "0"))
    configure_logging(rank, "WARNING")
    rt = start_rank(config, on_progress=on_progress)
    rt.ctx.flat_output = True  # the user named the output directory: write into it, no job folder
    result = OfflineResult(rank=rt.ranks.rank)
    plan = None
    if rt.ranks.rank == 0:
        try:
            fields = dict(fields)
            image_paths = fields.pop("image_paths", [])  # --image-path: read here, uploaded as the client would
            uploads: dict = {f"image.{index}": Path(path).read_bytes() for index, path in enumerate(image_paths)}
            if uploads and "image" not in rt.pipeline.upload_fields:
                raise ValueError(f"--image-path: {rt.pipeline.family} takes no input image")
            params = msgspec.convert(fields, rt.pipeline.params_type)
            params = rt.pipeline.prepare(params, uploads)  # a video_path comes back opened in ``uploads``
            item = P.PlanItem(job_id="offline", params=msgspec.to_builtins(params), uploads=materialize(uploads))
            release(uploads)
            plan = P.Plan(seq=1, kind="run", items=[item])
        except (msgspec.ValidationError, ValueError) as exc:
            result.error = str(exc)
            plan = P.Plan(seq=1, kind="stop")
    plan = broadcast_plan(plan, rt.ranks)
    if plan.kind == "run":
        outputs, failure = None, None
        with display if display is not None else contextlib.nullcontext():
            try:
                outputs = execute_plan(plan, rt.pipeline, rt.ctx)
            except Exception as exc:  # noqa: BLE001 - reported below on rank 0
                failure = f"{type(exc).__name__}: {exc}"
        ok = all_ranks_ok(failure is None, rt.ranks)
        result.failed = not ok
        if rt.ranks.rank == 0:
            if ok:
                result.saved += [Path(item.path).resolve() for item in outputs[0].files]
                stem = Path(outputs[0].files[0].name).stem if outputs[0].files else "output"
                for name, tensor in outputs[0].tensors.items():
                    path = (config.output_dir / f"{stem}.{name}.npy").resolve()
                    np.save(path, tensor.cpu().numpy())
                    result.saved.append(path)
            else:
                result.error = failure or "the request failed on another rank (see its log)"
    rt.pipeline.close()
    shutdown_ranks(rt.ranks)
    return result
