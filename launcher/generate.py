"""What ``tilecast generate`` shows on the terminal: a rich progress bar while the request runs, then
the saved paths or the error (rank 0 only). The run itself is ``runtime/offline.py``."""

from __future__ import annotations

import os

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tilecast.runtime.config import ServeConfig


def generate(config: ServeConfig, fields: dict) -> int:
    """Run one request on this rank (``runtime.offline.generate``) with a progress bar on rank 0;
    returns the exit code (0: saved; 1: refused or failed, the error printed by rank 0)."""
    from tilecast.runtime.offline import generate as generate_rank  # imports torch

    rank = int(os.environ.get("RANK", "0"))
    console = Console(stderr=True)
    progress = Progress(
        TextColumn("[bold]super-resolving" if "video_path" in fields else "[bold]generating"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
        disable=rank != 0,
    )
    task = progress.add_task("work", total=None)

    def on_progress(done: int, total: int) -> None:
        progress.update(task, completed=done, total=total)

    result = generate_rank(config, fields, on_progress=on_progress, display=progress)
    if result.rank == 0:
        for path in result.saved:
            console.print(f"[green]saved[/green] {escape(str(path))}")
        if result.error:
            console.print(f"[red]error:[/red] {escape(str(result.error))}")
    return result.exit_code
