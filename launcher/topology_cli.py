"""``tilecast topology check|auto|plan``: tilecast's topology rules and the deployment guide's recipes.

``check`` prints the resolved layout with every error of the one rule set (``Topology.check``:
layout, the model's DiT, the attention kernels, FSDP) and, beside them, the Kandinsky 6 SR
deployment picker's findings (``runtime/picker.py``): its recipe errors, shown as "outside the
deployment guide's recipes", and its warnings and notes, verbatim. ``auto`` prints the picker's
automatic layout for a GPU count; ``plan`` prints the ``tilecast serve`` command (under
``torchrun`` for several nodes). Each takes ``--json`` for scripts. Exit status: 0 when the rule
set accepts the layout (recipe findings never change it), 1 invalid (every error listed), 2 bad
usage. ``--num-gpus`` is the world size, all nodes together.

Mounted by the root app as ``app.add_typer(topology_app, name="topology")``; also runnable as
``python -m tilecast.launcher.topology_cli``.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import shlex
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from tilecast.kernels import capabilities
from tilecast.launcher.options import shared_options
from tilecast.runtime import picker
from tilecast.runtime.topology import ModelLimits, Topology, model_limits

logger = logging.getLogger(__name__)

topology_app = typer.Typer(
    name="topology",
    help="Check a parallel layout against tilecast's rules and the deployment guide's recipes, or plan a serve command.",
    no_args_is_help=True,
    add_completion=False,
)


def _choices(name: str, values: tuple[str, ...]) -> type[enum.Enum]:
    return enum.Enum(name, {v.upper(): v for v in values}, type=str)


Hardware = _choices("Hardware", picker.HARDWARE)
Decode = _choices("Decode", picker.DECODE_CHOICES)
Placement = _choices("Placement", picker.PLACEMENT_CHOICES)
Scale = enum.Enum("Scale", {"X2": "2", "X4": "4", "X2_25": "2.25"}, type=str)
TileBatch = enum.Enum("TileBatch", {"ONE": "1", "TWO": "2"}, type=str)

NumGpus = Annotated[int, typer.Option("--num-gpus", help="GPUs (ranks) in all, the world size.")]
NumNodes = Annotated[int, typer.Option("--nnodes", min=1, help="Nodes the GPUs are spread over (torchrun --nnodes).")]
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
ATTENTION_NAMES: tuple[str, ...] = ("platform", *capabilities.backend_names())
"""``--attention-backend`` values: the picker's ``platform`` (tilecast's auto) and every kernel name."""


def _attention_name(value: str) -> str:
    if value not in ATTENTION_NAMES:
        raise typer.BadParameter(f"{value!r} is not one of: {', '.join(ATTENTION_NAMES)}")
    return value


AttentionOpt = Annotated[
    str,
    typer.Option(
        "--attention-backend",
        callback=_attention_name,
        help="platform (auto: FA on datacenter GPUs, SDPA on RTX), or a kernel: "
        + ", ".join(ATTENTION_NAMES[1:])
        + ".",
    ),
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


def _resolve_limits(model_path: str | None, num_heads: int | None) -> ModelLimits:
    """The DiT's limits: ``--num-heads``, or read from ``--model-path``, or the picker's 28 heads."""
    if model_path is not None and num_heads is not None:
        raise typer.BadParameter("give --model-path or --num-heads, not both", param_hint="--num-heads")
    if num_heads is not None:
        return ModelLimits(num_heads=num_heads)
    if model_path is not None:
        try:
            return model_limits(model_path)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--model-path") from exc
    return ModelLimits(num_heads=picker.PICKER_NUM_HEADS)


def _kernel_backend(attention: str) -> str | None:
    """The kernel name the ranks would get (None: auto, which is what ``platform`` means to tilecast)."""
    return None if attention == "platform" else attention


@dataclasses.dataclass(frozen=True, kw_only=True)
class Verdict:
    """The one rule set's errors for a selection, next to the picker's resolution of it."""

    deployment: picker.Deployment
    """The picker's view: layout, recipe errors, warnings, notes, verification."""
    errors: list[str]
    """``Topology.check``'s errors: non-empty means tilecast cannot run it."""
    attention_backend: str
    """``--attention-backend`` as given (``platform`` or a kernel name)."""
    nnodes: int = 1
    """Nodes the world is spread over."""

    @property
    def valid(self) -> bool:
        return not self.errors

    def serve_argv(self, model_path: str) -> list[str]:
        """``tilecast serve ...`` (one node) or ``torchrun --nnodes ... -m tilecast serve ...``."""
        flags = self.deployment.serve_flags()
        if self.attention_backend not in ("platform", self.deployment.attention):
            flags[flags.index("--attention-backend") + 1] = self.attention_backend
        if self.nnodes == 1:
            return ["tilecast", "serve", "--model-path", str(model_path), *flags]
        per_node = self.deployment.selection.gpus_per_node // self.nnodes
        return [
            "torchrun",
            "--nnodes",
            str(self.nnodes),
            "--nproc-per-node",
            str(per_node),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "HOST:PORT",
            "-m",
            "tilecast",
            "serve",
            "--model-path",
            str(model_path),
            *flags,
        ]

    def to_dict(self) -> dict:
        payload = self.deployment.to_dict()
        payload.update(
            valid=self.valid,
            errors=list(self.errors),
            recipe_errors=list(self.deployment.errors),
            nnodes=self.nnodes,
            attention_backend=self.attention_backend,
        )
        return payload


