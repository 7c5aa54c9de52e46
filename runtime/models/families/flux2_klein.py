"""FLUX.2 [klein] text-to-image (``Flux2KleinPipeline``: Klein 4B, 9B, Base 4B, Base 9B) and the built-in
tiny checkpoint ``tiny/flux.2-klein-4b``.

The tiny checkpoint keeps Klein's structure with every size shrunk: FLUX.2's VAE and MMDiT
(``families.flux2``'s tiny ones, here without the guidance embedding: Klein has none) and a
``Qwen3ForCausalLM`` text encoder of 27 layers (the pipeline stacks the hidden states of layers 9,
18 and 27 as the text embedding), with the offline byte-level Qwen tokenizer and chat template
(each prompt is formatted as a user turn with thinking off). Like the released Klein 4B, the
pipeline is marked ``is_distilled``.

One declaration serves the four released checkpoints; ``is_distilled`` in their
``model_index.json`` picks the defaults (the model cards): the step-distilled Klein 4B / 9B run 4
steps without guidance (``guidance_scale`` 1.0; above 1 is refused, as diffusers would ignore
it, and so is ``negative_prompt``), the Base checkpoints run 50 steps of classifier-free guidance
at 4.0. With guidance on, each request's ``negative_prompt`` (default ``""``, diffusers' only
choice) is encoded here and passed as ``negative_prompt_embeds``. 512 text tokens (diffusers'
default).
"""

from __future__ import annotations

import logging
from typing import Any

from tilecast.runtime.models.families import common, flux2, tokenizers
from tilecast.runtime.models.families.common import DiffusersBatchPipeline, StepDistilled, TinyCheckpoint
from tilecast.runtime.pipeline import WorkItem

logger = logging.getLogger(__name__)

BASE_STEPS = 50
"""Steps of the undistilled Klein Base checkpoints (their model cards)."""
BASE_GUIDANCE = 4.0
"""Classifier-free guidance scale of the Klein Base checkpoints (their model cards)."""


def build_tiny_flux2_klein():
    """The tiny ``Flux2KleinPipeline`` in memory (call under a seed; ``TinyCheckpoint`` does)."""
    from diffusers import Flux2KleinPipeline
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = tokenizers.qwen_tokenizer()
    text_config = {
        **common.tiny_qwen_text_config(tokenizer, hidden_size=flux2.TEXT_DIM),
        "num_hidden_layers": 27,  # the pipeline reads hidden states 9, 18 and 27
    }
    return Flux2KleinPipeline(
        scheduler=flux2.scheduler(),
        vae=flux2.tiny_vae(),
        text_encoder=Qwen3ForCausalLM(Qwen3Config(head_dim=8, **text_config)).eval(),
        tokenizer=tokenizer,
        transformer=flux2.tiny_transformer(guidance_embeds=False),
        is_distilled=True,  # as FLUX.2-klein-4B
    )


TINY_FLUX2_KLEIN = TinyCheckpoint(
    name="tiny-flux.2-klein-4b-v1",
    seed=20250706,
    build=build_tiny_flux2_klein,
    ref=f"{__name__}:TINY_FLUX2_KLEIN",
)


class Flux2KleinT2IPipeline(StepDistilled, flux2.Flux2ReferenceImages, DiffusersBatchPipeline):
    """FLUX.2 [klein] T2I and reference-image editing; a merged batch is one ``Flux2KleinPipeline``
    call (see ``families.common``). The class defaults are the distilled checkpoints'; a Base
    checkpoint's replace them at load."""

    family = "flux.2-klein"
    task = "t2i"
    max_images = 4
    """BFL: up to 4 references for [klein] 4B and 9B."""
    diffusers_class = "Flux2KleinPipeline"
    checkpoint = TINY_FLUX2_KLEIN
    builtin_name = "tiny/flux.2-klein-4b"
    model_id_hints = ("flux.2-klein-4b", "flux.2-klein-9b", "flux.2-klein-base-4b", "flux.2-klein-base-9b")
    cp_plan = "diffusers:Flux2Transformer2DModel._cp_plan"
    default_steps = 4
    default_guidance = 1.0
    max_sequence_length = 512
    """diffusers' default."""

    distilled_name = "this FLUX.2 [klein] checkpoint"

    def __init__(self, pipe, ctx) -> None:
        super().__init__(pipe, ctx)
        if not self.distilled:
            self.default_steps, self.default_guidance = BASE_STEPS, BASE_GUIDANCE

    def negative_prompts(self, items: list[WorkItem]) -> dict[str, Any]:
        """``Flux2KleinPipeline`` takes no ``negative_prompt`` (it encodes ``""``): requests that set one
        get it encoded here, one per request, as ``negative_prompt_embeds``."""
        first = items[0].params
        if not self.guidance_on(first) or all(item.params.negative_prompt is None for item in items):
            return {}
        embeds, _text_ids = self.pipe.encode_prompt(
            prompt=[item.params.negative_prompt or self.default_negative_prompt for item in items],
            device=self.device,
            max_sequence_length=first.max_sequence_length or self.max_sequence_length,
        )
        return {"negative_prompt_embeds": embeds}
