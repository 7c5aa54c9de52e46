"""Which pipeline serves a ``--model-path``.

``PIPELINES`` lists every served pipeline class; everything else here is read from their
declarations (``Pipeline.builtin_name``, ``diffusers_class``, ``model_id_hints``,
``ensure_builtin``). A built-in name (``tiny/k6sr``, ``tiny/flux``, ``random/flux``,
``test/allreduce``, ...) maps straight to its pipeline; a local diffusers directory is routed by its
``model_index.json`` ``_class_name``, or by ``--model-id`` when the directory was renamed (or by
its name, when its class is none of diffusers' pipelines). Adding a model is its declaration plus
one line here (README, "Adding a model").

Variants: where several pipelines declare one diffusers class (Z-Image and Z-Image-Turbo are both
``ZImagePipeline``), the class cannot tell them apart, so the name does (``by_hint``): the
pipeline whose ``model_id_hints`` entry is the longest one found in the model's names wins
(``z-image-turbo`` beats ``z-image``), and with no hint found, the first one ``PIPELINES`` lists
for that class (the family's own declaration; variants are listed after it).
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
from pathlib import Path

from tilecast.runtime.hub import local_dir, no_model_index
from tilecast.runtime.pipeline import Pipeline

logger = logging.getLogger(__name__)

PIPELINES: tuple[str, ...] = (
    "tilecast.runtime.probe:AllReducePipeline",
    "tilecast.runtime.models.k6sr.pipeline:K6SRPipeline",
    "tilecast.runtime.models.families.flux:FluxT2IPipeline",
    "tilecast.runtime.models.families.released:RandomFluxT2IPipeline",
    "tilecast.runtime.models.families.qwen_image:QwenImageT2IPipeline",
    "tilecast.runtime.models.families.qwen_image:QwenImage2512T2IPipeline",
    "tilecast.runtime.models.families.qwen_image_edit:QwenImageEditI2IPipeline",
    "tilecast.runtime.models.families.qwen_image_edit:QwenImageEditPlusI2IPipeline",
    "tilecast.runtime.models.families.qwen_image_layered:QwenImageLayeredI2IPipeline",
    "tilecast.runtime.models.families.z_image:ZImageT2IPipeline",
    "tilecast.runtime.models.families.z_image:ZImageBaseT2IPipeline",
    "tilecast.runtime.models.families.sd3:SD3T2IPipeline",
    "tilecast.runtime.models.families.glm_image:GlmImageT2IPipeline",
    "tilecast.runtime.models.families.sana:SanaT2IPipeline",
    "tilecast.runtime.models.families.flux2:Flux2T2IPipeline",
    "tilecast.runtime.models.families.flux2_nvfp4:Flux2NVFP4T2IPipeline",
    "tilecast.runtime.models.families.flux2_klein:Flux2KleinT2IPipeline",
    "tilecast.runtime.models.families.ernie_image:ErnieImageT2IPipeline",
    "tilecast.runtime.models.families.ernie_image:ErnieImageTurboT2IPipeline",
    "tilecast.runtime.models.families.wan:WanT2VPipeline",
    "tilecast.runtime.models.families.hunyuan_video:HunyuanVideoT2VPipeline",
    "tilecast.runtime.models.families.helios:HeliosT2VPipeline",
    "tilecast.runtime.models.families.helios:HeliosPyramidT2VPipeline",
    "tilecast.runtime.models.families.ltx2:LTX2T2VPipeline",
    "tilecast.runtime.models.families.wan22:Wan22T2VPipeline",
    "tilecast.runtime.models.families.wan22:Wan22TI2VPipeline",
    "tilecast.runtime.models.families.wan_i2v:WanI2VPipeline",
    "tilecast.runtime.models.families.wan22:Wan22I2VPipeline",
)
"""``"module:Class"`` of every served pipeline. Where several declare the same diffusers class (FLUX's
tiny and released-size built-ins, a family and its variants), the first listed serves that class's
directories unless a variant's hint names the model (module docstring). The probe comes first: a
built-in name is looked up in this order, importing no module past its own (``builtin_pipeline``),
so a probe server's ranks import no model code."""


def _load(target: str) -> type[Pipeline]:
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


