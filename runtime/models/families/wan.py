"""The Wan families' shared machinery, and Wan2.1 T2V (``WanPipeline``) with its built-in tiny checkpoint ``tiny/wan2.1-t2v``.

The tiny checkpoint keeps the real structure: the causal 3D ``AutoencoderKLWan`` (8x spatial, 4x
temporal, 16 latent channels), a ``WanTransformer3DModel`` with 1x2x2 patches, cross-attention on a
``UMT5EncoderModel`` (the config of ``tiny/flux``'s T5 encoder) with a ``T5TokenizerFast`` built
offline, and the flow-matching UniPC scheduler with ``flow_shift=3`` that the released 1.3B
checkpoint ships.

``WanFamily`` is what every Wan family shares (Wan2.1 T2V here; I2V in ``wan_i2v``; Wan2.2 A14B and
TI2V 5B in ``wan22``; the distilled FastWan / TurboWan releases are variants of these):

- request defaults per released checkpoint (``WanDefaults``, from its model card), picked at load by
  the longest id hint in ``--model-id`` or the model path; the tiny checkpoints keep tiny defaults;
- ``num_frames`` must be ``4k + 1`` (the VAE's temporal factor; diffusers would silently round
  otherwise); ``guidance_scale`` above 1 runs classifier-free guidance with each request's
  ``negative_prompt`` (default ``""``, as diffusers does); ``flow_shift`` unset takes the card's
  (480P / 720P) where the card gives one, else the checkpoint's scheduler;
- two experts (Wan2.2 A14B: ``transformer`` for high noise, ``transformer_2`` below
  ``boundary_ratio``): both get the sequence-parallel plan (``install_for_family``), a request's
  ``guidance_scale_2`` is the low-noise expert's guidance, and ``--cpu-offload-components
  transformer_2`` (and/or ``transformer``) keeps an expert in host memory while it is idle
  (``ExpertOffload``);
- the distilled releases sample as released (``wan_fewstep``: FastVideo's DMD for FastWan,
  TurboDiffusion's rCM for TurboWan; no CFG); a release trained with a sparse attention tilecast
  lacks (FastWan2.1's VSA, TurboWan's SLA) is refused at load unless
  ``--allow-dense-attention-fallback`` serves it dense, with a warning;
- with ``--vae-config.use-parallel-decode`` and a decode group of several ranks, the VAE decode is
  split by rows across the group (``wan_decode``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import torch

from tilecast.runtime.config import UnsupportedSettingError
from tilecast.runtime.models.families import common, flux, tokenizers
from tilecast.runtime.models.families.common import DiffusersBatchPipeline, T2VParams, TinyCheckpoint
from tilecast.runtime.models.families.wan_fewstep import FewStep, dmd, rcm
from tilecast.runtime.pipeline import WorkItem

logger = logging.getLogger(__name__)

TEXT_DIM = flux.TEXT_DIM
"""``d_model`` of the tiny UMT5 encoder, tiny FLUX's T5 (the transformer's ``text_dim``)."""
MAX_FRAMES = 257
"""Longest video a request may ask for."""


def tiny_vae_config() -> dict:
    """The tiny causal 3D VAE's config (``AutoencoderKLWan``; Qwen-Image's ``AutoencoderKLQwenImage``
    has the same structure)."""
    return dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1, temperal_downsample=[False, True, True])


def build_tiny_wan():
    """The tiny ``WanPipeline`` in memory (call under a seed; ``TinyCheckpoint`` does)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = tokenizers.t5_tokenizer()
    t5 = flux.flux_configs(flux.TINY_OVERRIDES)["text_encoder_2"]  # UMT5 has T5-v1.1's structure
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=tokenizers.T5_VOCAB_SIZE, **t5)).eval()
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        **common.TINY_DIT,
        in_channels=16,
        out_channels=16,
        text_dim=TEXT_DIM,
        freq_dim=32,
        ffn_dim=64,
        rope_max_seq_len=1024,
    ).eval()
    vae = AutoencoderKLWan(**tiny_vae_config()).eval()
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=3.0,
        num_train_timesteps=1000,
    )
    return WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=transformer
    )


TINY_WAN = TinyCheckpoint(name="tiny-wan2.1-t2v-v1", seed=20250704, build=build_tiny_wan, ref=f"{__name__}:TINY_WAN")


AREA_480P = 832 * 480
"""Pixels of a 480P frame: the cards' flow shift for up to this area is their 480P one."""


