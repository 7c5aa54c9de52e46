"""The ``tilecast`` command: serve, generate, topology, bench.

``serve`` and ``generate`` validate everything first, then start ``--num-gpus`` ranks through
torchrun, or run as one rank when already under torchrun (so ``torchrun --nnodes ... -m
tilecast serve ...`` works across nodes).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from tilecast.launcher import options as O
from tilecast.launcher.preflight import validate_topology
from tilecast.runtime.config import ServeConfig

app = typer.Typer(
    name="tilecast", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    help="Serve and run diffusion models on torchrun ranks.",
)
console = Console(stderr=True)
logger = logging.getLogger(__name__)


def _fail(message: str, code: int = 2) -> None:
    console.print(f"[red]error:[/red] {message}")
    raise typer.Exit(code)


def _guarded(entry) -> int:
    """Run a rank; a user mistake found while loading (``ValueError``) is an error line, not a traceback."""
    try:
        return entry()
    except ValueError as exc:
        rank = os.environ.get("RANK")
        _fail(f"{'rank ' + rank + ': ' if rank else ''}{exc}", code=1)


def _run_ranks(config: ServeConfig, entry) -> int:
    """Under torchrun (or with one rank): run here. Otherwise: re-run this command on N ranks."""
    from tilecast.runtime.distributed import under_torchrun

    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != config.num_gpus:
            _fail(f"--num-gpus {config.num_gpus} but torchrun started {world} ranks (WORLD_SIZE)")
        return _guarded(entry)
    if config.num_gpus == 1:
        return _guarded(entry)
    from tilecast.launcher.torchrun import launch
    from tilecast.runtime.registry import ensure_builtin_checkpoint

    # A built-in tiny checkpoint is generated here, on this one process, before any rank starts:
    # the ranks then only verify it (runtime/cache.py), they never build it concurrently.
    ensure_builtin_checkpoint(config.model_path)
    return launch(config.num_gpus, sys.argv[1:])


@app.command()
@O.with_shared_options
def serve(
    shared: dict,
    allowed_video_dir: O.AllowedVideoDir = None,
    host: Annotated[str, typer.Option("--host", help="Interface to bind (127.0.0.1 unless asked).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Scheduler port (ZeroMQ ROUTER).")] = 30010,
    batching_mode: Annotated[str, typer.Option("--batching-mode", help="off | dynamic.")] = "off",
    batching_max_size: Annotated[int, typer.Option("--batching-max-size", help="Largest merged batch (1: none).")] = 1,
    batching_delay_ms: Annotated[float, typer.Option("--batching-delay-ms", help="Head-of-queue wait for companions.")] = 5.0,
    batching_config: Annotated[Optional[Path], typer.Option("--batching-config", help="JSON batching rules.")] = None,
    enable_batching_metrics: Annotated[bool, typer.Option("--enable-batching-metrics", help="Log dispatch and stats lines.")] = False,
    max_queued_requests: Annotated[int, typer.Option("--max-queued-requests", help="Queue bound (overflow is refused).")] = 256,
    max_message_mb: Annotated[float, typer.Option("--max-message-mb", help="Largest accepted message (ZMQ_MAXMSGSIZE).")] = 512.0,
    output_dir: Annotated[Path, typer.Option("--output-dir", help="Where result files are written.")] = Path("outputs"),
    http_port: Annotated[Optional[int], typer.Option("--http-port", help="Serve the OpenAI-style HTTP API on this port (off unless given; 0: any free port).")] = None,
    http_host: Annotated[str, typer.Option("--http-host", help="Interface the HTTP API binds (127.0.0.1 unless asked).")] = "127.0.0.1",
    max_upload_mb: Annotated[float, typer.Option("--max-upload-mb", help="Largest HTTP request body; bigger ones get 413 before they are read.")] = 512.0,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="TILECAST_API_KEY", show_envvar=True, help="Shared secret clients must present (HTTP Bearer; ZeroMQ CURVE).")] = None,
    allow_unauthenticated: Annotated[bool, typer.Option("--allow-unauthenticated", help="Allow a non-loopback --host/--http-host without --api-key.")] = False,
    ready_file: Annotated[Optional[Path], typer.Option("--ready-file", help="Write the bound endpoints here (JSON) once serving.")] = None,
    output_retention_s: Annotated[Optional[float], typer.Option("--output-retention-s", help="Delete a finished job's files after this many seconds.")] = None,
    max_stored_outputs: Annotated[int, typer.Option("--max-stored-outputs", help="Keep the files of at most this many finished jobs.")] = 10_000,
    max_queued_upload_mb: Annotated[float, typer.Option("--max-queued-upload-mb", help="Total uploads held by queued jobs; beyond it submits are refused (503).")] = 2048.0,
) -> None:
    """Serve a model: rank-0 ZeroMQ scheduler, all ranks computing."""
    try:
        config = O.common_config(
            **shared, allowed_video_dir=allowed_video_dir, output_dir=output_dir, host=host, port=port,
            batching_mode=batching_mode, batching_max_size=batching_max_size, batching_delay_ms=batching_delay_ms,
            batching_config=batching_config, enable_batching_metrics=enable_batching_metrics,
            max_queued_requests=max_queued_requests, max_message_mb=max_message_mb, http_port=http_port,
            http_host=http_host, max_upload_mb=max_upload_mb, api_key=api_key,
            allow_unauthenticated=allow_unauthenticated, ready_file=ready_file, output_retention_s=output_retention_s,
            max_stored_outputs=max_stored_outputs, max_queued_upload_mb=max_queued_upload_mb,
        )
        if batching_config is not None:
            from tilecast.scheduler.batching_rules import BatchingRules

            BatchingRules.load(batching_config)  # a bad rules file stops start-up here, before any rank starts
        validate_topology(config)
    except ValueError as exc:
        _fail(str(exc))

    def entry() -> int:
        from tilecast.runtime.server import serve as serve_rank

        return serve_rank(config)

    raise typer.Exit(_run_ranks(config, entry))


@app.command()
@O.with_shared_options
def generate(
    shared: dict,
    video_path: Annotated[Optional[Path], typer.Option("--video-path", help="Source video (SR).")] = None,
    sr_resolution_scale: Annotated[Optional[float], typer.Option("--sr-resolution-scale", help="2, 4 or 2.25.")] = None,
    sr_tiles_batch_size: Annotated[Optional[int], typer.Option("--sr-tiles-batch-size")] = None,
    sr_tile_min_overlap: Annotated[Optional[float], typer.Option("--sr-tile-min-overlap")] = None,
    sr_target_resolution: Annotated[Optional[str], typer.Option("--sr-target-resolution", help="hd | fullhd | 2k | WxH.")] = None,
    sr_target_resize_mode: Annotated[Optional[str], typer.Option("--sr-target-resize-mode", help="fit | exact.")] = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt")] = None,
    width: Annotated[Optional[int], typer.Option("--width")] = None,
    height: Annotated[Optional[int], typer.Option("--height")] = None,
    num_frames: Annotated[Optional[int], typer.Option("--num-frames")] = None,
    guidance_scale: Annotated[Optional[float], typer.Option("--guidance-scale")] = None,
    num_inference_steps: Annotated[Optional[int], typer.Option("--num-inference-steps")] = None,
    seed: Annotated[Optional[int], typer.Option("--seed")] = None,
    save_output: Annotated[bool, typer.Option("--save-output/--no-save-output", help="Write the result file (always on).")] = True,
    output_path: Annotated[Path, typer.Option("--output-path", help="Directory for the result.")] = Path("outputs"),
    output_file_name: Annotated[Optional[str], typer.Option("--output-file-name")] = None,
    save_frames: Annotated[bool, typer.Option("--save-frames", help="Also save the raw uint8 frames as .npy.")] = False,
) -> None:
    """Run one request offline on the same ranks and pipeline as ``serve``."""
    if not save_output:
        _fail("--no-save-output: tilecast generate always writes its result; use --output-path to choose where")
    fields = {
        "video_path": str(video_path.resolve()) if video_path else None,
        "sr_resolution_scale": sr_resolution_scale, "sr_tiles_batch_size": sr_tiles_batch_size,
        "sr_tile_min_overlap": sr_tile_min_overlap, "sr_target_resolution": sr_target_resolution,
        "sr_target_resize_mode": sr_target_resize_mode, "prompt": prompt, "width": width, "height": height,
        "num_frames": num_frames, "guidance_scale": guidance_scale, "num_inference_steps": num_inference_steps,
        "seed": seed, "output_file_name": output_file_name, "return_frames": True if save_frames else None,
    }
    fields = {key: value for key, value in fields.items() if value is not None}
    if video_path is not None and not video_path.is_file():
        _fail(f"--video-path {video_path} is not a file")
    try:
        config = O.common_config(
            **shared, allowed_video_dir=[video_path.resolve().parent] if video_path else None, output_dir=output_path,
        )
        validate_topology(config)
    except ValueError as exc:
        _fail(str(exc))

    def entry() -> int:
        from tilecast.runtime.offline import generate as generate_rank

        return generate_rank(config, fields)

    raise typer.Exit(_run_ranks(config, entry))


def _mount_subcommands() -> None:
    from tilecast.launcher.topology_cli import topology_app

    from tilecast.launcher.bench import bench_app

    app.add_typer(topology_app, name="topology", help="Validate, pick and plan parallel topologies.")
    app.add_typer(bench_app, name="bench", help="Benchmarks against their peers (GPU).")


_mount_subcommands()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
