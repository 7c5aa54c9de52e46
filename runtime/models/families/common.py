"""What the batchable text-to-image / text-to-video families share.

- ``T2IParams`` / ``T2VParams``: the request fields (msgspec, unknown fields refused).
- ``TinyCheckpoint``: the deterministic built-in checkpoints, built once and verified on every use
  (``<cache>/models/tiny-<family>-v1``; cache ``$TILECAST_CACHE`` or ``~/.cache/tilecast``), and
  the tiny networks several of them share (``tiny_qwen_text_config``, ``TINY_DIT``).
- ``DiffusersBatchPipeline``: a ``Pipeline`` over a diffusers pipeline object. A merged batch is one
  native diffusers call with a list of prompts and one ``torch.Generator`` per request, seeded by
  that request's own seed, so a request's starting noise is the same alone or in a batch. Only the
  batch shape differs, which may change kernels: outputs match the singleton run within a small
  tolerance, not bit-exactly (measured per family in ``tests/test_families.py``).
- PNG / JPEG writing through PIL and MP4 writing through PyAV.

Ranks: every rank loads the whole model and runs the same batch; only the output rank writes
files. With an Ulysses or Ring degree above 1 the transformer's token sequence is split over those
ranks (the family's ``cp_plan``, ``families.sequence_parallel``); text encoders, VAE and scheduler
stay replicated. Otherwise the ranks compute the same batch (replicated).

Shape legend: ``B`` batch, ``F`` frames, ``C`` channels, ``H``/``W`` pixels.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, ClassVar

import msgspec
import torch

from tilecast.runtime.cache import check_weights_file, ensure_model_dir, resolve_ref
from tilecast.runtime.config import ServeConfig, UnsupportedSettingError
from tilecast.runtime.hub import local_dir
from tilecast.runtime.models.families import images, tokenizers
from tilecast.runtime.models.families.sequence_parallel import SEQUENCE_PARALLEL_SETTINGS, install_for_family
from tilecast.runtime.models.k6sr.params import check_output_file_name
from tilecast.runtime.pipeline import Output, OutputFile, Pipeline, RankContext, WorkItem

logger = logging.getLogger(__name__)

MAX_SIDE = 4096
"""Largest width or height a request may ask for."""
MAX_STEPS = 1000
"""Largest ``num_inference_steps``."""
MAX_PROMPT_CHARS = 20_000
"""Longest prompt accepted (the tokenizers truncate long before; this only bounds the wire)."""
IMAGE_FORMATS = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
"""``output_format`` values of the T2I families and their MIME types."""
VIDEO_FORMATS = {"mp4": "video/mp4"}
"""``output_format`` values of the T2V families."""
MAX_SEED = 2**64 - 1
"""Largest ``seed`` (a ``torch.Generator`` takes 64-bit seeds; the wire carries up to uint64)."""
GENERATOR_DEVICES = ("cpu", "cuda")
"""``generator_device`` values: where each request's starting noise is drawn."""
JPEG_WEBP_QUALITY = 95
"""Encoder quality of JPEG and WebP images when the request sets none."""


class SGLangFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Request fields SGLang-Diffusion's clients send, with SGLang's names and meanings."""

    generator_device: str = "cpu"
    """Where the starting noise is drawn: ``cpu`` (default: the same picture on every machine) or
    ``cuda`` (the server's GPU, as SGLang's default; another picture for the same seed)."""
    max_sequence_length: int | None = None
    """Text tokens per prompt (family default when unset; at most the family's limit)."""
    true_cfg_scale: float | None = None
    """Diffusers' true classifier-free guidance scale, for families whose ``guidance_scale`` is that
    (Qwen-Image); refused elsewhere."""
    flow_shift: float | None = None
    """The flow-matching scheduler's shift, for schedulers configured by ``flow_shift`` (Wan)."""
    enable_teacache: bool = False
    """TeaCache step skipping: tilecast has none, so ``true`` is refused."""
    output_quality: int | None = None
    """JPEG/WebP encoder quality 1..100 (SGLang's name)."""
    output_compression: int | None = None
    """JPEG/WebP compression 0..100 (OpenAI's name; quality = 100 - compression)."""
    lora: str | None = None
    """A loaded LoRA adapter's nickname for this request, ``"none"`` for the base model; unset: the
    server's active adapter while it is merged (``scheduler/lora.py``)."""
    lora_scale: float | None = None
    """The adapter's strength for this request (default 1.0)."""
    lora_path: str | None = None
    """Written by the server: the adapter's file."""
    lora_merged: bool = False
    """Written by the server: run with the adapter merged into the weights (the active one)."""


# ------------------------------------------------------------------------------------ params
class T2IParams(SGLangFields, forbid_unknown_fields=True, kw_only=True):
    """A text-to-image request. ``None`` numbers take the family's default in ``prepare``."""

    prompt: str
    """What to draw (per request inside a merged batch)."""
    negative_prompt: str | None = None
    """What to steer away from; only for families and settings that run classifier-free guidance."""
    width: int = 64
    """Output width in pixels (a multiple of the family's ``size_multiple``)."""
    height: int = 64
    """Output height in pixels (a multiple of the family's ``size_multiple``)."""
    num_inference_steps: int | None = None
    """Denoising steps (family default when unset)."""
    guidance_scale: float | None = None
    """Guidance strength (family default when unset; its meaning is the family's: distilled guidance
    on FLUX.1-dev, true classifier-free guidance elsewhere)."""
    seed: int = 42
    """Seeds this request's starting noise, alone or in a batch."""
    output_format: str = "png"
    """``png``, ``jpeg`` or ``webp``."""
    output_file_name: str | None = None
    """Name of the written file (default ``<job id>.<format>``); letters, digits, ``._-`` only."""
    return_tensor: bool = False
    """Also return the raw float output (``[0, 1]``, ``3xHxW``) as tensor ``image``."""


class I2IParams(T2IParams, forbid_unknown_fields=True, kw_only=True):
    """An image-to-image request: ``T2IParams`` plus input images, sent as uploads ``image.0``,
    ``image.1``, ... (``families.images``)."""

    width: int | None = None
    """Output width in pixels; unset: the family's rule from the first input image."""
    height: int | None = None
    """Output height in pixels; unset: the family's rule from the first input image."""
    image_sizes: list[list[int]] = []
    """Written by the server: each input image's ``[width, height]`` (part of the batch key)."""
    image_digests: list[str] = []
    """Written by the server: each input image's SHA-256 (of its canonical PNG); part of the batch
    key only for families whose diffusers call gives one set of input images to the whole batch."""


class T2VParams(SGLangFields, forbid_unknown_fields=True, kw_only=True):
    """A text-to-video request. ``None`` numbers take the family's default in ``prepare``."""

    prompt: str
    """What to film (per request inside a merged batch)."""
    negative_prompt: str | None = None
    """What to steer away from (used when guidance is on)."""
    width: int = 64
    """Output width in pixels (a multiple of the family's ``size_multiple``)."""
    height: int = 64
    """Output height in pixels (a multiple of the family's ``size_multiple``)."""
    num_frames: int = 5
    """Frames to generate (``4k + 1`` for Wan)."""
    num_inference_steps: int | None = None
    """Denoising steps (family default when unset)."""
    guidance_scale: float | None = None
    """Classifier-free guidance strength (family default when unset; <= 1 turns guidance off)."""
    seed: int = 42
    """Seeds this request's starting noise, alone or in a batch."""
    fps: int = 16
    """Frame rate of the written video."""
    output_format: str = "mp4"
    """``mp4`` (H.264 through PyAV)."""
    output_file_name: str | None = None
    """Name of the written file (default ``<job id>.mp4``); letters, digits, ``._-`` only."""
    return_tensor: bool = False
    """Also return the raw float output (``[0, 1]``, ``FxCxHxW``) as tensor ``video``."""


class I2VParams(T2VParams, forbid_unknown_fields=True, kw_only=True):
    """An image-to-video request: ``T2VParams`` plus input images (the first frame, and for some
    models a last frame), sent as uploads ``image.0``, ``image.1`` (``families.images``)."""

    image_sizes: list[list[int]] = []
    """Written by the server: each input image's ``[width, height]`` (part of the batch key)."""
    image_digests: list[str] = []
    """Written by the server: each input image's SHA-256 (see ``I2IParams``)."""


# ------------------------------------------------------------------------------------ checkpoints
# Weight init draws from the global torch RNG: one build per process at a time.
_BUILD_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True, kw_only=True)
class TinyCheckpoint:
    """A built-in checkpoint generated on first use: seeded weights, tiny configs, offline tokenizer."""

    name: str
    """Directory name under ``<cache>/models`` (bump its ``-vN`` suffix whenever configs or seed change)."""
    seed: int
    """Seed of the random weights."""
    build: Callable[[], Any]
    """Returns the diffusers pipeline object, in memory, float32 (called under the seed)."""
    ref: str
    """Where this object lives (``"module:NAME"``): a child interpreter imports it from there to build
    it where this process's ``save_pretrained`` would skip weights (``runtime/cache.py``)."""
    index_classes: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    """``model_index.json`` entries written as the released checkpoint names them where the saved
    object's class differs (transformers' ``CLIPImageProcessorPil`` fallback saves itself under its
    own name; released Wan I2V checkpoints say ``CLIPImageProcessor``)."""

    def write(self, target: Path) -> Path:
        """Build and ``save_pretrained`` into ``target`` (which must not exist yet)."""
        import json

        with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            pipe = self.build()
        pipe.save_pretrained(str(target), safe_serialization=True)
        if self.index_classes:
            index_path = target / "model_index.json"
            index = json.loads(index_path.read_text())
            index.update(self.index_classes)
            index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return target

    def ensure(self, cache_dir: Path | None = None) -> Path:
        """The checkpoint's directory, verified; generated (once, by one process) when missing or broken.

        See ``runtime/cache.py``: one builder under a file lock, a manifest written last, and a
        directory that does not match its manifest is rebuilt, never returned.
        """
        assert resolve_ref(self.ref) is self, f"TinyCheckpoint {self.name}: ref {self.ref!r} names another object"
        return ensure_model_dir(self.name, f"{self.ref}.write", cache_dir)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TinyWeightsFile(TinyCheckpoint):
    """A built-in checkpoint that is one ``.safetensors`` file in a folder, as a released single-file
    transformer (FLUX.2-dev-NVFP4): ``build`` returns its tensors by name (under the seed)."""

    file_name: str
    """The file's name, as released."""

    def write(self, target: Path) -> Path:
        from safetensors.torch import save_file

        with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            tensors = self.build()
        target.mkdir(parents=True)
        save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(target / self.file_name))
        return target

    def ensure(self, cache_dir: Path | None = None) -> Path:
        """The folder holding the file, verified; generated when missing or broken (``TinyCheckpoint.ensure``)."""
        assert resolve_ref(self.ref) is self, f"TinyWeightsFile {self.name}: ref {self.ref!r} names another object"
        return ensure_model_dir(self.name, f"{self.ref}.write", cache_dir, structure=check_weights_file)


