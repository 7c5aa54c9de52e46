"""FLUX.1-dev text-to-image (``FluxPipeline``): its network configs and the built-in tiny checkpoint ``tiny/flux``.

``RELEASED_CONFIGS`` are FLUX.1-dev's component configs at the released size; ``build_flux`` turns
a set of configs into a ``FluxPipeline``. ``tiny/flux`` is the same structure with every size
shrunk (``TINY_OVERRIDES``): a 16-channel, 8x ``AutoencoderKL`` without quant convs, a
guidance-distilled ``FluxTransformer2DModel`` on 2x2-packed latents (64 input channels), a CLIP
text encoder for the pooled embedding and a T5 encoder for the sequence, and the dynamic-shift
flow-matching Euler scheduler. The released size with random weights is ``random/flux``
(``families.released``). FLUX.1-dev is guidance-distilled: ``guidance_scale`` is fed to the
transformer as an embedding, no classifier-free guidance runs, so a request takes no
``negative_prompt``.
"""

from __future__ import annotations

import logging
from typing import Callable

from tilecast.runtime.config import UnsupportedSettingError
from tilecast.runtime.models.families import common, tokenizers
from tilecast.runtime.models.families.common import DiffusersBatchPipeline, T2IParams, TinyCheckpoint

logger = logging.getLogger(__name__)

RELEASED_CONFIGS: dict[str, dict] = {
    # CLIP ViT-L/14 text tower (vocab and special ids come from the offline tokenizer)
    "text_encoder": dict(
        hidden_size=768,
        intermediate_size=3072,
        projection_dim=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        max_position_embeddings=77,
    ),
    # T5-v1.1-XXL encoder (vocab from the offline tokenizer; inference only, so no dropout)
    "text_encoder_2": dict(
        d_model=4096,
        d_kv=64,
        d_ff=10240,
        num_layers=24,
        num_heads=64,
        relative_attention_num_buckets=32,
        feed_forward_proj="gated-gelu",
        dropout_rate=0.0,
    ),
    "transformer": dict(
        patch_size=1,
        in_channels=64,
        num_layers=19,
        num_single_layers=38,
        attention_head_dim=128,
        num_attention_heads=24,
        joint_attention_dim=4096,
        pooled_projection_dim=768,
        guidance_embeds=True,
        axes_dims_rope=(16, 56, 56),
    ),
    "vae": dict(
        in_channels=3,
        out_channels=3,
        latent_channels=16,
        block_out_channels=(128, 256, 512, 512),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=2,
        norm_num_groups=32,
        sample_size=1024,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ),
    "scheduler": dict(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    ),
}
"""FLUX.1-dev's component configs (keyword arguments of each class), by ``FluxPipeline`` component name."""

TEXT_DIM = 32
"""Hidden size of both tiny text encoders (the transformer's joint and pooled dims)."""

TINY_OVERRIDES: dict[str, dict] = {
    "text_encoder": dict(
        hidden_size=TEXT_DIM, intermediate_size=64, projection_dim=TEXT_DIM, num_hidden_layers=1, num_attention_heads=2
    ),
    "text_encoder_2": dict(
        d_model=TEXT_DIM, d_kv=16, d_ff=64, num_layers=1, num_heads=2, relative_attention_num_buckets=8
    ),
    "transformer": dict(
        **common.TINY_DIT,
        num_single_layers=1,
        joint_attention_dim=TEXT_DIM,
        pooled_projection_dim=TEXT_DIM,
        axes_dims_rope=common.TINY_ROPE_AXES,
    ),
    "vae": dict(block_out_channels=(8, 16, 16, 16), layers_per_block=1, norm_num_groups=8, sample_size=64),
}
"""What ``tiny/flux`` changes in ``RELEASED_CONFIGS``: every size, nothing structural."""


def flux_configs(overrides: dict[str, dict] | None = None) -> dict[str, dict]:
    """``RELEASED_CONFIGS`` with ``overrides`` merged in per component (``ValueError`` on an unknown component)."""
    overrides = overrides or {}
    unknown = sorted(set(overrides) - set(RELEASED_CONFIGS))
    if unknown:
        raise ValueError(f"unknown FLUX component(s) {unknown}; known: {', '.join(RELEASED_CONFIGS)}")
    return {name: {**config, **overrides.get(name, {})} for name, config in RELEASED_CONFIGS.items()}


