"""Helios text-to-video: Helios-Base (``HeliosPipeline``), Helios-Mid and Helios-Distilled
(``HeliosPyramidPipeline``), and the built-in tiny checkpoints ``tiny/helios-base`` and
``tiny/helios-distilled``.

Helios generates a video autoregressively in chunks of 9 latent frames (33 frames after the causal
Wan VAE), each chunk denoised with the earlier ones as compressed history (short, mid and long
memory patches of the ``HeliosTransformer3DModel``); diffusers keeps ``4k + 1`` of the decoded
frames. tilecast takes ``num_frames = 32k + 1`` (33, 65, 97, ...), generates the whole chunks
diffusers generates for it and returns its first ``num_frames`` frames (up to three chunks that is
all of them; from four on diffusers keeps a few more, 129 of 132 for instance).

The pyramid checkpoints run each chunk in three stages at growing resolution (1/4, 1/2, full),
re-noised with block noise between stages; Helios-Mid uses classifier-free guidance with CFG-Zero*
(``is_cfg_zero_star`` in its ``model_index.json``) and the pyramid ``HeliosScheduler``,
Helios-Distilled is step-distilled (``is_distilled``) with ``HeliosDMDScheduler``. The released
checkpoints differ in nothing else: same text encoder, VAE and transformer architecture.

The tiny checkpoints keep the real structure with every size shrunk: a ``HeliosTransformer3DModel``
of 40 blocks (the released count, see Ranks) on 1x2x2 patches with the multi-term memory patches
(short 1x2x2, mid 2x4x4, long 4x8x8), a ``UMT5EncoderModel`` text encoder with an offline ``T5TokenizerFast`` (``tiny/wan2.1-t2v``'s), and
the causal ``AutoencoderKLWan`` (16 latent channels, 4x temporal): 8x spatial for Base as
released; ``tiny/helios-distilled`` uses a 4x spatial VAE (one level less) so that its three
pyramid stages fit the families' 32x32 test size (the released 8x VAE needs sides in multiples of
64 there). Schedulers: ``HeliosScheduler`` with one stage and dynamic shifting for Base (as
diffusers' own tiny Helios), ``HeliosDMDScheduler``'s defaults (three stages) for Distilled.

Defaults (the model cards' diffusers examples, ``docs/api/pipelines/helios``): Base 50 steps at
``guidance_scale`` 5.0; Mid 20 steps per pyramid stage at 5.0 (CFG-Zero* with zero-init on the first
step, diffusers' defaults); Distilled 2 steps per stage without guidance (1.0; above 1 is refused,
and so is ``negative_prompt``) with the first chunk's steps doubled (``is_amplify_first_chunk``).
For the pyramid rows ``num_inference_steps`` is the steps *per stage*. 512 text tokens, 24 fps,
33 frames. Classifier-free guidance uses each request's ``negative_prompt`` (default ``""``).

Batching: Base merges requests (one ``HeliosPipeline`` call, a generator per request; measured
batched == singleton within 1e-5). The pyramid rows are served one request at a time
(``max_batch_size = 1``): ``HeliosPyramidPipeline.sample_block_noise`` draws the whole batch's
block noise from the first request's generator, so a merged request's video depends on its batch
mates (``tests/test_hunyuan_helios.py`` pins this).

Ranks: Ulysses and Ring run diffusers' ``_cp_plan`` for ``HeliosTransformer3DModel``: every
self-attention, cross-attention and feed-forward call's tokens are split over the ranks and its
output gathered (``sp_attention.HeliosSequenceParallelProcessor``: self-attention across the ranks,
with ``is_amplify_history``'s history-key scaling by global position; cross-attention to the
replicated text locally). The plan names the released model's 40 blocks by index, so the tiny
transformers keep 40 (tiny) blocks. 2 and 4 gloo ranks match one rank within 5e-6.
``--vae-config.use-parallel-decode``: the VAE is Wan's ``AutoencoderKLWan``, and diffusers decodes
each chunk with ``vae.decode``, so each chunk's decode splits by row bands across the decode group
as Wan's does (``wan_decode``; 2 ranks match the serial decode within 1e-5, ``tests/test_wan_decode.py``).

Three diffusers 0.42.1 gaps are covered here: CFG-Zero* views the transformer's output, which is not
contiguous where a pyramid stage is one patch wide (``_contiguous_output``); the Helios
pipelines call ``ftfy.fix_text`` on every prompt without checking that ftfy is installed (Wan's
pipelines check): without ftfy, ``guard_missing_ftfy`` makes them skip it, as Wan's do (HTML
unescaping and whitespace cleaning still run); and the pyramid's block noise factors its
covariance in float32, where at the released ``gamma`` (1/3) the matrix is singular or slightly
indefinite, so whether the Cholesky factorization succeeds depends on the CPU's rounding (it
fails on an AVX-512 AMD EPYC): ``block_noise`` factors it in float64 (``tests/test_hunyuan_helios.py``).
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

import torch

from tilecast.runtime.models.families import common, tokenizers, wan
from tilecast.runtime.models.families.common import DiffusersBatchPipeline, StepDistilled, T2VParams, TinyCheckpoint
from tilecast.runtime.pipeline import WorkItem

logger = logging.getLogger(__name__)

TEXT_DIM = wan.TEXT_DIM
"""``d_model`` of the tiny UMT5 encoder (the transformer's ``text_dim``)."""
CHUNK_LATENT_FRAMES = 9
"""Latent frames per autoregressive chunk (diffusers' ``num_latent_frames_per_chunk``, as released)."""
MAX_FRAMES = 32 * 32 + 1
"""Longest video a request may ask for (32 chunks, 43 s at 24 fps)."""
RELEASED_LAYERS = 40
"""Transformer blocks of the released Helios checkpoints (and of the tiny ones: see ``_tiny_transformer``)."""
PYRAMID_DEFAULTS = {True: (2, 1.0), False: (20, 5.0)}
"""Steps per pyramid stage and guidance scale: Helios-Distilled (``is_distilled``), Helios-Mid."""


def guard_missing_ftfy() -> None:
    """Without ftfy installed, diffusers' Helios prompt cleaning skips ``ftfy.fix_text`` (as Wan's
    does) instead of failing on the missing module; with ftfy, nothing changes."""
    from diffusers.pipelines.helios import pipeline_helios, pipeline_helios_pyramid
    from diffusers.utils import is_ftfy_available

    if is_ftfy_available():
        return
    import html

    def basic_clean(text):
        return html.unescape(html.unescape(text)).strip()

    for module in (pipeline_helios, pipeline_helios_pyramid):
        module.basic_clean = basic_clean


def chunk_frames(vae_temporal: int = 4) -> int:
    """Frames one chunk decodes to (33)."""
    return (CHUNK_LATENT_FRAMES - 1) * vae_temporal + 1


def generated_frames(num_frames: int, vae_temporal: int = 4) -> int:
    """Frames ``HeliosPipeline`` returns for ``num_frames``: whole chunks, cut to ``4k + 1``."""
    chunks = max(1, math.ceil(num_frames / chunk_frames(vae_temporal)))
    return (chunks * chunk_frames(vae_temporal) - 1) // vae_temporal * vae_temporal + 1


def _text_encoder_and_tokenizer():
    from transformers import UMT5Config, UMT5EncoderModel

    from tilecast.runtime.models.families import flux

    t5 = flux.flux_configs(flux.TINY_OVERRIDES)["text_encoder_2"]  # UMT5 has T5-v1.1's structure
    return UMT5EncoderModel(UMT5Config(vocab_size=tokenizers.T5_VOCAB_SIZE, **t5)).eval(), tokenizers.t5_tokenizer()


def _tiny_transformer():
    from diffusers import HeliosTransformer3DModel

    return HeliosTransformer3DModel(  # 40 blocks: diffusers' _cp_plan names the released model's 40 by index
        patch_size=(1, 2, 2),
        **{**common.TINY_DIT, "num_layers": RELEASED_LAYERS},
        in_channels=16,
        out_channels=16,
        text_dim=TEXT_DIM,
        freq_dim=32,
        ffn_dim=64,
        rope_dim=common.TINY_ROPE_AXES,  # diffusers' _cp_plan names the released model's 40 blocks by index
    ).eval()


def build_tiny_helios_base():
    """The tiny ``HeliosPipeline`` (Helios-Base) in memory (call under a seed; ``TinyCheckpoint`` does)."""
    from diffusers import AutoencoderKLWan, HeliosPipeline, HeliosScheduler

    guard_missing_ftfy()
    text_encoder, tokenizer = _text_encoder_and_tokenizer()
    return HeliosPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=AutoencoderKLWan(**wan.tiny_vae_config()).eval(),
        scheduler=HeliosScheduler(stage_range=[0, 1], stages=1, use_dynamic_shifting=True),
        transformer=_tiny_transformer(),
    )