# ------------------------------------------------------------------------------------ defaults
@dataclasses.dataclass(frozen=True, kw_only=True)
class WanDefaults:
    """One released checkpoint's request defaults, from its model card."""

    width: int
    height: int
    """Frame size; an image-to-video request with an image and no size keeps the image's aspect
    ratio within ``width x height`` pixels (the cards' ``max_area``)."""
    num_frames: int
    fps: int = 16
    steps: int = 50
    guidance: float = 5.0
    guidance_2: float | None = None
    """The low-noise expert's guidance (Wan2.2 A14B; None: diffusers uses ``guidance``)."""
    flow_shift: float | None = None
    """The card's flow shift at 480P (None: the checkpoint's scheduler config)."""
    flow_shift_720p: float | None = None
    """The card's flow shift above 480P (None: ``flow_shift``)."""
    max_images: int | None = None
    """Input images a request may send (image-to-video; None: the family's)."""
    sparse_attention: str | None = None
    """The sparse attention the release was trained with and tilecast does not have (served with
    dense attention only behind ``--allow-dense-attention-fallback``)."""
    few_step: FewStep | None = None
    """A distilled release's sampler (``wan_fewstep``: FastVideo's DMD, TurboDiffusion's rCM; no CFG)."""

    def shift_for(self, width: int, height: int) -> float | None:
        """The card's flow shift for a ``width x height`` video (None: the scheduler's)."""
        if width * height > AREA_480P and self.flow_shift_720p is not None:
            return self.flow_shift_720p
        return self.flow_shift


TINY_DEFAULTS = WanDefaults(width=64, height=64, num_frames=5, steps=2, guidance=5.0)
"""The tiny checkpoints' defaults: tiny sizes, two steps, guidance on."""


class WanParams(T2VParams, forbid_unknown_fields=True, kw_only=True):
    """A Wan request: ``T2VParams`` whose size and frame count default to the checkpoint's card."""

    width: int | None = None
    """Output width in pixels (unset: the card's, or from the input image's aspect ratio)."""
    height: int | None = None
    """Output height in pixels (unset: the card's, or from the input image's aspect ratio)."""
    num_frames: int | None = None
    """Frames to generate, ``4k + 1`` (unset: the card's)."""
    guidance_scale_2: float | None = None
    """Guidance of the low-noise expert (Wan2.2 A14B only; unset: the card's, else ``guidance_scale``)."""


class WanI2VParams(WanParams, forbid_unknown_fields=True, kw_only=True):
    """A Wan image-to-video request: ``WanParams`` plus its input images (the first frame, and where
    the model takes it the last frame), uploads ``image.0``, ``image.1``."""

    image_sizes: list[list[int]] = []
    """Written by the server: each input image's ``[width, height]`` (part of the batch key)."""
    image_digests: list[str] = []
    """Written by the server: each input image's SHA-256; part of the batch key (a diffusers Wan
    image-to-video call takes one first frame for the whole batch)."""


def longest_hint(names: list[str], hints) -> str | None:
    """The longest of ``hints`` found (case-insensitively) in any of ``names``."""
    found = [hint for hint in hints if any(hint.lower() in name.lower() for name in names if name)]
    return max(found, key=len) if found else None


# ------------------------------------------------------------------------------------ expert offload
OFFLOADABLE = ("transformer", "transformer_2")
"""The components a Wan family keeps in host memory under ``--cpu-offload-components``."""


class ExpertOffload:
    """``--cpu-offload-components transformer_2`` (and/or ``transformer``): each named expert lives in
    host memory (``placement.ComponentOffload``) and comes to the device whole when it runs. An
    expert stays on the device while consecutive steps use it; when another expert runs, the
    offloaded ones leave; after a batch, every offloaded expert leaves (the idle expert's weights
    never sit on the device while the other denoises)."""

    def __init__(self, pipe, names: tuple[str, ...], device) -> None:
        from tilecast.runtime.placement import ComponentOffload

        self.offloads = {name: ComponentOffload(name, getattr(pipe, name), device) for name in names}
        self.moves: collections.deque[str] = collections.deque(maxlen=64)
        """The latest expert names in the order they came to the device (logs, tests)."""
        for name in OFFLOADABLE:
            module = getattr(pipe, name, None)
            if module is not None:
                module.register_forward_pre_hook(lambda _module, _args, name=name: self.running(name))

    def running(self, name: str) -> None:
        for other, offload in self.offloads.items():
            if other != name and offload.on_device:
                offload.exit()
        offload = self.offloads.get(name)
        if offload is not None and not offload.on_device:
            offload.enter()
            self.moves.append(name)

    def idle(self) -> None:
        for offload in self.offloads.values():
            if offload.on_device:
                offload.exit()