def build_flux(configs: dict[str, dict], finish: Callable = lambda module: module.eval()):
    """A ``FluxPipeline`` with freshly initialised weights from ``configs`` (``flux_configs``' shape).

    Weights come from the global torch RNG: call under a seed. ``finish`` is applied to each
    network right after it is built (default ``eval()``; the random builder also casts there, so
    at most one network at a time exists in float32).
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    clip_tok = tokenizers.clip_tokenizer()
    t5_tok = tokenizers.t5_tokenizer()
    clip = finish(
        CLIPTextModel(
            CLIPTextConfig(
                vocab_size=tokenizers.CLIP_VOCAB_SIZE,
                bos_token_id=clip_tok.bos_token_id,
                eos_token_id=clip_tok.eos_token_id,
                pad_token_id=clip_tok.pad_token_id,
                **configs["text_encoder"],
            )
        )
    )
    t5 = finish(T5EncoderModel(T5Config(vocab_size=tokenizers.T5_VOCAB_SIZE, **configs["text_encoder_2"])))
    transformer = finish(FluxTransformer2DModel(**configs["transformer"]))
    vae = finish(AutoencoderKL(**configs["vae"]))
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**configs["scheduler"]),
        vae=vae,
        text_encoder=clip,
        tokenizer=clip_tok,
        text_encoder_2=t5,
        tokenizer_2=t5_tok,
        transformer=transformer,
    )


def build_tiny_flux():
    """The tiny ``FluxPipeline`` in memory (call under a seed; ``TinyCheckpoint`` does)."""
    return build_flux(flux_configs(TINY_OVERRIDES))


TINY_FLUX = TinyCheckpoint(name="tiny-flux-v1", seed=20250701, build=build_tiny_flux, ref=f"{__name__}:TINY_FLUX")


class FluxT2IPipeline(DiffusersBatchPipeline):
    """FLUX.1-dev T2I; a merged batch is one ``FluxPipeline`` call (see ``families.common``)."""

    family = "flux"
    task = "t2i"
    params_type = T2IParams
    diffusers_class = "FluxPipeline"
    checkpoint = TINY_FLUX
    builtin_name = "tiny/flux"
    cp_plan = "diffusers:FluxTransformer2DModel._cp_plan"
    size_multiple = 16
    default_guidance = 3.5
    max_sequence_length = 128
    honoured_settings = DiffusersBatchPipeline.honoured_settings | {"attention_backend", "quantize", "cuda_graphs"}
    compile_options = {"combo_kernels": True, "coordinate_descent_tuning": True}
    """A joint block's image and text streams run the same norms side by side: Inductor launches
    those pairs as one kernel (``combo_kernels``), and tunes its kernels' block sizes at compile
    time (``coordinate_descent_tuning``; about 25 s more of the first compile on an H100). A 512²
    batch-1 step: 40.2 -> 39.2 ms (README, Performance)."""

    @classmethod
    def install_fast_paths(cls, pipe, settings) -> None:
        """tilecast's attention kernel, fused projections and ``--quantize`` (``flux_fast``), the
        modulation planned once per denoising loop (``flux_plan``), then the families' ``--compile``,
        which here compiles the VAE decoder too, then ``--cuda-graphs``."""
        from tilecast.runtime import cuda_graphs
        from tilecast.runtime.models.families import flux_plan
        from tilecast.runtime.models.families.flux_fast import install_fast_paths

        lora = settings.lora_enabled
        if lora and (settings.quantize or settings.cuda_graphs):
            flag = "--quantize" if settings.quantize else "--cuda-graphs"
            raise UnsupportedSettingError(
                f"{flag} cannot be combined with LoRA adapters (--lora-path / --lora-dir): "
                "an adapter changes the linear layers that FP8 replaces and that a CUDA graph has captured"
            )
        install_fast_paths(
            pipe.transformer, backend=settings.attention_backend, quantize=settings.quantize, fuse=not lora
        )
        planner = flux_plan.install(pipe.transformer, pipe.scheduler)  # each loop's modulation in one product
        super().install_fast_paths(pipe, settings)
        if settings.compile:
            pipe.vae.decoder.compile()  # a batch of 16 512x512 decodes: 0.21 s eager, 0.10 s compiled (H200)
            pipe.transformer.pos_embed.compile()  # the rotary tables: ~35 small kernels a step eager, fused here
        if settings.cuda_graphs:  # a forward reading a staged modulation row is a graph of its own
            cuda_graphs.install(pipe.transformer, key=lambda: planner is not None and planner.bank.staged)

    def guidance_on(self, params) -> bool:
        return False  # guidance-distilled: guidance_scale is an embedding, not CFG

    def no_guidance_reason(self, params) -> str:
        return "FLUX.1-dev is guidance-distilled and runs no classifier-free guidance"