def build_tiny_helios_distilled():
    """The tiny ``HeliosPyramidPipeline`` (Helios-Distilled) in memory (call under a seed)."""
    from diffusers import AutoencoderKLWan, HeliosDMDScheduler, HeliosPyramidPipeline

    guard_missing_ftfy()
    text_encoder, tokenizer = _text_encoder_and_tokenizer()
    vae = AutoencoderKLWan(
        **{**wan.tiny_vae_config(), "dim_mult": [1, 2, 4], "temperal_downsample": [True, True]},
        scale_factor_spatial=4,  # one level less than released: three pyramid stages at 32x32
    ).eval()
    return HeliosPyramidPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        # gamma 0.25, not the released 1/3: diffusers' float32 block noise is well posed there (block_noise)
        scheduler=HeliosDMDScheduler(gamma=0.25),
        transformer=_tiny_transformer(),
        is_cfg_zero_star=False,
        is_distilled=True,  # as Helios-Distilled
    )


TINY_HELIOS_BASE = TinyCheckpoint(
    name="tiny-helios-base-v1", seed=20250709, build=build_tiny_helios_base, ref=f"{__name__}:TINY_HELIOS_BASE"
)
TINY_HELIOS_DISTILLED = TinyCheckpoint(
    name="tiny-helios-distilled-v2",
    seed=20250710,
    build=build_tiny_helios_distilled,
    ref=f"{__name__}:TINY_HELIOS_DISTILLED",
)