def _check_experts(pipe, family: str, ctx, names, flag: str, done: str, does: str, held: str) -> None:
    """``UnsupportedSettingError`` for a placement flag naming what a Wan family cannot place (only its
    denoising experts can be: the VAE is called through ``encode``/``decode``, not ``forward``), an
    expert the checkpoint lacks, or LoRA (merging an adapter changes the weights the host copies hold)."""
    wrong = [name for name in names if name not in OFFLOADABLE]
    missing = [name for name in names if name in OFFLOADABLE and getattr(pipe, name, None) is None]
    if wrong or missing:
        reason = f"{', '.join(wrong)} cannot be {done} by {family}" if wrong else f"the checkpoint has no {missing[0]}"
        present = ", ".join(name for name in OFFLOADABLE if getattr(pipe, name, None) is not None)
        raise UnsupportedSettingError(
            f"{flag} {' '.join(names)}: {reason}; {family} {does} denoising experts ({present})"
        )
    if ctx.settings.lora_enabled:
        raise UnsupportedSettingError(
            f"{flag} with --lora-path / --lora-dir: merging an adapter changes the weights that {held}"
        )


def install_expert_offload(pipe, family: str, ctx) -> ExpertOffload | None:
    """Apply ``--cpu-offload-components`` to a Wan pipeline's experts; ``ValueError`` naming what a
    Wan family cannot offload (the VAE: diffusers calls ``vae.encode``/``decode``, not ``forward``)."""
    names = ctx.settings.placement.cpu_offload_components
    if not names:
        return None
    _check_experts(
        pipe,
        family,
        ctx,
        names,
        "--cpu-offload-components",
        "offloaded",
        "offloads its",
        "the offloaded host copy holds",
    )
    offload = ExpertOffload(pipe, names, ctx.device)
    if torch.device(ctx.device).type == "cuda":
        torch.cuda.empty_cache()  # give back what a device copy held (the host copies are the masters)
    if ctx.rank == 0:
        logger.info("%s: %s kept in host memory while idle (--cpu-offload-components)", family, ", ".join(names))
    return offload


def install_layerwise(pipe, family: str, ctx) -> dict:
    """Apply ``--layerwise-offload-components`` to a Wan pipeline's experts: each named expert's
    transformer blocks stream from host memory just before they run (``placement.LayerStreamer``,
    ``--dit-offload-prefetch-size`` blocks ahead, the first ``--dit-layerwise-resident-layers``
    blocks kept on the device); its embeddings and output head stay on the device. Returns the
    streamers by expert; ``UnsupportedSettingError`` naming what a Wan family cannot stream."""
    from tilecast.runtime.placement import LayerStreamer

    placement = ctx.settings.placement
    names = placement.layerwise_offload_components
    if not names:
        return {}
    _check_experts(
        pipe,
        family,
        ctx,
        names,
        "--layerwise-offload-components",
        "streamed",
        "streams the blocks of its",
        "the streamed host copies hold",
    )
    streamers = {}
    for name in names:
        expert = getattr(pipe, name)
        resident = placement.dit_layerwise_resident_layers
        chain = [(f"{name}.blocks.{i}", [expert.blocks[i]]) for i in range(resident, len(expert.blocks))]
        streamers[name] = LayerStreamer(
            name, expert, chain, device=torch.device(ctx.device), prefetch=placement.dit_offload_prefetch_size
        )
    if torch.device(ctx.device).type == "cuda":
        torch.cuda.empty_cache()  # give back the device copies the pinned host copies replaced
    if ctx.rank == 0:
        logger.info(
            "%s: blocks of %s stream from host memory (--layerwise-offload-components)", family, ", ".join(names)
        )
    return streamers


