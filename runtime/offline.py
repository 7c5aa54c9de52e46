"""``tilecast generate`` on one rank: the same ranks and pipeline as ``serve``, one request, no server.

Rank 0 validates the request exactly as the scheduler would, broadcasts it as a one-item plan,
all ranks run it, rank 0 writes the output and prints where it is.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import msgspec
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tilecast.runtime.config import ServeConfig
from tilecast.runtime.distributed import all_ranks_ok, broadcast_plan, shutdown_ranks
from tilecast.runtime.rank import SignalWatcher, configure_logging, start_rank
from tilecast.runtime.worker import execute_plan
from tilecast.scheduler import protocol as P
from tilecast.scheduler.uploads import materialize, release

logger = logging.getLogger(__name__)


def generate(config: ServeConfig, fields: dict) -> int:
    """Run one request on every rank; returns the exit code (rank 0 prints the outcome)."""
    SignalWatcher.install(lambda signum: os._exit(128 + signum if signum != signal.SIGINT else 130))
    rank = int(os.environ.get("RANK", "0"))
    configure_logging(rank, "WARNING")
    console = Console(stderr=True)
    progress = Progress(
        TextColumn("[bold]super-resolving" if "video_path" in fields else "[bold]generating"),
        BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=False,
        disable=rank != 0,
    )
    task = progress.add_task("work", total=None)

    def on_progress(done: int, total: int) -> None:
        progress.update(task, completed=done, total=total)

    rt = start_rank(config, on_progress=on_progress)
    rt.ctx.options["flat_output"] = True
    plan, error = None, None
    if rt.ranks.rank == 0:
        try:
            params = msgspec.convert(fields, rt.pipeline.params_type)
            uploads: dict = {}
            params = rt.pipeline.prepare(params, uploads)  # a video_path comes back opened in ``uploads``
            item = P.PlanItem(job_id="offline", params=msgspec.to_builtins(params), uploads=materialize(uploads))
            release(uploads)
            plan = P.Plan(seq=1, kind="run", items=[item])
        except (msgspec.ValidationError, ValueError) as exc:
            error = str(exc)
            plan = P.Plan(seq=1, kind="stop")
    plan = broadcast_plan(plan, rt.ranks)
    code = 0
    if plan.kind == "run":
        outputs, failure = None, None
        with progress:
            try:
                outputs = execute_plan(plan, rt.pipeline, rt.ctx)
            except Exception as exc:  # noqa: BLE001 - reported below on rank 0
                failure = f"{type(exc).__name__}: {exc}"
        ok = all_ranks_ok(failure is None, rt.ranks)
        if rt.ranks.rank == 0:
            if ok:
                for item in outputs[0].files:
                    console.print(f"[green]saved[/green] {Path(item.path).resolve()}")
                stem = Path(outputs[0].files[0].name).stem if outputs[0].files else "output"
                for name, tensor in outputs[0].tensors.items():
                    path = (config.output_dir / f"{stem}.{name}.npy").resolve()
                    np.save(path, tensor.cpu().numpy())
                    console.print(f"[green]saved[/green] {path}")
            else:
                error = failure or "the request failed on another rank (see its log)"
        code = 0 if ok else 1
    if error and rt.ranks.rank == 0:
        console.print(f"[red]error:[/red] {error}")
        code = 1
    rt.pipeline.close()
    shutdown_ranks(rt.ranks)
    return code
