"""Load a diffusers-format Kandinsky 6 SR checkpoint into tilecast's runtime, checking it first.

The network classes and weight loading are diffusers' (``from_pretrained``); this module adds the
checks that turn a mismatched checkpoint into one clear ``ValueError`` naming the component:

- every weight file must match its config exactly (missing, unexpected or wrongly shaped
  tensors are refused, never silently initialised or dropped);
- the components must agree with each other (transformer ``in_visual_dim`` = VAE
  ``latent_channels`` = latent upscaler ``in_channels``; trained tile sizes on the latent grid);
- the scheduler must match the transformer's output head. The released SR checkpoint is
  PiFlow-distilled: its head predicts ``n_grid * in_visual_dim`` channels and it ships a
  ``PiflowScheduler``. A ``FlowMatchEulerDiscreteScheduler`` paired with a widened head is refused
  (the scheduler is never swapped: use the distilled checkpoint with its own scheduler).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

PIPELINE_CLASS = "Kandinsky6SRPipeline"
"""``_class_name`` of the checkpoint's ``model_index.json``."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""Accepted ``dtype`` option values."""
TOKEN_BLOCK = 8
"""The transformer groups tokens in 8x8 blocks: tile token grids must be multiples of it."""


@dataclasses.dataclass(kw_only=True)
class K6SRComponents:
    """The loaded, checked networks of one SR checkpoint on one rank."""

    transformer: Any
    """``Kandinsky6SRTransformer3DModel`` (eval mode, on ``device``)."""
    vae: Any
    """``Kandinsky6SRVAE``."""
    latent_upscaler: Any | None
    """``Kandinsky6SRLatentUpscalerBank``, or None (then tiles are upscaled in pixels and encoded)."""
    scheduler: Any
    """The checkpoint's scheduler (a fresh copy is made per tile chunk)."""
    device: torch.device
    """Where the networks live."""
    dtype: torch.dtype
    """Compute dtype of the transformer (noise is drawn in it)."""
    decoder: Any | None = None
    """tilecast's decode of ``vae`` (``vae_decode.ChannelsLastDecoder``); None: diffusers' ``vae.decode``."""

    @property
    def spatial_factor(self) -> int:
        return int(self.vae.spatial_compression_ratio)

    @property
    def temporal_factor(self) -> int:
        return int(self.vae.temporal_compression_ratio)

    @property
    def tile_sizes(self) -> tuple[tuple[int, int], ...]:
        return tuple(tuple(int(v) for v in size) for size in self.transformer.config.tile_sizes)


def parse_dtype(name: str | None) -> torch.dtype:
    """``dtype`` option to a torch dtype (default float32)."""
    if name is None:
        return torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported for k6sr (choose from {', '.join(DTYPES)})")
    return DTYPES[name]


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise ValueError(f"{what}: {path} is missing")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what}: {path} is not valid JSON ({exc})") from exc


def _load_model(cls, folder: Path, name: str, dtype: torch.dtype):
    """``cls.from_pretrained`` with every load-info problem turned into ``ValueError("name: ...")``."""
    if not folder.is_dir():
        raise ValueError(f"{name}: component folder {folder} is missing")
    try:
        model, info = cls.from_pretrained(str(folder), dtype=dtype, output_loading_info=True, local_files_only=True)
    except (ValueError, RuntimeError, OSError, KeyError, TypeError) as exc:
        raise ValueError(f"{name}: cannot load {cls.__name__} from {folder}: {exc}") from exc
    problems = []
    for key, label in (
        ("missing_keys", "missing keys"),
        ("unexpected_keys", "unexpected keys"),
        ("mismatched_keys", "shape mismatches"),
        ("error_msgs", "errors"),
    ):
        values = list(info.get(key) or [])
        if values:
            shown = ", ".join(str(v) for v in values[:5]) + (f" (+{len(values) - 5} more)" if len(values) > 5 else "")
            problems.append(f"{label}: {shown}")
    if problems:
        raise ValueError(f"{name}: weights in {folder} do not match its config.json: " + "; ".join(problems))
    return model.eval()


def _check_scheduler(scheduler, transformer) -> None:
    in_dim = int(transformer.config.in_visual_dim)
    out_dim = int(transformer.config.out_visual_dim)
    kind = type(scheduler).__name__
    if kind == "PiflowScheduler":
        n_grid = int(scheduler.config.n_grid)
        if out_dim != n_grid * in_dim:
            raise ValueError(
                f"scheduler: PiflowScheduler with n_grid={n_grid} needs transformer out_visual_dim = "
                f"n_grid * in_visual_dim = {n_grid * in_dim}, but out_visual_dim is {out_dim}"
            )
    elif kind == "FlowMatchEulerDiscreteScheduler":
        if out_dim != in_dim:
            raise ValueError(
                f"scheduler: FlowMatchEulerDiscreteScheduler expects a velocity head (out_visual_dim == "
                f"in_visual_dim == {in_dim}), but the transformer's head is {out_dim} wide: it is a "
                f"PiFlow-distilled head paired with the wrong scheduler. tilecast does not swap schedulers; "
                f"use the distilled checkpoint (Kandinsky-6.0-VSR-distilled2steps) with its PiflowScheduler"
            )
        logger.warning(
            "scheduler: %s with a velocity head is a non-distilled checkpoint; it needs more than the "
            "distilled 2 steps (set num_inference_steps)",
            kind,
        )
    else:
        raise ValueError(f"scheduler: {kind} is not supported for k6sr (expected PiflowScheduler)")