def _contiguous_output(module, args, output):
    """The transformer's output made contiguous (values unchanged). ``HeliosPyramidPipeline``'s CFG-Zero*
    (Helios-Mid) calls ``.view`` on it, which fails in diffusers 0.42.1 where a pyramid stage's
    latent grid is one patch wide (the smallest sizes: 64 pixels with the released VAE): the
    unpatchified output is then a non-contiguous view."""
    if torch.is_tensor(output):
        return output.contiguous()
    if isinstance(output, tuple):
        return tuple(o.contiguous() if torch.is_tensor(o) else o for o in output)
    return output


def block_noise(
    pipe,
    batch_size: int,
    channel: int,
    num_frames: int,
    height: int,
    width: int,
    patch_size: tuple[int, ...] = (1, 2, 2),
    device: torch.device | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``HeliosPyramidPipeline.sample_block_noise`` with its covariance factored in float64: noise
    correlated within each ``ph x pw`` patch, ``cov = (1 + gamma) I - gamma 11^T + 1e-8 I``.

    diffusers builds ``cov`` in float32, where ``1 + 1/3 - 1/3`` rounds to 1 and the 1e-8 is lost, so
    at the released ``gamma = 1/3`` its smallest eigenvalue is -3e-8 and ``torch.linalg.cholesky``
    fails or not by rounding. In float64 the matrix is positive definite (smallest eigenvalue about
    1e-8) for every ``gamma <= 1/3``; its factor is rounded to float32 and the draw is diffusers'
    (the same generator calls, in the same order). Where the float32 factorization is well
    conditioned, the noise equals diffusers' within float32 rounding."""
    if generator is None:
        generator = torch.Generator(device=device)
    elif isinstance(generator, list):
        generator = generator[0]
    gamma = float(pipe.scheduler.config.gamma)
    _, ph, pw = patch_size
    block_size = ph * pw
    eye = torch.eye(block_size, dtype=torch.float64)
    cov = eye * (1 + gamma) - torch.ones(block_size, block_size, dtype=torch.float64) * gamma + eye * 1e-8
    factor = torch.linalg.cholesky(cov).to(device=device, dtype=torch.float32)
    block_number = batch_size * channel * num_frames * (height // ph) * (width // pw)
    z = torch.randn(block_number, block_size, generator=generator, device=generator.device).to(device=device)
    noise = (z @ factor.T).view(batch_size, channel, num_frames, height // ph, width // pw, ph, pw)
    return noise.permute(0, 1, 2, 3, 5, 4, 6).reshape(batch_size, channel, num_frames, height, width)


class HeliosParams(T2VParams, forbid_unknown_fields=True, kw_only=True):
    """A Helios request: ``T2VParams`` with one chunk's 33 frames at 24 fps by default."""

    num_frames: int = 33
    """Frames to generate: ``32k + 1`` (whole chunks of 33 frames)."""
    fps: int = 24
    """Frame rate of the written video (Helios' examples write 24 fps)."""


class HeliosT2VPipeline(DiffusersBatchPipeline):
    """Helios-Base T2V; a merged batch is one ``HeliosPipeline`` call (see ``families.common``)."""

    family = "helios-base"
    task = "t2v"
    num_frames_rule = (32, 1)
    params_type = HeliosParams
    diffusers_class = "HeliosPipeline"
    checkpoint = TINY_HELIOS_BASE
    builtin_name = "tiny/helios-base"
    model_id_hints = ("Helios-Base",)
    """``BestWishYsh/Helios-Base``, case-insensitively."""
    cp_plan = "diffusers:HeliosTransformer3DModel._cp_plan"
    size_multiple = 16
    """The VAE's 8x on 2x2 patches."""
    default_steps = 50
    default_guidance = 5.0
    max_sequence_length = 512
    """diffusers' default, as Wan's UMT5 was trained."""
    output_kind = "video"
    per_request_fields = DiffusersBatchPipeline.per_request_fields + ("fps",)
    """``fps`` only stamps the written file, so requests with different rates still merge."""
    honoured_settings = DiffusersBatchPipeline.honoured_settings | {
        "vae.use_parallel_decode",
        "vae.parallel_decode_mode",
    }
    """Also the parallel decode settings (``wan_decode.install`` reads them)."""
    unsupported_reasons = common.VIDEO_VAE_REASONS

    @classmethod
    def build_diffusers(cls, model_path: str, device, dtype):
        guard_missing_ftfy()
        return super().build_diffusers(model_path, device, dtype)

    def __init__(self, pipe, ctx) -> None:
        from tilecast.runtime.models.families import wan_decode  # imports diffusers' Wan VAE module

        super().__init__(pipe, ctx)
        self.vae_temporal = pipe.vae_scale_factor_temporal
        """Frames per latent frame after the first (4, the Wan VAE's)."""
        self.parallel_decode = wan_decode.install(pipe.vae, ctx, self.family)
        """Whether each chunk's VAE decode is split by rows across the decode group (``wan_decode``)."""

    def chunks(self, params) -> int:
        """Autoregressive chunks ``params`` generates."""
        return max(1, math.ceil(params.num_frames / chunk_frames(self.vae_temporal)))

    def denoising_steps(self, params) -> int:
        return params.num_inference_steps * self.chunks(params)

    def validate(self, params) -> None:
        if not 1 <= params.num_frames <= MAX_FRAMES or (params.num_frames - 1) % 32:
            raise ValueError(
                f"num_frames must be 32k+1 in 33..{MAX_FRAMES} for {self.family} (whole chunks of 33 frames), "
                f"got {params.num_frames}"
            )
        if not 1 <= params.fps <= 120:
            raise ValueError(f"fps must be in 1..120, got {params.fps}")

    def call_kwargs(self, params) -> dict[str, Any]:
        return {**super().call_kwargs(params), "num_frames": params.num_frames}

    def generate(self, items: list[WorkItem], ctx) -> torch.Tensor:
        """The diffusers call; the first ``num_frames`` of the frames it keeps."""
        return super().generate(items, ctx)[:, : items[0].params.num_frames]


class HeliosPyramidT2VPipeline(StepDistilled, HeliosT2VPipeline):
    """Helios-Mid / Helios-Distilled T2V: one request per ``HeliosPyramidPipeline`` call. The class
    defaults are Distilled's; a Mid checkpoint's (``is_distilled`` false) replace them at load."""

    family = "helios-pyramid"
    diffusers_class = "HeliosPyramidPipeline"
    checkpoint = TINY_HELIOS_DISTILLED
    builtin_name = "tiny/helios-distilled"
    model_id_hints = ("Helios-Mid", "Helios-Distilled")
    """``BestWishYsh/Helios-Mid`` and ``BestWishYsh/Helios-Distilled``, case-insensitively."""
    default_steps, default_guidance = PYRAMID_DEFAULTS[True]
    distilled_name = "Helios-Distilled"
    max_batch_size = 1
    """``sample_block_noise`` draws a batch's block noise from its first generator: see the module docstring."""

    def __init__(self, pipe, ctx) -> None:
        super().__init__(pipe, ctx)  # StepDistilled: Helios-Distilled (DMD, no guidance), else Helios-Mid (CFG-Zero*)
        self.default_steps, self.default_guidance = PYRAMID_DEFAULTS[self.distilled]
        self.stages = int(pipe.scheduler.config.stages)
        """Pyramid stages per chunk (3 as released)."""
        self.size_multiple = pipe.vae_scale_factor_spatial * 2 * 2 ** (self.stages - 1)
        """Every stage's latent sides must still split into 2x2 patches (64 with the released VAE)."""
        pipe.sample_block_noise = functools.partial(block_noise, pipe)
        if not getattr(pipe.transformer, "_tilecast_contiguous_output", False):
            pipe.transformer.register_forward_hook(_contiguous_output)
            pipe.transformer._tilecast_contiguous_output = True

    def denoising_steps(self, params) -> int:
        per_chunk = params.num_inference_steps * self.stages
        return per_chunk * self.chunks(params) + (per_chunk if self.distilled else 0)  # amplified first chunk

    def call_kwargs(self, params) -> dict[str, Any]:
        """The base arguments with the steps per stage as ``pyramid_num_inference_steps_list``, and
        Distilled's amplified first chunk (its card)."""
        kwargs = super().call_kwargs(params)
        steps = kwargs.pop("num_inference_steps")
        return {
            **kwargs,
            "pyramid_num_inference_steps_list": [steps] * self.stages,
            "is_amplify_first_chunk": self.distilled,
        }
