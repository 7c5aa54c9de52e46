"""``K6SRPipeline``: Kandinsky 6 video super-resolution as a tilecast ``Pipeline``.

Stages per request: input (PyAV decode, frame/audio rules) → encode → latent upscale → tile plan
→ denoise → decode → blend (``stages.upscale_video``) → optional target downscale → output (MP4
on the output rank, plus raw frames when asked). Requests are not batched together
(``max_batch_size = 1``); every rank runs the same work in the same order.

Settings read from ``RankContext.settings`` at load (``K6SRPipeline.honoured_settings``; any other
pipeline setting away from its default is refused at load):

- ``dtype``: float32 (the CPU default), bfloat16 (the CUDA default) or float16;
- ``allowed_video_dirs``: directories ``video_path`` may point into (none: uploads only);
- ``attention_backend``: passed to ``tilecast.kernels.attention``; ``nabla`` (opt-in) runs
  diffusers' NABLA block-sparse attention with the checkpoint's ``nabla_threshold`` /
  ``nabla_window`` (``kernels/nabla.py``; not with Ring), and each job's ``info`` then carries
  ``nabla_density``, the kept fraction of attention blocks over all its DiT calls and heads;
- ``tp_size``, ``ulysses_degree``, ``ring_degree``: the DiT's sharding (``dit_parallel``; the mesh
  groups come from ``RankContext.groups``);
- ``vae`` (``--vae-config.*``), ``tile_parallel``: how tiles are spread over the ranks
  (``tile_parallel.TileWork``) and whether the VAE decodes with tilecast's channels-last decoder
  (``vae_decode.py``) or diffusers' own;
- ``layerwise_offload_components``, ``cpu_offload_components``, ``dit_offload_prefetch_size``,
  ``dit_layerwise_resident_layers``, ``use_fsdp_inference``: weight placement
  (``runtime/placement.py``), applied last;
- ``compile``: regional ``torch.compile`` of the DiT's blocks.

``RankContext.cache_dir`` says where ``tiny/k6sr`` is generated (default ``$TILECAST_CACHE``).

Shapes: ``video_BCFHW`` float ``[-1, 1]``; ``frames_FHWC`` uint8.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import torch
import torch.nn.functional as F

from tilecast.kernels import fp8_conv
from tilecast.kernels.nabla import NABLA, RING_REFUSAL
from tilecast.runtime.allowed_files import open_allowed
from tilecast.runtime.hub import local_dir
from tilecast.runtime.models.k6sr import quantize, video_io
from tilecast.runtime.models.k6sr.attention import install_dense_attention, nabla_density, reset_nabla_stats
from tilecast.runtime.models.k6sr.dit_parallel import apply_dit_parallel, dit_groups_from_mesh
from tilecast.runtime.models.k6sr.loading import K6SRComponents, load_components, parse_dtype
from tilecast.runtime.models.k6sr.params import (
    SRParams,
    check_request,
    default_output_name,
    parse_target_resolution,
    target_size,
)
from tilecast.runtime.models.k6sr.stages import (
    NO_HOOKS,
    SRSettings,
    frames_to_video,
    make_plan,
    upscale_video,
    video_to_frames,
)
from tilecast.runtime.models.k6sr.tile_parallel import TileWork
from tilecast.runtime.models.k6sr.tiny import ensure_tiny_k6sr
from tilecast.runtime.models.k6sr.vae_decode import ChannelsLastDecoder
from tilecast.runtime.pipeline import Output, OutputFile, Pipeline, RankContext, WorkItem
from tilecast.runtime.placement import AppliedPlacement, apply_placement

logger = logging.getLogger(__name__)

TINY_MODEL = "tiny/k6sr"
"""Built-in name of the generated tiny checkpoint."""
UPLOAD_STEM = "upload"
"""File-name stem of outputs made from uploaded videos."""


def settings_of(params: SRParams) -> SRSettings:
    """The numeric part of a request."""
    return SRSettings(
        scale=params.sr_resolution_scale,
        num_inference_steps=params.num_inference_steps,
        seed=params.seed,
        tiles_batch_size=params.sr_tiles_batch_size,
        min_overlap=params.sr_tile_min_overlap,
    )


def claim_output_path(directory: Path, name: str) -> Path:
    """A path for ``name`` in ``directory`` that no existing file holds, created empty at once
    (``O_EXCL``) so that a concurrent writer cannot take it too: ``name`` itself if free, else
    ``<stem>-2<suffix>``, ``<stem>-3<suffix>``, ... (a warning names the change).

    Serving writes each job into its own folder, where the name is always free. ``tilecast
    generate`` writes into the named output directory itself (``RankContext.flat_output``), where
    two runs in the same second share a default name and a rerun repeats an explicit
    ``output_file_name``: the later file gets the next free suffix instead of overwriting the
    earlier one, and ``generate`` prints the path it really saved."""
    stem, suffix = Path(name).stem, Path(name).suffix
    path, number = directory / name, 1
    while True:
        try:
            path.open("xb").close()
            break
        except FileExistsError:
            number += 1
            path = directory / f"{stem}-{number}{suffix}"
    if number > 1:
        logger.warning("%s already exists in %s; writing %s instead", name, directory, path.name)
    return path


def resize_video(video_BCFHW: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """Antialiased bilinear downscale of every frame to ``width`` x ``height``."""
    if tuple(video_BCFHW.shape[-2:]) == (height, width):
        return video_BCFHW
    batch, _, num_frames = video_BCFHW.shape[:3]
    frames = video_BCFHW.permute(0, 2, 1, 3, 4).flatten(0, 1)
    frames = F.interpolate(frames, size=(height, width), mode="bilinear", align_corners=False, antialias=True)
    return frames.unflatten(0, (batch, num_frames)).permute(0, 2, 1, 3, 4).clamp(-1, 1)


FP8_CONVS_REFUSAL = (
    "--vae-config.fp8-convs runs on tilecast's channels-last K-VAE decode, which is off here: it needs "
    "--vae-config.fast-decode, no spatial-shard decode (--vae-config.use-parallel-decode) and the VAE "
    "neither streamed nor offloaded"
)


class K6SRPipeline(Pipeline):
    """Kandinsky 6 video super-resolution (x2, x4, x2.25) with dense attention."""

    family: ClassVar[str] = "k6sr"
    task: ClassVar[str] = "sr"
    params_type: ClassVar[type[msgspec.Struct]] = SRParams
    upload_fields: ClassVar[tuple[str, ...]] = ("video",)
    max_batch_size: ClassVar[int] = 1
    builtin_name: ClassVar[str] = TINY_MODEL
    diffusers_class: ClassVar[str] = "Kandinsky6SRPipeline"
    model_id_hints: ClassVar[tuple[str, ...]] = ("Kandinsky-6.0-VSR",)
    honoured_settings: ClassVar[frozenset[str]] = frozenset(
        {
            "dtype",
            "allowed_video_dirs",
            "attention_backend",
            "tp_size",
            "ulysses_degree",
            "ring_degree",
            "vae",
            "tile_parallel",
            "compile",
            "layerwise_offload_components",
            "cpu_offload_components",
            "dit_offload_prefetch_size",
            "dit_layerwise_resident_layers",
            "use_fsdp_inference",
            "quantize",
        }
    )
    model_attention_backends: ClassVar[frozenset[str]] = frozenset({NABLA})
    unsupported_reasons: ClassVar[dict[str, str]] = {
        "cuda_graphs": "one DiT call is seconds of GPU work, so there is no launch overhead to remove",
    }

    def __init__(self, parts: K6SRComponents, ctx: RankContext, model_name: str = "") -> None:
        self.parts = parts
        self.ctx = ctx
        self.model_name = model_name
        self.allowed_video_dirs: list[str] = [str(d) for d in ctx.settings.allowed_video_dirs]
        self.tile_work = TileWork.from_context(ctx)
        self.placement: AppliedPlacement | None = None
        """Where the weights live (``runtime/placement.py``); set by ``load``."""

    # ------------------------------------------------------------------ load
    @classmethod
    def ensure_builtin(cls, cache_dir: Path | None = None) -> Path:
        return ensure_tiny_k6sr(cache_dir)

    @classmethod
    def load(cls, model_path: str, ctx: RankContext) -> "K6SRPipeline":
        settings = ctx.settings
        cls.check_settings(settings, model_path)
        if settings.attention_backend == NABLA and settings.ring_degree > 1:
            raise ValueError(RING_REFUSAL)
        dtype = parse_dtype(settings.resolved_dtype)
        if settings.vae.fp8_convs:
            fp8_conv.check_supported(torch.device(ctx.device))
        if settings.quantize == "fp8":
            quantize.check(settings, torch.device(ctx.device), dtype)
        video_io.require_encoders()
        if model_path == TINY_MODEL:
            model_dir = cls.ensure_builtin(ctx.cache_dir)
        else:
            model_dir = local_dir(model_path)
            if not model_dir.is_dir():
                raise ValueError(f"--model-path {model_path!r} is not a local diffusers-format directory")
        parts = load_components(model_dir, device=ctx.device, dtype=dtype)
        install_dense_attention(parts.transformer, backend=settings.attention_backend)
        if ctx.groups is not None:
            groups = dit_groups_from_mesh(ctx.groups.mesh)
            if any(group is not None for group in groups.values()):
                apply_dit_parallel(parts.transformer, **groups, backend=settings.attention_backend)
        pipeline = cls(parts, ctx, model_name=model_path)
        if settings.quantize == "fp8":
            quantize.quantize_blocks(parts.transformer)
        pipeline.placement = apply_placement(parts, ctx)
        if pipeline.fast_decode_applies():
            parts.decoder = ChannelsLastDecoder(parts.vae, fp8_convs=settings.vae.fp8_convs)
        elif settings.vae.fp8_convs:
            raise ValueError(FP8_CONVS_REFUSAL)
        if settings.compile:
            parts.transformer.compile_repeated_blocks()  # last: after parallel hooks and placement
        return pipeline

    def _head_groups(self) -> list[Any]:
        """The DiT's process groups whose ranks hold other heads of the same attention calls."""
        if self.ctx.groups is None:
            return []
        groups = dit_groups_from_mesh(self.ctx.groups.mesh)
        return [groups["tp_group"], groups["ulysses_group"]]

    def fast_decode_applies(self) -> bool:
        """Whether tilecast's channels-last VAE decode can replace diffusers' here: asked for
        (``--vae-config.fast-decode``, default on), no spatial-shard decode (it patches diffusers'
        modules) and the VAE resident (streaming and offload hook diffusers' forwards)."""
        wanted = self.ctx.settings.vae.fast_decode
        placed = self.placement is not None and "vae" in self.placement.config.offloaded
        return bool(wanted) and self.tile_work.decode_mode != "spatial_shard" and not placed

    # --------------------------------------------------------------- prepare
    def prepare(self, params: msgspec.Struct, uploads: dict) -> SRParams:
        """Validate an SR request on rank 0 at submit time (``ValueError`` naming the problem).

        A ``video_path`` is opened here, once, and put into ``uploads["video"]`` as a
        ``PinnedFile``: the job reads that descriptor when it runs, never the path again."""
        assert isinstance(params, SRParams), type(params)
        check_request(params)
        upload = uploads.get("video")
        if upload is not None and params.video_path is not None:
            raise ValueError("give either video_path or an uploaded video, not both")
        if upload is None and params.video_path is None:
            raise ValueError("no input video: give video_path or upload a video")
        if upload is not None and not upload:
            raise ValueError("the uploaded video is empty")
        if upload is None:
            upload = uploads["video"] = open_allowed(params.video_path, self.allowed_video_dirs, field="video_path")
        try:
            self._check_source(upload, params)
        except BaseException:
            if params.video_path is not None:
                uploads.pop("video").close()
            raise
        return params

    def _check_source(self, source: video_io.VideoSource, params: SRParams) -> None:
        """Probe the video and plan its tiles (refuses what cannot be decoded or tiled)."""
        probe = video_io.probe_video(source)
        plan = make_plan(self.parts, probe.height, probe.width, settings_of(params))
        out_h, out_w = plan.output_size
        box = parse_target_resolution(params.sr_target_resolution)
        _, clamped = target_size(out_w, out_h, box, params.sr_target_resize_mode)
        if clamped:
            logger.warning(
                "sr_target_resolution %s is larger than the %dx%d output on some axis; exact mode never "
                "upscales, so that axis keeps its size",
                params.sr_target_resolution,
                out_w,
                out_h,
            )

    # ------------------------------------------------------------------- run
    def health_request(self) -> tuple[dict[str, Any], dict[str, bytes]]:
        """A 9-frame clip that makes one x2 tile of the smallest trained tile size, one step."""
        import tempfile

        from tilecast.runtime.synthetic import write_test_video

        height, width = min(self.parts.tile_sizes)
        with tempfile.TemporaryDirectory(prefix="tilecast-health-") as tmp:
            clip = write_test_video(Path(tmp, "health.mp4"), width // 2, height // 2, 9, 24.0, audio=False)
            video = clip.read_bytes()
        return {"sr_resolution_scale": 2, "num_inference_steps": 1, "seed": 0}, {"video": video}

    def run(self, items: list[WorkItem], ctx: RankContext) -> list[Output]:
        return [self._run_one(item, ctx) for item in items]

    def upscale_frames(
        self,
        frames_FHWC: torch.Tensor,
        params: SRParams,
        *,
        ctx: RankContext | None = None,
        timings: dict[str, float] | None = None,
    ) -> tuple[torch.Tensor, Any]:
        """Frames in, float ``video_BCFHW`` in ``[-1, 1]`` out (before target resize and quantisation).
        With ``ctx``: progress per DiT step, heartbeats and cancel points inside the stages."""
        on_progress = ctx.progress if ctx is not None else None
        video_BCFHW = frames_to_video(frames_FHWC, self.parts.device)
        return upscale_video(
            self.parts,
            video_BCFHW,
            settings_of(params),
            on_progress=on_progress,
            timings=timings,
            tile_work=self.tile_work,
            hooks=ctx if ctx is not None else NO_HOOKS,
        )

    def _run_one(self, item: WorkItem, ctx: RankContext) -> Output:
        params = item.params
        assert isinstance(params, SRParams), type(params)
        timings: dict[str, float] = {}

        started = time.perf_counter()
        nabla = self.ctx.settings.attention_backend == NABLA
        if nabla:
            reset_nabla_stats(self.parts.transformer)
        # Served: the scheduler sends a video_path's bytes, read from the file opened at submit.
        upload = item.uploads.get("video")
        source: video_io.VideoSource = upload if upload is not None else params.video_path
        stem = Path(params.video_path).stem if params.video_path else UPLOAD_STEM
        clip = video_io.read_clip(source)
        timings["input"] = time.perf_counter() - started
        ctx.cancel_point()

        video_BCFHW, plan = self.upscale_frames(clip.frames_FHWC, params, ctx=ctx, timings=timings)
        ctx.cancel_point()  # the last one: a cancelled request writes nothing

        started = time.perf_counter()
        out_h, out_w = video_BCFHW.shape[-2:]
        box = parse_target_resolution(params.sr_target_resolution)
        (width, height), _ = target_size(out_w, out_h, box, params.sr_target_resize_mode)
        video_BCFHW = resize_video(video_BCFHW, width, height)
        frames_FHWC = video_to_frames(video_BCFHW)
        output = Output(
            info={
                "width": width,
                "height": height,
                "num_frames": int(frames_FHWC.shape[0]),
                "fps": float(clip.fps),
                "has_audio": clip.audio_S is not None,
                "num_tiles": plan.num_tiles,
                "scale": params.sr_resolution_scale,
                "source_fps": clip.source_fps,
                "source_num_frames": clip.source_num_frames,
            }
        )
        if nabla:  # every rank runs this: the Ulysses/TP ranks sum their heads' counts
            output.info["nabla_density"] = nabla_density(self.parts.transformer, self._head_groups())
        if params.return_frames:
            output.tensors["frames"] = frames_FHWC
        if ctx.is_output_rank:
            name = params.output_file_name or default_output_name(stem, params)
            path = claim_output_path(ctx.job_dir(item.job_id), name)
            try:
                video_io.write_mp4(path, frames_FHWC, clip.fps, clip.audio_S)
            except BaseException:
                path.unlink(missing_ok=True)  # no empty or half-written file under the claimed name
                raise
            output.files.append(OutputFile(name=path.name, path=path, mime="video/mp4"))
        timings["output"] = time.perf_counter() - started
        output.info["timings"] = {key: round(value, 4) for key, value in timings.items()}
        logger.info(
            "k6sr job %s: %dx%d x%d frames, %d tiles, %s",
            item.job_id,
            width,
            height,
            frames_FHWC.shape[0],
            plan.num_tiles,
            output.info["timings"],
        )
        return output