# ------------------------------------------------------------------------------------ families
class WanFamily(DiffusersBatchPipeline):
    """What the Wan families share (see the module docstring); a merged batch is one diffusers call."""

    num_frames_rule = (4, 1)
    params_type = WanParams
    cp_plan = "diffusers:WanTransformer3DModel._cp_plan"
    size_multiple = 16
    default_guidance = 5.0
    max_sequence_length = 64
    output_kind = "video"
    per_request_fields = DiffusersBatchPipeline.per_request_fields + ("fps",)
    """``fps`` only stamps the written file, so requests with different rates still merge."""
    honoured_settings = DiffusersBatchPipeline.honoured_settings | {
        "vae.use_parallel_decode",
        "vae.parallel_decode_mode",
        "cpu_offload_components",
        "layerwise_offload_components",
        "dit_offload_prefetch_size",
        "dit_layerwise_resident_layers",
        "allow_dense_attention_fallback",
    }
    """Also the parallel decode settings, which ``wan_decode.install`` reads (the other
    ``--vae-config.*`` settings are refused), the experts' CPU offload and the dense-attention
    fallback of sparse-attention releases."""
    unsupported_reasons = common.VIDEO_VAE_REASONS
    variants: ClassVar[dict[str, WanDefaults]] = {}
    """Released id hint -> that checkpoint's card defaults (the longest hint found wins)."""
    fallback_variant: ClassVar[str | None] = None
    """The variant of a checkpoint no hint names (a renamed directory)."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.model_id_hints = tuple(cls.variants)

    def __init__(self, pipe, ctx) -> None:
        from tilecast.runtime.models.families import wan_decode  # imports diffusers' Wan VAE module

        super().__init__(pipe, ctx)
        self.defaults = TINY_DEFAULTS
        """The card defaults of the loaded checkpoint (``load`` sets them)."""
        self.variant: str | None = None
        self.parallel_decode = wan_decode.install(pipe.vae, ctx, self.family)
        """Whether the VAE decode is split by rows across the decode group (``wan_decode``)."""
        self.expert_offload: ExpertOffload | None = None
        self.streamers: dict = {}
        """Expert name → its ``LayerStreamer`` under ``--layerwise-offload-components`` (``load`` sets them)."""
        self.two_experts = getattr(pipe, "transformer_2", None) is not None and pipe.config.boundary_ratio is not None

    @classmethod
    def install_fast_paths(cls, pipe, settings) -> None:
        """``--compile``: both experts' repeated blocks (Wan2.2 A14B's ``transformer_2`` too)."""
        super().install_fast_paths(pipe, settings)
        if settings.compile and getattr(pipe, "transformer_2", None) is not None:
            pipe.transformer_2.compile_repeated_blocks(options=cls.compile_options or None)

    @classmethod
    def variant_for(cls, model_path: str, model_id: str | None) -> str | None:
        """The released variant ``model_path`` / ``--model-id`` names; None for the tiny built-in."""
        if model_path == cls.builtin_name:
            return None
        names = [model_id or "", model_path, Path(str(model_path)).name]
        if cls.checkpoint is not None and any(cls.checkpoint.name in name for name in names):
            return None  # the tiny checkpoint's own directory
        return longest_hint(names, cls.variants) or cls.fallback_variant

    @classmethod
    def load(cls, model_path: str, ctx) -> "WanFamily":
        variant = cls.variant_for(model_path, getattr(ctx.settings, "model_id", None))
        defaults = cls.variants[variant] if variant else TINY_DEFAULTS
        cls.check_sparse_attention(variant, defaults, ctx)
        pipeline = super().load(model_path, ctx)
        pipeline.variant, pipeline.defaults = variant, defaults
        if defaults.max_images is not None:
            pipeline.max_images = defaults.max_images
        pipeline.expert_offload = install_expert_offload(pipeline.pipe, pipeline.family, ctx)
        pipeline.streamers = install_layerwise(pipeline.pipe, pipeline.family, ctx)
        if defaults.few_step is not None:
            from tilecast.runtime.models.families.wan_fewstep import FewStepFlowScheduler

            pipeline.pipe.scheduler = FewStepFlowScheduler(defaults.few_step)
        if variant and ctx.rank == 0:
            logger.info("%s: %s card defaults %s", pipeline.family, variant, defaults)
        return pipeline

    @classmethod
    def build_diffusers(cls, model_path: str, device, dtype, host_components: tuple[str, ...] = ()) -> Any:
        path = cls.resolve_path(model_path)
        if path.is_dir() and not (path / "model_index.json").is_file():
            raise ValueError(
                f"{path} has no model_index.json: {cls.family} loads diffusers-format Wan checkpoints"
                " (TurboDiffusion's TurboWan releases are .pth weights for its own runner: convert them"
                " into a diffusers folder first)"
            )
        return super().build_diffusers(model_path, device, dtype, host_components)

    @classmethod
    def load_options(cls, ctx) -> dict[str, Any]:
        """The experts named by ``--cpu-offload-components`` never go to the device at load (both
        A14B experts need not fit there together)."""
        names = tuple(name for name in ctx.settings.placement.cpu_offload_components if name in OFFLOADABLE)
        return {"host_components": names} if names else {}

    @classmethod
    def check_sparse_attention(cls, variant: str | None, defaults: WanDefaults, ctx) -> None:
        """A release trained with sparse attention runs dense only behind the explicit setting."""
        if defaults.sparse_attention is None:
            return
        if not ctx.settings.allow_dense_attention_fallback:
            raise UnsupportedSettingError(
                f"{variant} was trained with {defaults.sparse_attention}, which tilecast does not have; "
                "pass --allow-dense-attention-fallback to serve it with dense attention (its output then "
                "differs from the release's)"
            )
        if ctx.rank == 0:
            logger.warning(
                "%s: serving with DENSE attention instead of its %s (--allow-dense-attention-fallback): "
                "the output differs from the release's",
                variant,
                defaults.sparse_attention,
            )

    # ---------------------------------------------------------------- requests
    def output_size(self, params, image_sizes: list[list[int]]) -> tuple[int, int]:
        """The cards' image-to-video rule: the first image's aspect ratio within the default
        ``width x height`` pixels, each side rounded down to ``size_multiple``."""
        width, height = image_sizes[0]
        area, step = self.defaults.width * self.defaults.height, self.size_multiple
        aspect = height / width
        out_h = round(math.sqrt(area * aspect)) // step * step
        out_w = round(math.sqrt(area / aspect)) // step * step
        return max(step, out_w), max(step, out_h)

    def prepare(self, params, uploads: dict[str, bytes]):
        d = self.defaults
        fill: dict[str, Any] = {}
        if getattr(params, "num_frames", 0) is None:
            fill["num_frames"] = d.num_frames
        has_image = bool(self.max_images) and any(name.startswith("image.") for name in uploads)
        if not has_image:
            fill.update({f: getattr(d, f) for f in ("width", "height") if getattr(params, f) is None})
        if self.two_experts and getattr(params, "guidance_scale_2", None) is None and d.guidance_2 is not None:
            fill["guidance_scale_2"] = d.guidance_2
        params = msgspec.structs.replace(params, **fill) if fill else params
        if params.num_inference_steps is None:
            params = msgspec.structs.replace(params, num_inference_steps=d.steps)
        if params.guidance_scale is None and params.true_cfg_scale is None:
            params = msgspec.structs.replace(params, guidance_scale=d.guidance)
        params = super().prepare(params, uploads)
        if params.flow_shift is None and (shift := d.shift_for(params.width, params.height)) is not None:
            if shift != getattr(self.pipe.scheduler.config, "flow_shift", None):
                params = msgspec.structs.replace(params, flow_shift=shift)
        return params

    def validate(self, params) -> None:
        if not 1 <= params.num_frames <= MAX_FRAMES or (params.num_frames - 1) % 4:
            raise ValueError(f"num_frames must be 4k+1 in 1..{MAX_FRAMES} for {self.family}, got {params.num_frames}")
        if not 1 <= params.fps <= 120:
            raise ValueError(f"fps must be in 1..120, got {params.fps}")
        few_step = self.defaults.few_step
        if few_step is not None and params.num_inference_steps not in few_step.step_counts:
            raise ValueError(
                f"num_inference_steps must be one of {', '.join(map(str, few_step.step_counts))} for {self.variant}"
                f" (it samples with {few_step.describe()}), got {params.num_inference_steps}"
            )
        if few_step is not None and params.guidance_scale > 1.0:
            raise ValueError(
                f"guidance_scale must be at most 1.0 for {self.variant}: step-distilled ({few_step.describe()}),"
                f" it samples without classifier-free guidance, got {params.guidance_scale}"
            )
        scale_2 = getattr(params, "guidance_scale_2", None)
        if scale_2 is not None:
            if not self.two_experts:
                raise ValueError(
                    f"guidance_scale_2 cannot be used by {self.family}: it has one denoising expert"
                    " (the low-noise expert's guidance of Wan2.2 A14B)"
                )
            if not 0.0 <= scale_2 <= 100.0:
                raise ValueError(f"guidance_scale_2 must be in 0..100, got {scale_2}")

    def call_kwargs(self, params) -> dict:
        kwargs = {**super().call_kwargs(params), "num_frames": params.num_frames}
        if getattr(params, "guidance_scale_2", None) is not None:
            kwargs["guidance_scale_2"] = params.guidance_scale_2
        return kwargs

    def call_args(self, items: list[WorkItem]) -> dict[str, Any]:
        args = super().call_args(items)
        scheduler = self.pipe.scheduler
        if self.defaults.few_step is not None:  # the sampler's fresh noise: each request's own generator
            scheduler.generators = args["generator"]
            if scheduler.initial_sigma != 1.0:  # rCM starts from scaled noise, drawn as diffusers would
                args["latents"] = scheduler.initial_sigma * self.starting_noise(items[0].params, args["generator"])
        return args

    def starting_noise(self, params, generators: list[torch.Generator]) -> torch.Tensor:
        """``N(0, 1)`` latents, one row per generator, as diffusers' ``prepare_latents`` draws them."""
        pipe = self.pipe
        shape = (
            pipe.vae.config.z_dim,
            (params.num_frames - 1) // pipe.vae_scale_factor_temporal + 1,
            params.height // pipe.vae_scale_factor_spatial,
            params.width // pipe.vae_scale_factor_spatial,
        )
        rows = [torch.randn((1, *shape), generator=g, device=g.device, dtype=torch.float32) for g in generators]
        return torch.cat(rows).to(self.device)

    def health_request(self) -> tuple[dict[str, Any], dict[str, bytes]]:
        """One step at the card's size, one frame (the VAE's first frame), with the example image
        where the family needs one."""
        fields, uploads = super().health_request()
        if self.defaults.few_step is not None:
            fields["num_inference_steps"] = self.defaults.few_step.step_counts[0]
        return {**fields, "num_frames": 1}, uploads

    def generate(self, items: list[WorkItem], ctx) -> torch.Tensor:
        try:
            return super().generate(items, ctx)
        finally:
            if self.expert_offload is not None:
                self.expert_offload.idle()