def _deployment(
    *,
    num_gpus: int,
    tp_size: int | None,
    ulysses_degree: int | None,
    ring_degree: int | None,
    limits: ModelLimits,
    nnodes: int = 1,
    hardware: enum.Enum,
    attention: str,
    placement: enum.Enum,
    offload_components: str,
    prefetch: int,
    resident_layers: int,
    decode: enum.Enum,
    scale: enum.Enum,
    tile_batch: enum.Enum,
) -> Verdict:
    manual = any(d is not None for d in (tp_size, ulysses_degree, ring_degree))
    if num_gpus < 1 or num_gpus % nnodes:
        raise typer.BadParameter(f"--num-gpus {num_gpus} does not split evenly over --nnodes {nnodes}")
    try:
        selection = picker.Selection(
            hw=hardware.value,
            nodes=nnodes,
            gpus_per_node=num_gpus,
            topology_mode="manual" if manual else "auto",
            tp_size=1 if tp_size is None else tp_size,
            ulysses_degree=1 if ulysses_degree is None else ulysses_degree,
            ring_degree=1 if ring_degree is None else ring_degree,
            attention=picker.picker_attention(_kernel_backend(attention)),
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
    deployment = picker.resolve_deployment(selection, num_heads=limits.num_heads)
    layout = deployment.topology
    errors = Topology.check(
        num_gpus=num_gpus,
        **dataclasses.asdict(layout),  # the picker's TP, Ulysses and Ring degrees
        num_heads=limits.num_heads,
        ff_dim=limits.ff_dim,
        attention_backend=_kernel_backend(attention),
        fsdp=placement.value == "fsdp",
    )
    return Verdict(deployment=deployment, errors=errors, attention_backend=attention, nnodes=nnodes)


def _print_json(payload: dict) -> None:
    typer.echo(json.dumps(payload, indent=2))


def _print_messages(console: Console, verdict: Verdict, *, warnings: bool = True, notes: bool = True) -> None:
    deployment = verdict.deployment
    sections = [
        ("Errors", "red", "x", verdict.errors),
        ("Outside the deployment guide's recipes", "yellow", "~", deployment.errors),
    ]
    if warnings:
        sections.append(("Warnings", "yellow", "!", deployment.warnings))
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


def _print_summary(console: Console, verdict: Verdict) -> None:
    deployment = verdict.deployment
    s = deployment.selection
    mode = "manual" if s.topology_mode == "manual" else "auto"
    nodes = f" over {verdict.nnodes} nodes" if verdict.nnodes > 1 else ""
    attention = (
        f"{deployment.attention} ({deployment.resolved_settings()['attention']}, from {s.attention})"
        if verdict.attention_backend == "platform"
        else f"{verdict.attention_backend} (recipes: {deployment.attention})"
    )
    rows = [
        ("hardware", picker.HARDWARE_LABELS[s.hw]),
        ("GPUs", f"{s.gpus_per_node}{nodes}"),
        ("topology", f"{deployment.summary} ({mode})"),
        ("DiT heads", "unknown (rule skipped)" if deployment.num_heads is None else str(deployment.num_heads)),
        ("attention", attention),
        ("decode", s.decode),
        ("placement", s.placement + (f" ({s.offload_components})" if s.placement in ("component", "offload") else "")),
        ("request", f"scale x{s.scale}, tile batch {s.tile_batch}"),
        ("verification", f"serve {deployment.verification['serve']}, request {deployment.verification['request']}"),
    ]
    count = len(verdict.errors)
    status = (
        "[bold green]valid[/]" if verdict.valid else f"[bold red]invalid ({count} error{'s' if count != 1 else ''})[/]"
    )
    console.print(f"Deployment: {status}")
    for key, value in rows:
        console.print(f"  {key:<13}{escape(value)}")


def _selection(
    num_gpus: NumGpus,
    nnodes: NumNodes = 1,
    tp_size: TpSize = None,
    ulysses_degree: Ulysses = None,
    ring_degree: Ring = None,
    model_path: ModelPath = None,
    num_heads: NumHeads = None,
    attention_backend: AttentionOpt = "platform",
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


def _selected(selection: dict) -> Verdict:
    """The verdict on a ``_selection`` (the model's limits resolved from ``--model-path``)."""
    options = dict(selection)
    limits = _resolve_limits(options.pop("model_path"), options.pop("num_heads"))
    return _deployment(limits=limits, attention=options.pop("attention_backend"), **options)


@topology_app.command()
@shared_options(_selection)
def check(shared: dict, json_output: JsonOpt = False) -> None:
    """Check a selection against tilecast's rules (exit 1 listing every error) and show the
    deployment guide's recipe findings, warnings and notes beside them."""
    verdict = _selected(shared)
    if json_output:
        _print_json(verdict.to_dict())
    else:
        console = Console(soft_wrap=True, highlight=False)
        _print_summary(console, verdict)
        _print_messages(console, verdict)
    raise typer.Exit(0 if verdict.valid else 1)


@topology_app.command()
def auto(
    num_gpus: NumGpus,
    model_path: ModelPath = None,
    num_heads: NumHeads = None,
    hardware: HardwareOpt = Hardware("gb300"),
    attention_backend: AttentionOpt = "platform",
    json_output: JsonOpt = False,
) -> None:
    """The picker's automatic layout for NUM_GPUS (exit 1 when tilecast's rules reject it)."""
    verdict = _deployment(
        num_gpus=num_gpus,
        tp_size=None,
        ulysses_degree=None,
        ring_degree=None,
        limits=_resolve_limits(model_path, num_heads),
        hardware=hardware,
        attention=attention_backend,
        placement=Placement("resident"),
        offload_components="all",
        prefetch=1,
        resident_layers=0,
        decode=Decode("tiles"),
        scale=Scale("2"),
        tile_batch=TileBatch("1"),
    )
    deployment = verdict.deployment
    t = deployment.topology
    if json_output:
        _print_json(
            {
                "valid": verdict.valid,
                "num_gpus": num_gpus,
                "num_heads": deployment.num_heads,
                "tp_size": t.tp_size,
                "ulysses_degree": t.ulysses_degree,
                "ring_degree": t.ring_degree,
                "summary": deployment.summary,
                "errors": verdict.errors,
                "recipe_errors": deployment.errors,
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
        _print_messages(console, verdict, warnings=False, notes=False)
    raise typer.Exit(0 if verdict.valid else 1)


@topology_app.command()
@shared_options(_selection)
def plan(shared: dict, json_output: JsonOpt = False) -> None:
    """Print the `tilecast serve` command for a valid selection (command on stdout, findings on stderr)."""
    verdict = _selected(shared)
    path = shared["model_path"] or f"/path/to/{picker.DEFAULT_MODEL_NAME}"
    argv = verdict.serve_argv(path) if verdict.valid else None
    if json_output:
        payload = verdict.to_dict()
        payload["argv"] = argv
        payload["command"] = shlex.join(argv) if argv else None
        _print_json(payload)
    else:
        err = Console(stderr=True, soft_wrap=True, highlight=False)
        if argv:
            typer.echo(shlex.join(argv))
        _print_messages(err, verdict)
    raise typer.Exit(0 if verdict.valid else 1)


if __name__ == "__main__":
    topology_app()
