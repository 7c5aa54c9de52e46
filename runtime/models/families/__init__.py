"""The batchable text-to-image and text-to-video families, each a diffusers pipeline served by tilecast.

built-in name          family          task    diffusers pipeline
=====================  ==============  ======  =====================================
``tiny/flux``          flux            t2i     ``FluxPipeline`` (FLUX.1-dev)
``random/flux``        flux            t2i     ``FluxPipeline`` (FLUX.1-dev, released size, random weights)
``tiny/qwen-image``    qwen-image      t2i     ``QwenImagePipeline``
``tiny/z-image-turbo`` z-image-turbo   t2i     ``ZImagePipeline`` (Z-Image-Turbo)
``tiny/sd3``           sd3             t2i     ``StableDiffusion3Pipeline`` (SD3 Medium, SD3.5)
``tiny/glm-image``     glm-image       t2i     ``GlmImagePipeline`` (GLM-Image; one request at a time)
``tiny/sana-1.5-1.6b`` sana            t2i     ``SanaPipeline`` (SANA 1.5 1.6B / 4.8B, SANA 1600M / 600M)
``tiny/wan2.1-t2v``    wan2.1-t2v      t2v     ``WanPipeline`` (Wan2.1 T2V 1.3B)
``tiny/ltx-2``         ltx-2           t2v     ``LTX2Pipeline`` (LTX-2, LTX-2.3; video with audio; I2V)
=====================  ==============  ======  =====================================
=======
========================  ==============  ======  =================================================================
built-in name             family          task    diffusers pipeline
========================  ==============  ======  =================================================================
``tiny/flux``             flux            t2i     ``FluxPipeline`` (FLUX.1-dev)
``random/flux``           flux            t2i     ``FluxPipeline`` (FLUX.1-dev, released size, random weights)
``tiny/qwen-image``       qwen-image      t2i     ``QwenImagePipeline``
``tiny/z-image-turbo``    z-image-turbo   t2i     ``ZImagePipeline`` (Z-Image-Turbo)
``tiny/sd3``              sd3             t2i     ``StableDiffusion3Pipeline`` (SD3 Medium, SD3.5)
``tiny/flux.2-dev``       flux.2-dev      t2i     ``Flux2Pipeline`` (FLUX.2-dev)
``tiny/flux.2-klein-4b``  flux.2-klein    t2i     ``Flux2KleinPipeline`` (FLUX.2 [klein] 4B, 9B, Base 4B, Base 9B)
``tiny/wan2.1-t2v``       wan2.1-t2v      t2v     ``WanPipeline`` (Wan2.1 T2V 1.3B)
``tiny/ltx-2``            ltx-2           t2v     ``LTX2Pipeline`` (LTX-2, LTX-2.3; video with audio; I2V)
========================  ==============  ======  =================================================================

Shared request fields, the batch execution and the tiny-checkpoint machinery live in
``families.common``; offline tokenizers in ``families.tokenizers``; released-size random models
(benchmarks) in ``families.released``. The benchmarks that serve them live in
``tilecast.launcher.bench`` (``batching``, ``peer``, ``step``).
"""
