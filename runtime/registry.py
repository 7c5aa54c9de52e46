"""Which pipeline serves a ``--model-path``.

Built-in names (``tiny/k6sr``, ``tiny/flux``, ``random/flux``, ``test/allreduce``, ...) map
straight to a pipeline class; the generated ones (``tiny/...``) also to the function that builds
their checkpoint (``BUILTIN_CHECKPOINTS``). A local diffusers directory is routed by its
``model_index.json`` ``_class_name``, or by ``--model-id`` when the directory was renamed.
"""

from __future__ import annotations

import importlib
import json
import logging
from pathlib import Path

from tilecast.runtime.pipeline import Pipeline

logger = logging.getLogger(__name__)

# built-in name -> "module:Class"
BUILTIN_MODELS: dict[str, str] = {
    "test/allreduce": "tilecast.runtime.probe:AllReducePipeline",
    "tiny/k6sr": "tilecast.runtime.models.k6sr.pipeline:K6SRPipeline",
    "tiny/flux": "tilecast.runtime.models.families.flux:FluxT2IPipeline",
    "random/flux": "tilecast.runtime.models.families.released:RandomFluxT2IPipeline",
    "tiny/qwen-image": "tilecast.runtime.models.families.qwen_image:QwenImageT2IPipeline",
    "tiny/z-image-turbo": "tilecast.runtime.models.families.z_image:ZImageT2IPipeline",
    "tiny/wan2.1-t2v": "tilecast.runtime.models.families.wan:WanT2VPipeline",
}

# built-in name -> "module:function" that returns its generated checkpoint directory (built once)
BUILTIN_CHECKPOINTS: dict[str, str] = {
    "tiny/k6sr": "tilecast.runtime.models.k6sr.tiny:ensure_tiny_k6sr",
    "tiny/flux": "tilecast.runtime.models.families.flux:ensure_tiny_flux",
    "tiny/qwen-image": "tilecast.runtime.models.families.qwen_image:ensure_tiny_qwen_image",
    "tiny/z-image-turbo": "tilecast.runtime.models.families.z_image:ensure_tiny_z_image",
    "tiny/wan2.1-t2v": "tilecast.runtime.models.families.wan:ensure_tiny_wan",
}

# diffusers pipeline class name (model_index.json) -> "module:Class"
DIFFUSERS_CLASSES: dict[str, str] = {
    "Kandinsky6SRPipeline": "tilecast.runtime.models.k6sr.pipeline:K6SRPipeline",
    "FluxPipeline": "tilecast.runtime.models.families.flux:FluxT2IPipeline",
    "QwenImagePipeline": "tilecast.runtime.models.families.qwen_image:QwenImageT2IPipeline",
    "ZImagePipeline": "tilecast.runtime.models.families.z_image:ZImageT2IPipeline",
    "WanPipeline": "tilecast.runtime.models.families.wan:WanT2VPipeline",
}

# substrings of a model id (--model-id, or the directory name) -> "module:Class"
MODEL_ID_HINTS: dict[str, str] = {
    "Kandinsky-6.0-VSR": "tilecast.runtime.models.k6sr.pipeline:K6SRPipeline",
}


def _load(target: str) -> type[Pipeline]:
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def resolve_pipeline(model_path: str, model_id: str | None = None) -> type[Pipeline]:
    """Return the pipeline class for ``model_path``; ``ValueError`` naming the problem otherwise."""
    if model_path in BUILTIN_MODELS:
        return _load(BUILTIN_MODELS[model_path])
    if model_id:
        for hint, target in MODEL_ID_HINTS.items():
            if hint.lower() in model_id.lower():
                return _load(target)
        raise ValueError(f"--model-id {model_id!r} names no known model family (known: {', '.join(MODEL_ID_HINTS)})")
    path = Path(model_path)
    if not path.exists():
        builtin = ", ".join(sorted(BUILTIN_MODELS))
        raise ValueError(
            f"--model-path {model_path!r} is neither a built-in model ({builtin}) nor an existing directory"
        )
    index = path / "model_index.json"
    if not index.is_file():
        raise ValueError(f"{path} has no model_index.json: not a diffusers-format model directory")
    try:
        class_name = json.loads(index.read_text())["_class_name"]
    except (json.JSONDecodeError, KeyError) as exc:
        raise ValueError(f"{index} is not a valid model_index.json ({exc})") from exc
    if class_name in DIFFUSERS_CLASSES:
        return _load(DIFFUSERS_CLASSES[class_name])
    for hint, target in MODEL_ID_HINTS.items():
        if hint.lower() in path.name.lower():
            return _load(target)
    raise ValueError(
        f"{path}: pipeline class {class_name!r} is not served by tilecast "
        f"(supported: {', '.join(DIFFUSERS_CLASSES)}); pass --model-id for a renamed checkpoint"
    )


def ensure_builtin_checkpoint(model_path: str) -> Path | None:
    """Generate (or verify) the tiny checkpoint ``model_path`` names; None for any other path.

    The launcher calls this before it starts the ranks, so they find a finished, verified
    checkpoint instead of building it concurrently (``runtime/cache.py``)."""
    target = BUILTIN_CHECKPOINTS.get(model_path)
    return None if target is None else _load(target)()


def register_builtin(name: str, target: str) -> None:
    """Add a built-in model name (used by model families as they land)."""
    BUILTIN_MODELS[name] = target
