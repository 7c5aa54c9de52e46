"""The batchable text-to-image and text-to-video families, each a diffusers pipeline served by tilecast.

============================  ===============  ====  ============================================================================
built-in name                 family           task  diffusers pipeline
============================  ===============  ====  ============================================================================
``tiny/flux``                 flux             t2i   ``FluxPipeline`` (FLUX.1-dev)
``random/flux``               flux             t2i   ``FluxPipeline`` (FLUX.1-dev, released size, random weights)
``tiny/qwen-image``           qwen-image       t2i   ``QwenImagePipeline``
``tiny/z-image-turbo``        z-image-turbo    t2i   ``ZImagePipeline`` (Z-Image-Turbo)
``tiny/sd3``                  sd3              t2i   ``StableDiffusion3Pipeline`` (SD3 Medium, SD3.5)
``tiny/glm-image``            glm-image        t2i   ``GlmImagePipeline`` (GLM-Image; one request at a time)
``tiny/sana-1.5-1.6b``        sana             t2i   ``SanaPipeline`` (SANA 1.5 1.6B / 4.8B, SANA 1600M / 600M)
``tiny/flux.2-dev``           flux.2-dev       t2i   ``Flux2Pipeline`` (FLUX.2-dev)
``tiny/flux.2-klein-4b``      flux.2-klein     t2i   ``Flux2KleinPipeline`` (FLUX.2 [klein] 4B, 9B, Base 4B, Base 9B)
``tiny/wan2.1-t2v``           wan2.1-t2v       t2v   ``WanPipeline`` (Wan2.1 T2V 1.3B / 14B, FastWan2.1, TurboWan2.1)
``tiny/wan2.1-i2v-14b-480p``  wan2.1-i2v       i2v   ``WanImageToVideoPipeline`` (Wan2.1 I2V 480P / 720P, Fun 1.3B InP)
``tiny/wan2.2-t2v-a14b``      wan2.2-t2v-a14b  t2v   ``WanPipeline`` with two experts (Wan2.2 T2V A14B)
``tiny/wan2.2-i2v-a14b``      wan2.2-i2v-a14b  i2v   ``WanImageToVideoPipeline`` with two experts (Wan2.2 / TurboWan2.2 I2V A14B)
``tiny/wan2.2-ti2v-5b``       wan2.2-ti2v-5b   ti2v  ``WanPipeline`` + ``expand_timesteps`` (Wan2.2 / FastWan2.2 TI2V 5B)
============================  ===============  ====  ============================================================================

Shared request fields, the batch execution and the tiny-checkpoint machinery live in
``families.common``; offline tokenizers in ``families.tokenizers``; released-size random models
(benchmarks) in ``families.released``; what the Wan families share (card defaults per released id,
two experts, image-to-video inputs) in ``families.wan``. The benchmarks that serve them live in
``tilecast.launcher.bench`` (``batching``, ``peer``, ``step``).
"""