@functools.cache
def pipelines() -> tuple[type[Pipeline], ...]:
    """The classes ``PIPELINES`` names (imported on first use)."""
    return tuple(_load(target) for target in PIPELINES)


def builtin_pipeline(name: str) -> type[Pipeline] | None:
    """The pipeline of the built-in ``--model-path`` ``name`` (None: not one), importing the modules
    ``PIPELINES`` lists only up to its own."""
    for target in PIPELINES:
        if (cls := _load(target)).builtin_name == name:
            return cls
    return None


def builtin_models() -> dict[str, type[Pipeline]]:
    """Built-in ``--model-path`` name → pipeline."""
    return {cls.builtin_name: cls for cls in pipelines() if cls.builtin_name}


def diffusers_classes() -> dict[str, tuple[type[Pipeline], ...]]:
    """``model_index.json`` ``_class_name`` → the pipelines declaring it, in ``PIPELINES`` order."""
    served: dict[str, tuple[type[Pipeline], ...]] = {}
    for cls in pipelines():
        if cls.diffusers_class:
            served[cls.diffusers_class] = (*served.get(cls.diffusers_class, ()), cls)
    return served


def by_hint(names: tuple[str, ...], candidates: tuple[type[Pipeline], ...] | None = None) -> type[Pipeline] | None:
    """The candidate (default: every pipeline) with the longest ``model_id_hints`` entry found in one
    of ``names`` (case-insensitive): the most specific name wins. Ties: the first listed. None: no hint found."""
    best, best_len = None, 0
    for cls in candidates or pipelines():
        for hint in cls.model_id_hints:
            if len(hint) > best_len and any(hint.lower() in name.lower() for name in names):
                best, best_len = cls, len(hint)
    return best


def _another_pipeline(class_name: str) -> bool:
    """``class_name`` is a diffusers pipeline class (not the generic ``DiffusionPipeline``): a checkpoint
    of it is that pipeline's, whatever its name says (``Qwen-Image-Edit`` is not Qwen-Image)."""
    import diffusers

    return class_name != "DiffusionPipeline" and class_name in dir(diffusers)


def resolve_pipeline(model_path: str, model_id: str | None = None) -> type[Pipeline]:
    """Return the pipeline class for ``model_path``; ``ValueError`` naming the problem otherwise."""
    if (builtin := builtin_pipeline(model_path)) is not None:
        return builtin
    if model_id:
        if (cls := by_hint((model_id,))) is not None:
            return cls
        hints = ", ".join(hint for cls in pipelines() for hint in cls.model_id_hints)
        raise ValueError(f"--model-id {model_id!r} names no known model family (known: {hints})")
    path = local_dir(model_path)  # a Hub id: its snapshot in the Hugging Face cache
    if not path.exists():
        raise ValueError(
            f"--model-path {model_path!r} is neither a built-in model ({', '.join(sorted(builtin_models()))}), "
            "an existing directory nor a Hugging Face Hub id (owner/name)"
        )
    index = path / "model_index.json"
    if not index.is_file():
        raise ValueError(no_model_index(path))
    try:
        class_name = json.loads(index.read_text())["_class_name"]
    except (json.JSONDecodeError, KeyError) as exc:
        raise ValueError(f"{index} is not a valid model_index.json ({exc})") from exc
    names = (path.resolve().name, str(model_path))  # a Hub id's snapshot directory is named by its commit
    served = diffusers_classes()
    if class_name in served:
        return by_hint(names, served[class_name]) or served[class_name][0]
    if (cls := by_hint(names)) is not None and not _another_pipeline(class_name):
        return cls
    raise ValueError(
        f"{path}: pipeline class {class_name!r} is not served by tilecast "
        f"(supported: {', '.join(served)}); pass --model-id for a renamed checkpoint"
    )


def ensure_builtin_checkpoint(model_path: str) -> Path | None:
    """Generate (or verify) the checkpoint the built-in ``model_path`` names; None for any other path
    and for built-ins with nothing on disk.

    Every rank calls this before it joins the process group (``rank.start_rank``): one builds under
    the cache's lock, in-process, and the others find it finished (``runtime/cache.py``)."""
    cls = builtin_pipeline(model_path)
    return None if cls is None else cls.ensure_builtin()
