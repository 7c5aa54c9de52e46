"""The ``tilecast`` command: serve, generate, topology, bench.

``serve`` and ``generate`` validate everything first, then start ``--num-gpus`` ranks through
torchrun, or run as one rank when already under torchrun (so ``torchrun --nnodes ... -m
tilecast serve ...`` works across nodes).
"""

from __future__ import annotations

import logging
import os
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from tilecast.launcher import options as O
from tilecast.launcher.preflight import validate_topology
from tilecast.runtime.config import ServeConfig

app = typer.Typer(
    name="tilecast",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Serve and run diffusion models on torchrun ranks.",
)
console = Console(stderr=True)
logger = logging.getLogger(__name__)


def _version(value: bool) -> None:
    if value:
        try:
            typer.echo(f"tilecast {version('tilecast')}")
        except PackageNotFoundError:  # a checkout that was never installed
            from tilecast import __version__

            typer.echo(f"tilecast {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    show_version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print tilecast's version and exit.")
    ] = False,
) -> None:
    """Serve and run diffusion models on torchrun ranks."""


def _fail(message: str, code: int = 2) -> None:
    console.print(f"[red]error:[/red] {escape(message)}")  # a message's own brackets are text, not markup
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
    from tilecast.runtime.torchrun_env import under_torchrun

    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != config.num_gpus:
            _fail(f"--num-gpus {config.num_gpus} but torchrun started {world} ranks (WORLD_SIZE)")
        return _guarded(entry)
    if config.num_gpus == 1:
        return _guarded(entry)
    from tilecast.launcher.torchrun import launch

    return launch(config.num_gpus, sys.argv[1:])


ConfigFile = Annotated[
    Optional[Path],
    typer.Option(
        O.CONFIG_FLAG,
        help="TOML or JSON file of settings (keys: the field names); flags override it.",
        dir_okay=False,
    ),
]


@app.command(cls=O.SettingsCommand)
@O.with_settings("serve")
def serve(ctx: typer.Context, settings: dict, config_file: ConfigFile = None) -> None:
    """Serve a model: rank-0 ZeroMQ scheduler, all ranks computing."""
    try:
        config = O.build_config(O.settings_values(settings, config_file, "serve"))
        if config.batching_config is not None:
            from tilecast.scheduler.batching_rules import BatchingRules

            BatchingRules.load(config.batching_config)  # a bad rules file stops start-up here, before any rank starts
        validate_topology(config)
    except ValueError as exc:
        _fail(str(exc))

    def entry() -> int:
        from tilecast.runtime.server import serve as serve_rank

        return serve_rank(config)

    raise typer.Exit(_run_ranks(config, entry))