def tiny_qwen_text_config(tokenizer, *, hidden_size: int) -> dict:
    """The tiny Qwen language model that both Qwen-conditioned checkpoints build (Z-Image's
    ``Qwen3Config``, Qwen-Image's ``Qwen2_5_VLConfig`` text tower): two layers of ``hidden_size``,
    two query heads sharing one key/value head, ``tokenizer``'s vocabulary and ids."""
    return dict(
        vocab_size=tokenizers.QWEN_VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


VIDEO_VAE_REASONS = {
    "vae.use_parallel_tiling": (
        "whole-tile decode spreads K6 SR's decode tiles over the ranks; this video VAE decodes untiled: "
        "--vae-config.use-parallel-decode splits it by rows instead"
    ),
    "vae.fast_decode": "K6 SR's K-VAE only",
    "vae.fp8_convs": "K6 SR's K-VAE only",
}
"""Why the video families (Wan, Helios, HunyuanVideo, LTX-2) refuse the other ``--vae-config.*``
settings (their ``unsupported_reasons``); each honours ``--vae-config.use-parallel-decode``."""


TINY_DIT = dict(num_layers=1, num_attention_heads=2, attention_head_dim=16)
"""One block of two 16-wide attention heads: the tiny FLUX, Qwen-Image and Wan transformers (their
classes name these arguments alike). Two heads, so that Ulysses 2 can split them."""
TINY_ROPE_AXES = (4, 6, 6)
"""Rotary channels of a tiny 16-wide head per (frame, row, column) axis."""


# ------------------------------------------------------------------------------------ outputs
PNG_COMPRESS_LEVEL = 1
"""zlib level of written PNGs: the fastest. Encoding sits between a batch's last step and the
next batch's first: at PIL's default level 6 one 512x512 image (random-weight output) took 74 ms
here (1024x1024: 149 ms), more than a denoising step; level 1 took 28 ms, same file size."""
_ENCODERS = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="tilecast-encode")
"""Encodes a batch's images in parallel (PIL releases the GIL while compressing)."""


