"""``tilecast topology check|auto|plan``: the deployment picker's rules for operators.

``check`` prints the resolved layout with every error, warning and note; ``auto`` prints the
automatic layout for a GPU count; ``plan`` prints the ``tilecast serve`` command. Each takes
``--json`` for scripts. Exit status: 0 valid, 1 invalid (every error listed), 2 bad usage.

Mounted by the root app as ``app.add_typer(topology_app, name="topology")``; also runnable as
``python -m tilecast.launcher.topology_cli``.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from tilecast.launcher.options import shared_options
from tilecast.runtime import picker
from tilecast.runtime.topology import num_heads_from_checkpoint

logger = logging.getLogger(__name__)

topology_app = typer.Typer(
    name="topology",
    help="Check a parallel layout against the deployment picker's rules, or plan a serve command.",
    no_args_is_help=True,
    add_completion=False,
)


def _choices(name: str, values: tuple[str, ...]) -> type[enum.Enum]:
    return enum.Enum(name, {v.upper(): v for v in values}, type=str)


Hardware = _choices("Hardware", picker.HARDWARE)
Attention = _choices("Attention", picker.ATTENTION_CHOICES)
Decode = _choices("Decode", picker.DECODE_CHOICES)
Placement = _choices("Placement", picker.PLACEMENT_CHOICES)
Scale = enum.Enum("Scale", {"X2": "2", "X4": "4", "X2_25": "2.25"}, type=str)
TileBatch = enum.Enum("TileBatch", {"ONE": "1", "TWO": "2"}, type=str)

NumGpus = Annotated[int, typer.Option("--num-gpus", help="GPUs (ranks) on the node.")]
TpSize = Annotated[Optional[int], typer.Option("--tp-size", help="TP degree (any degree given: manual layout).")]
Ulysses = Annotated[Optional[int], typer.Option("--ulysses-degree", help="Ulysses degree.")]
Ring = Annotated[Optional[int], typer.Option("--ring-degree", help="Ring degree.")]
ModelPath = Annotated[
    Optional[str],
    typer.Option("--model-path", help="Read the DiT's head count from this checkpoint (or tiny/k6sr)."),
]
NumHeads = Annotated[
    Optional[int],
    typer.Option("--num-heads", min=1, help="DiT attention heads [default: 28, Kandinsky 6 SR]."),
]
AttentionOpt = Annotated[
    Attention,
    typer.Option("--attention-backend", help="platform: FA on datacenter GPUs, SDPA on RTX."),
]
HardwareOpt = Annotated[Hardware, typer.Option("--hardware", help="GPU model.")]
PlacementOpt = Annotated[Placement, typer.Option("--placement", help="Weight placement.")]
OffloadOpt = Annotated[
    str,
    typer.Option(
        "--offload-components",
        help="With component/layerwise offload: all, or transformer/vae/latent_upscaler (space or comma separated).",
    ),
]
PrefetchOpt = Annotated[int, typer.Option("--prefetch", help="DiT layers prefetched when streaming the DiT (1-4).")]
ResidentOpt = Annotated[
    int, typer.Option("--resident-layers", help="Leading DiT layers kept on GPU when streaming the DiT (0-8).")
]
DecodeOpt = Annotated[Decode, typer.Option("--decode", help="VAE decode mode.")]
ScaleOpt = Annotated[Scale, typer.Option("--scale", help="Request upscale factor.")]
TileBatchOpt = Annotated[TileBatch, typer.Option("--tile-batch", help="Request tiles per DiT call.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")]


def _resolve_heads(model_path: str | None, num_heads: int | None) -> int | None:
    if model_path is not None and num_heads is not None:
        raise typer.BadParameter("give --model-path or --num-heads, not both", param_hint="--num-heads")
    if num_heads is not None:
        return num_heads
    if model_path is not None:
        try:
            return num_heads_from_checkpoint(model_path)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--model-path") from exc
    return picker.PICKER_NUM_HEADS


def _deployment(
    *,
    num_gpus: int,
    tp_size: int | None,
    ulysses_degree: int | None,
    ring_degree: int | None,
    num_heads: int | None,
    hardware: enum.Enum,
    attention: enum.Enum,
    placement: enum.Enum,
    offload_components: str,
    prefetch: int,
    resident_layers: int,
    decode: enum.Enum,
    scale: enum.Enum,
    tile_batch: enum.Enum,
) -> picker.Deployment:
    manual = any(d is not None for d in (tp_size, ulysses_degree, ring_degree))
    try:
        selection = picker.Selection(
            hw=hardware.value,
            nodes=1,
            gpus_per_node=num_gpus,
            topology_mode="manual" if manual else "auto",
            tp_size=1 if tp_size is None else tp_size,
            ulysses_degree=1 if ulysses_degree is None else ulysses_degree,
            ring_degree=1 if ring_degree is None else ring_degree,
            attention=attention.value,
            decode=decode.value,
            placement=placement.value,
            offload_components=offload_components,
            prefetch=prefetch,
            resident_layers=resident_layers,
            scale=scale.value,
            tile_batch=tile_batch.value,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    return picker.resolve_deployment(selection, num_heads=num_heads)


def _print_json(payload: dict) -> None:
    typer.echo(json.dumps(payload, indent=2))


def _print_messages(console: Console, deployment: picker.Deployment, *, notes: bool = True) -> None:
    sections = [("Errors", "red", "x", deployment.errors), ("Warnings", "yellow", "!", deployment.warnings)]
    if notes:
        sections.append(("Notes", "dim", "-", deployment.notes))
    for title, style, mark, messages in sections:
        if not messages:
            continue
        console.print(f"[bold {style}]{title}:[/]")
        for message in messages:
            console.print(f"  [{style}]{mark}[/] {escape(message)}")
    if deployment.suggestion is not None:
        console.print(f"[bold]Suggested valid layout:[/] {deployment.suggestion.describe()}")


def _print_summary(console: Console, deployment: picker.Deployment) -> None:
    s = deployment.selection
    mode = "manual" if s.topology_mode == "manual" else "auto"
    rows = [
        ("hardware", picker.HARDWARE_LABELS[s.hw]),
        ("GPUs", str(s.gpus_per_node)),
        ("topology", f"{deployment.summary} ({mode})"),
        ("DiT heads", "unknown (rule skipped)" if deployment.num_heads is None else str(deployment.num_heads)),
        ("attention", f"{deployment.attention} ({deployment.resolved_settings()['attention']}, from {s.attention})"),
        ("decode", s.decode),
        ("placement", s.placement + (f" ({s.offload_components})" if s.placement in ("component", "offload") else "")),
        ("request", f"scale x{s.scale}, tile batch {s.tile_batch}"),
        ("verification", f"serve {deployment.verification['serve']}, request {deployment.verification['request']}"),
    ]
    status = "[bold green]valid[/]" if deployment.valid else f"[bold red]invalid ({len(deployment.errors)} error{'s' if len(deployment.errors) != 1 else ''})[/]"
    console.print(f"Kandinsky 6 SR deployment: {status}")
    for key, value in rows:
        console.print(f"  {key:<13}{escape(value)}")


def _selection(
    num_gpus: NumGpus,
    tp_size: TpSize = None,
    ulysses_degree: Ulysses = None,
    ring_degree: Ring = None,
    model_path: ModelPath = None,
    num_heads: NumHeads = None,
    attention_backend: AttentionOpt = Attention("platform"),
    hardware: HardwareOpt = Hardware("gb300"),
    placement: PlacementOpt = Placement("resident"),
    offload_components: OffloadOpt = "all",
    prefetch: PrefetchOpt = 1,
    resident_layers: ResidentOpt = 0,
    decode: DecodeOpt = Decode("tiles"),
    scale: ScaleOpt = Scale("2"),
    tile_batch: TileBatchOpt = TileBatch("1"),
) -> None:
    """Declares the selection ``check`` and ``plan`` take (``shared_options``)."""


def _selected(selection: dict) -> picker.Deployment:
    """The deployment of a ``_selection`` (the model's heads resolved from ``--model-path``)."""
    options = dict(selection)
    num_heads = _resolve_heads(options.pop("model_path"), options.pop("num_heads"))
    return _deployment(num_heads=num_heads, attention=options.pop("attention_backend"), **options)


@topology_app.command()
@shared_options(_selection)
def check(shared: dict, json_output: JsonOpt = False) -> None:
    """Resolve a selection and list every error, warning and note (exit 1 when invalid)."""
    deployment = _selected(shared)
    if json_output:
        _print_json(deployment.to_dict())
    else:
        console = Console(soft_wrap=True, highlight=False)
        _print_summary(console, deployment)
        _print_messages(console, deployment)
    raise typer.Exit(0 if deployment.valid else 1)


@topology_app.command()
def auto(
    num_gpus: NumGpus,
    model_path: ModelPath = None,
    num_heads: NumHeads = None,
    hardware: HardwareOpt = Hardware("gb300"),
    attention_backend: AttentionOpt = Attention("platform"),
    json_output: JsonOpt = False,
) -> None:
    """The picker's automatic layout for NUM_GPUS (exit 1 when that layout is invalid)."""
    deployment = _deployment(
        num_gpus=num_gpus, tp_size=None, ulysses_degree=None, ring_degree=None,
        num_heads=_resolve_heads(model_path, num_heads), hardware=hardware, attention=attention_backend,
        placement=Placement("resident"), offload_components="all", prefetch=1, resident_layers=0,
        decode=Decode("tiles"), scale=Scale("2"), tile_batch=TileBatch("1"),
    )
    t = deployment.topology
    if json_output:
        _print_json(
            {
                "valid": deployment.valid,
                "num_gpus": num_gpus,
                "num_heads": deployment.num_heads,
                "tp_size": t.tp_size,
                "ulysses_degree": t.ulysses_degree,
                "ring_degree": t.ring_degree,
                "summary": deployment.summary,
                "errors": deployment.errors,
                "suggestion": deployment.to_dict()["suggestion"],
            }
        )
    else:
        console = Console(soft_wrap=True, highlight=False)
        heads = "unknown" if deployment.num_heads is None else deployment.num_heads
        console.print(f"{num_gpus} GPUs, {heads} heads: {deployment.summary}")
        console.print(
            f"  --tp-size {t.tp_size} --ulysses-degree {t.ulysses_degree} --ring-degree {t.ring_degree}",
            markup=False,
        )
        _print_messages(console, dataclasses.replace(deployment, warnings=[]), notes=False)
    raise typer.Exit(0 if deployment.valid else 1)


@topology_app.command()
@shared_options(_selection)
def plan(shared: dict, json_output: JsonOpt = False) -> None:
    """Print the `tilecast serve` command for a valid selection (command on stdout, warnings on stderr)."""
    deployment = _selected(shared)
    path = shared["model_path"] or f"/path/to/{picker.DEFAULT_MODEL_NAME}"
    if json_output:
        payload = deployment.to_dict()
        payload["argv"] = deployment.serve_argv(path) if deployment.valid else None
        payload["command"] = deployment.serve_command(path) if deployment.valid else None
        _print_json(payload)
    else:
        err = Console(stderr=True, soft_wrap=True, highlight=False)
        if deployment.valid:
            typer.echo(deployment.serve_command(path))
        _print_messages(err, deployment)
    raise typer.Exit(0 if deployment.valid else 1)


if __name__ == "__main__":
    topology_app()