TURBO_SLA = "SLA (sparse-linear attention)"
"""The sparse attention TurboDiffusion's TurboWan releases were trained with."""
TURBO_T2V = dict(few_step=rcm(sigma_max=80.0), sparse_attention=TURBO_SLA)
"""TurboWan2.1 T2V's sampler and attention (``wan2.1_t2v_infer.py``)."""


class WanT2VPipeline(WanFamily):
    """Wan2.1 T2V 1.3B / 14B (and the distilled FastWan2.1 / TurboWan2.1 T2V releases)."""

    family = "wan2.1-t2v"
    task = "t2v"
    diffusers_class = "WanPipeline"
    checkpoint = TINY_WAN
    builtin_name = "tiny/wan2.1-t2v"
    variants = {
        # Wan-AI cards: 50 steps, guidance 5, 81 frames at 16 fps; flow shift 3 at 480P, 5 at 720P
        "Wan2.1-T2V-1.3B": WanDefaults(width=832, height=480, num_frames=81, flow_shift=3.0),
        "Wan2.1-T2V-14B": WanDefaults(width=1280, height=720, num_frames=81, flow_shift=3.0, flow_shift_720p=5.0),
        # FastVideo (FastWanT2V480PConfig): DMD at timesteps 1000/757/522 (shift 8) + video sparse
        # attention, 61 x 448 x 832, no CFG
        "FastWan2.1-T2V-1.3B": WanDefaults(
            width=832,
            height=448,
            num_frames=61,
            steps=3,
            guidance=1.0,
            few_step=dmd(shift=8.0),
            sparse_attention="video sparse attention (VSA)",
        ),
        # TurboDiffusion (wan2.1_t2v_infer.py, its profiles in FastVideo): rCM, 4 steps from sigma_max
        # 80, SLA (sparse-linear attention), no CFG
        "TurboWan2.1-T2V-1.3B": WanDefaults(width=832, height=480, num_frames=81, steps=4, guidance=1.0, **TURBO_T2V),
        "TurboWan2.1-T2V-14B": WanDefaults(width=832, height=480, num_frames=81, steps=4, guidance=1.0, **TURBO_T2V),
        "TurboWan2.1-T2V-14B-720P": WanDefaults(
            width=1280, height=720, num_frames=81, steps=4, guidance=1.0, **TURBO_T2V
        ),
    }
    fallback_variant = "Wan2.1-T2V-1.3B"