@app.command(cls=O.SettingsCommand)
@O.with_settings("generate")
def generate(
    ctx: typer.Context,
    settings: dict,
    config_file: ConfigFile = None,
    video_path: Annotated[Optional[Path], typer.Option("--video-path", help="Source video (SR).")] = None,
    image_path: Annotated[
        Optional[list[Path]],
        typer.Option("--image-path", help="Input image (image-to-image models); repeat for several, in order."),
    ] = None,
    sr_resolution_scale: Annotated[Optional[float], typer.Option("--sr-resolution-scale", help="2, 4 or 2.25.")] = None,
    sr_tiles_batch_size: Annotated[Optional[int], typer.Option("--sr-tiles-batch-size")] = None,
    sr_tile_min_overlap: Annotated[Optional[float], typer.Option("--sr-tile-min-overlap")] = None,
    sr_target_resolution: Annotated[
        Optional[str], typer.Option("--sr-target-resolution", help="hd | fullhd | 2k | WxH.")
    ] = None,
    sr_target_resize_mode: Annotated[
        Optional[str], typer.Option("--sr-target-resize-mode", help="fit | exact.")
    ] = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt")] = None,
    width: Annotated[Optional[int], typer.Option("--width")] = None,
    height: Annotated[Optional[int], typer.Option("--height")] = None,
    num_frames: Annotated[Optional[int], typer.Option("--num-frames")] = None,
    guidance_scale: Annotated[Optional[float], typer.Option("--guidance-scale")] = None,
    num_inference_steps: Annotated[Optional[int], typer.Option("--num-inference-steps")] = None,
    seed: Annotated[Optional[int], typer.Option("--seed")] = None,
    layers: Annotated[
        Optional[int], typer.Option("--layers", help="Output layers (layered models: Qwen-Image-Layered).")
    ] = None,
    resolution: Annotated[
        Optional[int], typer.Option("--resolution", help="Size bucket, 640 or 1024 (Qwen-Image-Layered).")
    ] = None,
    save_output: Annotated[
        bool, typer.Option("--save-output/--no-save-output", help="Write the result file (always on).")
    ] = True,
    output_path: Annotated[Path, typer.Option("--output-path", help="Directory for the result.")] = Path("outputs"),
    output_file_name: Annotated[Optional[str], typer.Option("--output-file-name")] = None,
    save_frames: Annotated[bool, typer.Option("--save-frames", help="Also save the raw uint8 frames as .npy.")] = False,
) -> None:
    """Run one request offline on the same ranks and pipeline as ``serve``."""
    if not save_output:
        _fail("--no-save-output: tilecast generate always writes its result; use --output-path to choose where")
    fields = {
        "video_path": str(video_path.resolve()) if video_path else None,
        "sr_resolution_scale": sr_resolution_scale,
        "sr_tiles_batch_size": sr_tiles_batch_size,
        "sr_tile_min_overlap": sr_tile_min_overlap,
        "sr_target_resolution": sr_target_resolution,
        "sr_target_resize_mode": sr_target_resize_mode,
        "prompt": prompt,
        "width": width,
        "height": height,
        "num_frames": num_frames,
        "guidance_scale": guidance_scale,
        "num_inference_steps": num_inference_steps,
        "seed": seed,
        "layers": layers,
        "resolution": resolution,
        "output_file_name": output_file_name,
        "return_frames": True if save_frames else None,
        "image_paths": [str(path.resolve()) for path in image_path] if image_path else None,
    }
    fields = {key: value for key, value in fields.items() if value is not None}
    if video_path is not None and not video_path.is_file():
        _fail(f"--video-path {video_path} is not a file")
    for path in image_path or ():
        if not path.is_file():
            _fail(f"--image-path {path} is not a file")
    try:
        values = O.settings_values(settings, config_file, "generate")
        values |= {
            "output_dir": output_path,
            "allowed_video_dirs": (video_path.resolve().parent,) if video_path else (),
        }
        config = O.build_config(values)
        validate_topology(config)
    except ValueError as exc:
        _fail(str(exc))

    def entry() -> int:
        from tilecast.launcher.generate import generate as generate_rank

        return generate_rank(config, fields)

    raise typer.Exit(_run_ranks(config, entry))


def _mount_subcommands() -> None:
    from tilecast.launcher.bench import bench_app
    from tilecast.launcher.topology_cli import topology_app

    app.add_typer(topology_app, name="topology", help="Validate, pick and plan parallel topologies.")
    app.add_typer(bench_app, name="bench", help="Benchmarks against their peers (GPU).")


_mount_subcommands()


def main() -> None:
    """``tilecast``: run the command, then end the process with its exit status at once.

    The command's files are closed by the time it returns; stdout, stderr and the logging handlers
    are flushed here. What ``os._exit`` skips is the interpreter's teardown of the modules torch,
    diffusers and transformers loaded: about a second of CPU in every rank and single-rank server,
    spent after its work is done (the torchrun agent waits for it before it exits)."""
    try:
        app()
        status = 0
    except SystemExit as exc:
        status = _exit_status(exc.code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _exit_status(code: object) -> int:
    """The process exit status of ``SystemExit(code)``, as Python's own exit makes it (a message is
    printed to stderr and exits 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    main()