def image_bytes(image_CHW: torch.Tensor, fmt: str, quality: int = JPEG_WEBP_QUALITY) -> bytes:
    """Encode a float image in ``[0, 1]`` as PNG, JPEG or WebP (``quality``: JPEG/WebP only)."""
    from PIL import Image

    array = (image_CHW.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).contiguous().numpy()
    buffer = io.BytesIO()
    if fmt == "png":
        Image.fromarray(array).save(buffer, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    else:
        Image.fromarray(array).save(buffer, format=fmt.upper(), quality=quality)
    return buffer.getvalue()


def encoder_quality(params) -> int:
    """The JPEG/WebP quality a request asks for (``output_quality``, or 100 - ``output_compression``)."""
    if params.output_quality is not None:
        return params.output_quality
    if params.output_compression is not None:
        return max(1, 100 - params.output_compression)
    return JPEG_WEBP_QUALITY


def write_image(image_CHW: torch.Tensor, fmt: str, path: Path, quality: int = JPEG_WEBP_QUALITY) -> None:
    path.write_bytes(image_bytes(image_CHW, fmt, quality))


def write_mp4(
    video_FCHW: torch.Tensor, path: Path, *, fps: int, audio_CS: torch.Tensor | None = None, sample_rate: int = 0
) -> None:
    """Write float frames in ``[0, 1]`` as H.264 MP4 (yuv420p, even sizes) through PyAV; with
    ``audio_CS`` (float samples in ``[-1, 1]``, one row per channel: mono or stereo) also an AAC
    track at ``sample_rate``, every sample of it (its duration is ``samples / sample_rate``)."""
    import av
    import numpy as np

    frames = (video_FCHW.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()
    if frames.shape[1] % 2 or frames.shape[2] % 2:
        raise ValueError(f"yuv420p needs even frame sizes, got {frames.shape[2]}x{frames.shape[1]}")
    with av.open(str(path), mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "18"}
        audio = None
        if audio_CS is not None:
            channels = audio_CS.shape[0]
            if channels not in (1, 2) or sample_rate <= 0:
                raise ValueError(f"audio must be mono or stereo at a positive rate, got {channels} channels")
            layout = "mono" if channels == 1 else "stereo"
            audio = container.add_stream("aac", rate=sample_rate, layout=layout)
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
        if audio is not None:
            samples_CS = np.ascontiguousarray(audio_CS.clamp(-1, 1).float().cpu().numpy())
            step = audio.codec_context.frame_size or 1024
            for start in range(0, samples_CS.shape[1], step):
                chunk = av.AudioFrame.from_ndarray(samples_CS[:, start : start + step], format="fltp", layout=layout)
                chunk.sample_rate, chunk.pts = sample_rate, start
                container.mux(audio.encode(chunk))
            container.mux(audio.encode(None))


def output_path(ctx: RankContext, item: WorkItem, family: str, fmt: str) -> Path:
    """``<job folder>/<output_file_name or family_seedN.fmt>`` (a folder per served job: no collisions)."""
    name = item.params.output_file_name or f"{family}_seed{item.params.seed}.{fmt}"
    return ctx.job_dir(item.job_id) / name


# ------------------------------------------------------------------------------------ pipeline
class DiffusersBatchPipeline(Pipeline):
    """A batchable T2I/T2V pipeline over a diffusers pipeline object (see the module docstring).

    Subclasses set the ``Pipeline`` class attributes plus ``diffusers_class``, ``checkpoint``,
    ``size_multiple`` and the defaults, and, where their diffusers pipeline differs, extend
    ``call_kwargs`` (the diffusers arguments a batch shares) and override ``guidance_on``.
    """

    diffusers_class: ClassVar[str]
    """Name of the diffusers pipeline class (``FluxPipeline``, ...): what ``load`` builds, and what
    routes a checkpoint directory here."""
    checkpoint: ClassVar[TinyCheckpoint | None]
    """The built-in tiny checkpoint ``builtin_name`` names (``tiny/<family>``); None when the built-in
    is made at load (``random/flux``)."""
    builtin_name: ClassVar[str]
    """``tiny/<family>``."""
    size_multiple: ClassVar[int] = 16
    """Width and height must be multiples of this (VAE factor x patch size)."""
    default_steps: ClassVar[int] = 2
    default_guidance: ClassVar[float] = 0.0
    max_sequence_length: ClassVar[int] = 128
    """Text tokens per prompt passed to diffusers when the request sets none (the tiny encoders need few)."""
    max_sequence_length_limit: ClassVar[int] = 512
    """The largest ``max_sequence_length`` a request may ask for (the text encoder's trained length)."""
    true_cfg_is_guidance: ClassVar[bool] = False
    """``guidance_scale`` is diffusers' ``true_cfg_scale`` (Qwen-Image): ``true_cfg_scale`` is its alias."""
    max_batch_size: ClassVar[int] = 16
    variant: ClassVar[bool] = False
    """Set by a declaration that only changes its family's defaults, hints and tiny checkpoint (the
    class it subclasses runs the same transformer and plan): tests of the transformer alone skip it.
    Not inherited: read from the class's own ``__dict__``."""
    flow_shift_field: ClassVar[str] = "flow_shift"
    """The scheduler config field SGLang's ``flow_shift`` sets (Wan's ``flow_shift``; HunyuanVideo's
    flow-matching Euler scheduler calls it ``shift``); a scheduler without it refuses the field."""
    honoured_settings: ClassVar[frozenset[str]] = frozenset({"dtype", "compile", "lora_paths", "lora_dirs"})
    """The ``ServeConfig`` fields these families read (``Pipeline.honoured_settings``); any other
    pipeline setting set away from its default stops ``load`` with an error naming its flag. A
    family that honours more (in ``install_fast_paths`` or elsewhere) adds them here."""
    compile_options: ClassVar[dict[str, Any]] = {}
    """Inductor options of the family's ``--compile`` (``torch.compile(options=...)``); none by default."""
    output_kind: ClassVar[str] = "image"
    """``image`` (T2I) or ``video`` (T2V): the tensor name and the writer."""
    output_audio: ClassVar[bool] = False
    """The diffusers call returns ``(video, audio)`` (LTX-2): the audio goes into the MP4 as an AAC
    track at ``audio_sample_rate``, into ``info["audio"]`` and, with ``return_tensor``, tensor ``audio``."""
    audio_sample_rate: int = 0
    """Samples per second of the audio output (set by an ``output_audio`` family at load)."""
    default_negative_prompt: ClassVar[str] = ""
    """What a request without ``negative_prompt`` steers away from when guidance runs."""
    per_request_fields: ClassVar[tuple[str, ...]] = Pipeline.per_request_fields + (
        "output_quality",
        "output_compression",
    )
    """The encoder's quality only shapes each request's own file, so it never splits a batch."""
    batch_shares_images: ClassVar[bool] = False
    """The diffusers call takes one set of input images for the whole batch (FLUX.2's reference
    images): only requests with the same images merge (their digests join the batch key)."""
    min_images: ClassVar[int] = 0
    """Fewest input images a request must send (an image-to-image family: 1)."""
    max_images: ClassVar[int] = 0
    """Most input images a request may send (0: the family takes none). A family with
    ``max_images > 0`` also sets ``upload_fields = ("image",)`` and an ``I2IParams`` params type."""
    size_from_image: ClassVar[bool] = False
    """The output size is the family's rule from the input image alone (``output_size``; Qwen-Image-Layered,
    whose diffusers call takes no size): ``width`` / ``height`` are refused, naming the field."""
    size_rule: ClassVar[str] = ""
    """With ``size_from_image``: the rule in words, for the refusal."""
    image_mode: ClassVar[str] = "RGB"
    """The PIL mode input images are canonicalised to (``families.images``): ``RGB``, or ``RGBA`` for a
    model that reads transparency (Qwen-Image-Layered)."""
    required_modules: ClassVar[tuple[str, ...]] = ()
    """Python modules the family needs beyond tilecast's own dependencies (the Qwen image-edit
    families: ``torchvision``, without which transformers loads no ``Qwen2VLProcessor``); ``load``
    and ``ensure_builtin`` refuse to start without them, naming them."""
    cp_plan: ClassVar[Any] = None
    """The transformer's context-parallel plan (diffusers' ``_cp_plan`` form), or ``"module:attr"``
    naming it or a function returning it; applied by ``load`` when the ranks run Ulysses or Ring
    (``families.sequence_parallel``). ``None``: the family runs replicated only. A family with a
    plan honours the Ulysses and Ring degrees (added to its ``honoured_settings``)."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.cp_plan is not None:
            cls.honoured_settings = cls.honoured_settings | SEQUENCE_PARALLEL_SETTINGS

    def __init__(self, pipe, ctx: RankContext) -> None:
        self.pipe = pipe
        self.device = ctx.device
        self.dtype = pipe.transformer.dtype
        self.lora_loaded: dict[str, str] = {}
        """LoRA adapters loaded into ``pipe``: nickname -> file."""
        self.lora_fused: tuple[str, float] | None = None
        """The adapter (and strength) merged into the weights now, if any."""

    # ---------------------------------------------------------------- loading
    @classmethod
    def missing_modules(cls) -> dict[str, str]:
        """The ``required_modules`` this interpreter cannot import -> why (an import that fails with
        something other than ``ImportError``, as a torchvision built for another torch, counts too)."""
        missing = {}
        for name in cls.required_modules:
            try:
                importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001 - any failure to import means the module is unusable
                missing[name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
        return missing

    @classmethod
    def check_required_modules(cls) -> None:
        """``UnsupportedSettingError`` naming each of ``required_modules`` that cannot be imported."""
        if missing := cls.missing_modules():
            raise UnsupportedSettingError(
                f"{cls.family} needs {', '.join(missing)} ("
                + "; ".join(f"{name}: {why}" for name, why in missing.items())
                + "): install the build matching your torch"
            )

    @classmethod
    def ensure_builtin(cls, cache_dir: Path | None = None) -> Path | None:
        if cls.checkpoint is None:
            return None
        cls.check_required_modules()
        return cls.checkpoint.ensure(cache_dir)

    @classmethod
    def resolve_path(cls, model_path: str) -> Path:
        if model_path == cls.builtin_name:
            return cls.ensure_builtin()
        return local_dir(model_path)

    @classmethod
    def build_diffusers(
        cls,
        model_path: str,
        device: torch.device,
        dtype: torch.dtype,
        host_components: tuple[str, ...] = (),
        components: dict[str, Any] | None = None,
    ) -> Any:
        """The diffusers pipeline object on ``device`` in ``dtype``: what ``load`` wraps, and what
        ``tilecast.launcher.bench.peer`` calls directly (so both sides of a benchmark run the same networks).
        ``host_components`` stay in host memory (the family offloads them: ``load_options``);
        ``components`` are networks already built that replace the checkpoint's own (FLUX.2-dev's
        NVFP4 transformer)."""
        import diffusers

        path = cls.resolve_path(model_path)
        own = cls.own_components(path)  # loaded here, not by diffusers: it is told to skip them
        pipe = getattr(diffusers, cls.diffusers_class).from_pretrained(
            str(path), dtype=dtype, local_files_only=True, **dict.fromkeys(own), **(components or {})
        )
        if own:
            pipe.register_modules(**own)
        if host_components:  # never on the device at once: what does not fit there together stays out
            for name, component in pipe.components.items():
                if isinstance(component, torch.nn.Module) and name not in host_components:
                    component.to(device)
        else:
            pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        logger.info("loaded %s from %s (%s, %s)", cls.diffusers_class, path, dtype, device)
        return pipe

    @classmethod
    def load_options(cls, ctx: RankContext) -> dict[str, Any]:
        """Extra ``build_diffusers`` arguments from the run's settings. Default: none; the Wan
        families keep their CPU-offloaded experts in host memory from the start (``host_components``)."""
        return {}

    @classmethod
    def own_components(cls, path: Path) -> dict[str, Any]:
        """Components of the checkpoint at ``path`` that the family loads itself, by component name
        (diffusers' loader skips them; a None one stays unloaded). Default: none. FLUX.2-dev loads its
        tokenizer here; ERNIE-Image leaves out its prompt enhancer."""
        return {}

    @classmethod
    def install_fast_paths(cls, pipe: Any, settings: ServeConfig) -> None:
        """Change the loaded diffusers pipeline in place for speed, keeping its function. Default:
        with ``--compile``, diffusers' regional compilation of the transformer's repeated blocks. A
        family that reads more of ``settings`` here lists them in ``honoured_settings``."""
        if settings.compile:
            pipe.transformer.compile_repeated_blocks(options=cls.compile_options or None)

    @classmethod
    def load(cls, model_path: str, ctx: RankContext) -> "DiffusersBatchPipeline":
        cls.check_settings(ctx.settings, model_path)  # on every rank, before any weight is read
        cls.check_required_modules()
        if ctx.settings.lora_enabled and importlib.util.find_spec("peft") is None:
            raise UnsupportedSettingError(
                "--lora-path / --lora-dir need peft (diffusers loads adapters through it): pip install 'tilecast[lora]'"
            )
        pipe = cls.build_diffusers(
            model_path, ctx.device, getattr(torch, ctx.settings.resolved_dtype), **cls.load_options(ctx)
        )
        if ctx.settings.lora_enabled and not hasattr(pipe, "load_lora_weights"):
            raise UnsupportedSettingError(
                f"--lora-path / --lora-dir: diffusers' {cls.diffusers_class} loads no LoRA adapters"
            )
        cls.install_fast_paths(pipe, ctx.settings)
        install_for_family(pipe, cls, ctx)  # Ulysses / Ring over the transformer's tokens, when asked for
        return cls(pipe, ctx)

    # ---------------------------------------------------------------- requests
    def guidance_on(self, params) -> bool:
        """Whether classifier-free guidance runs (a negative prompt is only meaningful then)."""
        return params.guidance_scale > 1.0

    def no_guidance_reason(self, params) -> str:
        """Why ``params`` runs no classifier-free guidance (for the negative_prompt error)."""
        return f"guidance_scale {params.guidance_scale} turns classifier-free guidance off"

    def validate(self, params) -> None:
        """Family-specific checks beyond ``prepare``'s (raise ``ValueError`` naming the field)."""

    def batch_key(self, params) -> dict[str, Any]:
        key = super().batch_key(params)
        if not self.batch_shares_images:
            key.pop("image_digests", None)
        return key

    def output_size(self, params, image_sizes: list[list[int]]) -> tuple[int, int]:
        """An image-to-image request's output ``(width, height)`` when it sets none: the first input
        image's size, rounded down to ``size_multiple``. A family whose diffusers pipeline derives
        the size otherwise overrides this with the same rule, so the batch key holds the real size."""
        width, height = image_sizes[0]
        return (
            max(self.size_multiple, width // self.size_multiple * self.size_multiple),
            max(self.size_multiple, height // self.size_multiple * self.size_multiple),
        )

    def prepare(self, params, uploads: dict[str, bytes]):
        if not params.prompt.strip():
            raise ValueError("prompt must not be empty")
        if len(params.prompt) > MAX_PROMPT_CHARS:
            raise ValueError(f"prompt is {len(params.prompt)} characters; at most {MAX_PROMPT_CHARS}")
        if self.size_from_image:
            for field in ("width", "height"):
                if getattr(params, field) is not None:
                    raise ValueError(
                        f"{field} cannot be set for {self.family}: its output size follows the input image"
                        f" ({self.size_rule})"
                    )
        sizes = images.check_images(
            uploads, family=self.family, min_images=self.min_images, max_images=self.max_images, mode=self.image_mode
        )
        if self.max_images:
            width, height = self.output_size(params, sizes) if sizes else (64, 64)
            params = msgspec.structs.replace(
                params,
                image_sizes=sizes,
                image_digests=[images.digest(uploads[name]) for name in images.image_uploads(uploads)],
                width=params.width if params.width is not None else width,
                height=params.height if params.height is not None else height,
            )
        for field in ("width", "height"):
            value = getattr(params, field)
            if value < self.size_multiple or value > MAX_SIDE or value % self.size_multiple:
                raise ValueError(
                    f"{field} must be a multiple of {self.size_multiple} in {self.size_multiple}..{MAX_SIDE}"
                    f" for {self.family}, got {value}"
                )
        steps = params.num_inference_steps if params.num_inference_steps is not None else self.default_steps
        if not self.min_steps <= steps <= MAX_STEPS:
            why = (
                f" for {self.family} (one step is 0/0 in its scheduler's shift_terminal stretch)" if steps == 1 else ""
            )
            raise ValueError(f"num_inference_steps must be in {self.min_steps}..{MAX_STEPS}{why}, got {steps}")
        guidance = params.guidance_scale if params.guidance_scale is not None else self.default_guidance
        if not 0.0 <= guidance <= 100.0:
            raise ValueError(f"guidance_scale must be in 0..100, got {guidance}")
        formats = IMAGE_FORMATS if self.output_kind == "image" else VIDEO_FORMATS
        if params.output_format not in formats:
            raise ValueError(f"output_format must be one of {', '.join(formats)}, got {params.output_format!r}")
        if not 0 <= params.seed <= MAX_SEED:
            raise ValueError(f"seed must be an integer in 0..2**64-1 (torch's generator range), got {params.seed}")
        check_output_file_name(params.output_file_name)
        guidance = self.check_sglang_fields(params, guidance)
        params = msgspec.structs.replace(
            params, num_inference_steps=steps, guidance_scale=float(guidance), true_cfg_scale=None
        )
        if params.negative_prompt is not None and not self.guidance_on(params):
            raise ValueError(f"negative_prompt cannot be used by {self.family}: {self.no_guidance_reason(params)}")
        self.validate(params)
        return params

    def check_sglang_fields(self, params, guidance: float) -> float:
        """Check ``SGLangFields``; returns the guidance scale (``true_cfg_scale`` where it is the
        family's guidance). A field this family cannot honour raises ``ValueError`` naming it."""
        if params.generator_device not in GENERATOR_DEVICES:
            raise ValueError(
                f"generator_device must be one of {', '.join(GENERATOR_DEVICES)}, got {params.generator_device!r}"
            )
        if params.generator_device == "cuda" and self.device.type != "cuda":
            raise ValueError(f"generator_device 'cuda' needs a CUDA server; this one runs on {self.device.type}")
        length = params.max_sequence_length
        if length is not None and not 1 <= length <= self.max_sequence_length_limit:
            raise ValueError(
                f"max_sequence_length must be in 1..{self.max_sequence_length_limit} for {self.family}, got {length}"
            )
        if params.enable_teacache:
            raise ValueError("enable_teacache: tilecast has no TeaCache (no step caching); send false or leave it out")
        if params.flow_shift is not None and self.flow_shift_field not in getattr(self.pipe.scheduler, "config", {}):
            raise ValueError(
                f"flow_shift cannot be used by {self.family}: its scheduler "
                f"({type(self.pipe.scheduler).__name__}) is not configured by a flow shift"
            )
        if params.flow_shift is not None and not 0.0 < params.flow_shift <= 100.0:
            raise ValueError(f"flow_shift must be in (0, 100], got {params.flow_shift}")
        for name, low in (("output_quality", 1), ("output_compression", 0)):
            value = getattr(params, name)
            if value is None:
                continue
            if not low <= value <= 100:
                raise ValueError(f"{name} must be in {low}..100, got {value}")
            if self.output_kind != "image" or params.output_format == "png":
                raise ValueError(f"{name} applies to jpeg and webp images, not {params.output_format}")
        if params.output_quality is not None and params.output_compression is not None:
            raise ValueError("give either output_quality or output_compression, not both")
        if params.true_cfg_scale is None:
            return guidance
        if not self.true_cfg_is_guidance:
            raise ValueError(
                f"true_cfg_scale cannot be used by {self.family}: its guidance is guidance_scale"
                f" ({self.no_guidance_reason(params) if not self.guidance_on(params) else 'set that instead'})"
            )
        if params.guidance_scale is not None and params.guidance_scale != params.true_cfg_scale:
            raise ValueError("true_cfg_scale and guidance_scale are the same setting here; give one of them")
        if not 0.0 <= params.true_cfg_scale <= 100.0:
            raise ValueError(f"true_cfg_scale must be in 0..100, got {params.true_cfg_scale}")
        return params.true_cfg_scale

    # batch_key: the base class's default (every field except prompt, negative_prompt, seed,
    # output_file_name). Guidance on/off is a function of guidance_scale, which is in the key, so
    # whether a negative prompt is present never changes a batch's computation.

    # ---------------------------------------------------------------- execution
    def call_kwargs(self, params) -> dict[str, Any]:
        """Diffusers ``__call__`` arguments shared by the batch (everything but prompts and generators):
        size, steps, ``guidance_scale``, text length, float output. A family whose pipeline takes
        more, or names them otherwise, extends this."""
        return dict(
            width=params.width,
            height=params.height,
            num_inference_steps=params.num_inference_steps,
            guidance_scale=params.guidance_scale,
            max_sequence_length=params.max_sequence_length or self.max_sequence_length,
            output_type="pt",
        )

    def negative_prompts(self, items: list[WorkItem]) -> dict[str, Any]:
        """The ``negative_prompt`` argument: one per request when guidance runs, else none."""
        first = items[0].params
        if not self.guidance_on(first):
            return {}
        return {"negative_prompt": [item.params.negative_prompt or self.default_negative_prompt for item in items]}

    def image_kwargs(self, items: list[WorkItem]) -> dict[str, Any]:
        """The diffusers arguments carrying a batch's input images (image-to-image families). Default:
        ``image``, one ``PIL.Image`` (``image_mode``) per request (its first input image)."""
        return {"image": [images.load_images(item.uploads, self.image_mode)[0] for item in items]}

    def pipe_for(self, items: list[WorkItem]) -> Any:
        """The diffusers pipeline object that runs this batch: ``self.pipe``. A family whose requests
        take one of two diffusers calls over the same components (LTX-2 and Wan2.2 TI2V: a batch with
        an input image runs their image-to-video pipeline) picks here."""
        return self.pipe

    def call_args(self, items: list[WorkItem]) -> dict[str, Any]:
        """The diffusers ``__call__`` arguments of a batch (all but the progress callback and
        ``return_dict``): one prompt and one CPU ``torch.Generator`` seeded by its request's seed per
        item, negative prompts when guidance runs, then ``call_kwargs``."""
        return dict(
            prompt=[item.params.prompt for item in items],
            **self.negative_prompts(items),
            **(self.image_kwargs(items) if self.max_images else {}),
            generator=[
                torch.Generator(device=self.device if item.params.generator_device == "cuda" else "cpu").manual_seed(
                    item.params.seed
                )
                for item in items
            ],
            **self.call_kwargs(items[0].params),
        )

    def generate(self, items: list[WorkItem], ctx: RankContext) -> torch.Tensor:
        """One native diffusers call for the batch; returns float ``[0, 1]`` outputs, one row per item."""
        return self.generate_outputs(items, ctx)[0]

    def generate_outputs(self, items: list[WorkItem], ctx: RankContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``generate``'s outputs and, for a family with ``output_audio``, the batch's audio
        (float ``[-1, 1]``, ``B x channels x samples``, diffusers' second output)."""
        first = items[0].params
        key = self.batch_key(first)
        for item in items[1:]:
            assert self.batch_key(item.params) == key, "scheduler merged incompatible requests"
        steps = self.denoising_steps(first)
        done = 0

        def on_step(_pipe, _step, _timestep, callback_kwargs):
            nonlocal done
            done = min(done + 1, steps)
            ctx.progress(done, steps)
            ctx.cancel_point()  # every rank runs the same steps (replicated or split): a boundary they share
            return callback_kwargs

        # The VAE decode after the last step is one long stage: its module calls beat the watchdog.
        self.use_lora(first)
        with torch.inference_mode(), ctx.alive_during(getattr(self.pipe, "vae", None)), self.flow_shift(first):
            result = self.pipe_for(items)(**self.call_args(items), callback_on_step_end=on_step, return_dict=False)
        audio = result[1].float().cpu() if self.output_audio else None
        return self.output_rows(result[0], len(items)).float().cpu(), audio

    def output_rows(self, output: Any, batch_size: int) -> torch.Tensor:
        """diffusers' first output (``output_type="pt"``) as one tensor, a row per request: as it comes.
        A family whose pipeline returns another form (Qwen-Image-Layered: a list of layer stacks)
        turns it into rows here."""
        return output

    def denoising_steps(self, params) -> int:
        """Denoising steps one call runs for ``params`` (what progress counts): ``num_inference_steps``;
        a family whose pipeline runs several rounds of steps (Helios' chunks and stages) says so."""
        return params.num_inference_steps

    def example_uploads(self) -> dict[str, bytes]:
        """The uploads of a smallest valid request (the health check, the registry-driven tests):
        none, or ``min_images`` example images (``images.example_image``)."""
        if not self.min_images:
            return {}
        return {name: images.example_image() for name in images.upload_names(self.min_images)}

    @property
    def min_steps(self) -> int:
        """Fewest ``num_inference_steps``: 2 where the scheduler stretches its schedule to a
        ``shift_terminal`` (Qwen-Image, LTX-2): diffusers' one-step schedule is then 0/0, NaN sigmas
        and a NaN image."""
        return 2 if self.pipe.scheduler.config.get("shift_terminal") else 1

    def health_request(self) -> tuple[dict[str, Any], dict[str, bytes]]:
        """The fewest denoising steps at the request defaults' size (with ``example_uploads``)."""
        fields = {"prompt": "health check", "num_inference_steps": self.min_steps, "seed": 0}
        return fields, self.example_uploads()

    def use_lora(self, params) -> None:
        """Bring the weights to the request's LoRA state (``lora``/``lora_path``/``lora_scale``/
        ``lora_merged``, written by the scheduler): load the adapter once, activate it at its scale,
        merge or unmerge it, or run the base model. Every rank does this before the same batch."""
        want = (
            None if params.lora is None else (params.lora, params.lora_scale if params.lora_scale is not None else 1.0)
        )
        if self.lora_fused is not None and (want is None or not params.lora_merged or self.lora_fused != want):
            self.pipe.unfuse_lora()
            self.lora_fused = None
        if want is None:
            if self.lora_loaded:
                self.pipe.disable_lora()
            return
        name, scale = want
        if self.lora_loaded.get(name) != params.lora_path:
            if name in self.lora_loaded:
                self.pipe.delete_adapters(name)
            self.pipe.load_lora_weights(params.lora_path, adapter_name=name)
            self.lora_loaded[name] = params.lora_path
            logger.info("loaded LoRA adapter %s from %s", name, params.lora_path)
        self.pipe.enable_lora()
        self.pipe.set_adapters([name], [scale])
        if params.lora_merged and self.lora_fused is None:
            self.pipe.fuse_lora(adapter_names=[name], lora_scale=1.0)
            self.lora_fused = want

    @contextlib.contextmanager
    def flow_shift(self, params):
        """While inside, the scheduler runs with the request's ``flow_shift`` (the batch shares it)."""
        if params.flow_shift is None:
            yield
            return
        scheduler = self.pipe.scheduler
        self.pipe.scheduler = type(scheduler).from_config(
            scheduler.config, **{self.flow_shift_field: params.flow_shift}
        )
        try:
            yield
        finally:
            self.pipe.scheduler = scheduler

    def image_files(self, path: Path, sample: torch.Tensor) -> list[tuple[Path, torch.Tensor]]:
        """The image files of one request's output ``sample`` and the image each holds: ``sample``
        (``CxHxW``) at ``path``. A family whose request returns several images (Qwen-Image-Layered's
        layers) names one file per image here, in order."""
        return [(path, sample)]

    def output_info(self, sample: torch.Tensor) -> dict[str, Any]:
        """Facts about one request's output ``sample`` for its job info beyond the family, batch size and
        shape (Qwen-Image-Layered: its layer count). Default: none."""
        return {}

    def run(self, items: list[WorkItem], ctx: RankContext) -> list[Output]:
        """Every rank computes the whole batch (replicated, or with the transformer's tokens split
        over the Ulysses/Ring ranks); only the output rank writes files. Tensors are returned on
        every rank. A batch whose jobs were all cancelled stops at the next step, or before writing (``cancel_point``)."""
        # ``generate`` is what families override (Helios trims its chunks, GLM-Image beats its AR stage)
        outputs_BX, audio_BCS = (
            self.generate_outputs(items, ctx) if self.output_audio else (self.generate(items, ctx), None)
        )
        ctx.cancel_point()
        if outputs_BX.shape[0] != len(items):
            raise RuntimeError(
                f"{self.diffusers_class} returned {outputs_BX.shape[0]} outputs for {len(items)} requests"
            )
        results, writes = [], []
        for index, (item, sample) in enumerate(zip(items, outputs_BX)):
            params = item.params
            out = Output(info={"family": self.family, "batch_size": len(items), "shape": list(sample.shape)})
            audio_CS = None if audio_BCS is None else audio_BCS[index]
            if self.output_kind == "video":
                out.info.update(num_frames=sample.shape[0], fps=params.fps)
            if audio_CS is not None:
                out.info["audio"] = {
                    "sample_rate": self.audio_sample_rate,
                    "channels": audio_CS.shape[0],
                    "samples": audio_CS.shape[1],
                    "duration_s": audio_CS.shape[1] / self.audio_sample_rate,
                }
            if params.return_tensor:
                out.tensors[self.output_kind] = sample.contiguous()
                if audio_CS is not None:
                    out.tensors["audio"] = audio_CS.contiguous()
            out.info.update(self.output_info(sample))
            if ctx.is_output_rank:
                path = output_path(ctx, item, self.family, params.output_format)
                if self.output_kind == "image":
                    quality, mime = encoder_quality(params), IMAGE_FORMATS[params.output_format]
                    for image_path, image in self.image_files(path, sample):
                        writes.append(_ENCODERS.submit(write_image, image, params.output_format, image_path, quality))
                        out.files.append(OutputFile(name=image_path.name, path=image_path, mime=mime))
                else:
                    write_mp4(sample, path, fps=params.fps, audio_CS=audio_CS, sample_rate=self.audio_sample_rate)
                    out.files.append(OutputFile(name=path.name, path=path, mime=VIDEO_FORMATS[params.output_format]))
            results.append(out)
        for write in writes:
            write.result()  # every file is on disk before its job completes; errors fail the batch
        return results


class StepDistilled:
    """For a declaration that serves a step-distilled checkpoint and its undistilled base, told apart
    by ``is_distilled`` in the checkpoint's ``model_index.json`` (FLUX.2 [klein], Helios' pyramid).
    The distilled one runs without guidance: ``guidance_scale`` above 1 and ``negative_prompt`` are
    refused (diffusers would ignore them); the base runs classifier-free guidance. Listed before
    ``DiffusersBatchPipeline`` in the class's bases."""

    distilled_name: ClassVar[str]
    """The distilled release's name, for the refusals."""

    def __init__(self, pipe, ctx) -> None:
        super().__init__(pipe, ctx)
        self.distilled = bool(pipe.config.get("is_distilled", False))
        """Step-distilled (no guidance); else the undistilled base (classifier-free guidance)."""

    def guidance_on(self, params) -> bool:
        return not self.distilled and params.guidance_scale > 1.0

    def no_guidance_reason(self, params) -> str:
        if self.distilled:
            return f"{self.distilled_name} is step-distilled and runs no classifier-free guidance"
        return super().no_guidance_reason(params)

    def validate(self, params) -> None:
        super().validate(params)
        if self.distilled and params.guidance_scale > 1.0:
            raise ValueError(
                f"guidance_scale must be at most 1.0 for {self.family}: {self.distilled_name} is step-distilled "
                f"and runs without guidance (diffusers would ignore it), got {params.guidance_scale}"
            )