def _check_components(transformer, vae, upscaler) -> None:
    latent_channels = int(vae.config.latent_channels)
    in_dim = int(transformer.config.in_visual_dim)
    if in_dim != latent_channels:
        raise ValueError(f"transformer in_visual_dim {in_dim} does not match vae latent_channels {latent_channels}")
    if upscaler is not None and int(upscaler.config.in_channels) != latent_channels:
        raise ValueError(
            f"latent_upscaler in_channels {upscaler.config.in_channels} does not match "
            f"vae latent_channels {latent_channels}"
        )
    factor = int(vae.spatial_compression_ratio)
    for size in transformer.config.tile_sizes:
        height, width = (int(v) for v in size)
        if height % (factor * TOKEN_BLOCK) or width % (factor * TOKEN_BLOCK):
            raise ValueError(
                f"transformer tile_sizes entry {height}x{width} is not a multiple of "
                f"{factor * TOKEN_BLOCK} (VAE factor {factor} x token block {TOKEN_BLOCK})"
            )
    if upscaler is not None:
        ups = float(upscaler.config.scaling_factor)
        vs = float(vae.config.scaling_factor)
        if abs(ups - vs) > 1e-6:
            raise ValueError(f"latent_upscaler scaling_factor {ups} does not match vae scaling_factor {vs}")


def load_components(model_dir: str | Path, *, device: torch.device | str, dtype: torch.dtype) -> K6SRComponents:
    """Load and check the checkpoint at ``model_dir`` onto ``device`` in ``dtype``.

    Every rank calls this. ``dtype`` applies to the transformer, VAE and latent upscaler
    (diffusers keeps its ``_keep_in_fp32_modules`` in float32).
    """
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        Kandinsky6SRLatentUpscalerBank,
        Kandinsky6SRTransformer3DModel,
        Kandinsky6SRVAE,
        PiflowScheduler,
    )

    root = Path(model_dir)
    device = torch.device(device)
    index = _read_json(root / "model_index.json", "model_index.json")
    if index.get("_class_name") != PIPELINE_CLASS:
        logger.warning(
            "%s: model_index.json names %r, loading it as %s", root, index.get("_class_name"), PIPELINE_CLASS
        )
    for required in ("transformer", "vae", "scheduler"):
        if not index.get(required) or index[required][1] is None:
            raise ValueError(f"{required}: model_index.json of {root} lists no {required} component")

    transformer = _load_model(Kandinsky6SRTransformer3DModel, root / "transformer", "transformer", dtype)
    vae = _load_model(Kandinsky6SRVAE, root / "vae", "vae", dtype)
    upscaler = None
    if index.get("latent_upscaler") and index["latent_upscaler"][1] is not None:
        upscaler = _load_model(Kandinsky6SRLatentUpscalerBank, root / "latent_upscaler", "latent_upscaler", dtype)
    _check_components(transformer, vae, upscaler)

    scheduler_config = _read_json(root / "scheduler" / "scheduler_config.json", "scheduler")
    scheduler_classes = {
        "PiflowScheduler": PiflowScheduler,
        "FlowMatchEulerDiscreteScheduler": FlowMatchEulerDiscreteScheduler,
    }
    scheduler_name = scheduler_config.get("_class_name")
    if scheduler_name not in scheduler_classes:
        raise ValueError(f"scheduler: {scheduler_name} is not supported for k6sr (expected PiflowScheduler)")
    try:
        scheduler = scheduler_classes[scheduler_name].from_config(scheduler_config)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"scheduler: invalid {scheduler_name} config: {exc}") from exc
    _check_scheduler(scheduler, transformer)

    transformer.to(device)
    vae.to(device)
    if upscaler is not None:
        upscaler.to(device)
    logger.info(
        "loaded k6sr from %s: %d DiT blocks, model_dim %d, %s, %s on %s",
        root,
        transformer.config.num_visual_blocks,
        transformer.config.model_dim,
        scheduler_name,
        dtype,
        device,
    )
    return K6SRComponents(
        transformer=transformer,
        vae=vae,
        latent_upscaler=upscaler,
        scheduler=scheduler,
        device=device,
        dtype=transformer.dtype,
    )
