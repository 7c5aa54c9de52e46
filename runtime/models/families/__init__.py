"""The batchable text-to-image and text-to-video families, each a diffusers pipeline served by tilecast.

============================  ===================  ======  =====================================
built-in name                 family               task    diffusers pipeline
============================  ===================  ======  =====================================
``tiny/flux``                 flux                 t2i     ``FluxPipeline`` (FLUX.1-dev)
``random/flux``               flux                 t2i     ``FluxPipeline`` (FLUX.1-dev, released size, random weights)
``tiny/qwen-image``           qwen-image           t2i     ``QwenImagePipeline``
``tiny/qwen-image-2512``      qwen-image-2512      t2i     ``QwenImagePipeline`` (Qwen-Image-2512)
``tiny/z-image-turbo``        z-image-turbo        t2i     ``ZImagePipeline`` (Z-Image-Turbo)
``tiny/z-image``              z-image              t2i     ``ZImagePipeline`` (Z-Image, the undistilled base)
``tiny/sd3``                  sd3                  t2i     ``StableDiffusion3Pipeline`` (SD3 Medium, SD3.5)
``tiny/ernie-image``          ernie-image          t2i     ``ErnieImagePipeline`` (ERNIE-Image)
``tiny/ernie-image-turbo``    ernie-image-turbo    t2i     ``ErnieImagePipeline`` (ERNIE-Image-Turbo)
``tiny/wan2.1-t2v``           wan2.1-t2v           t2v     ``WanPipeline`` (Wan2.1 T2V 1.3B)
============================  ===================  ======  =====================================

Variants (Qwen-Image-2512, Z-Image, ERNIE-Image-Turbo) are subclasses of their family's declaration
that change only defaults, checkpoint and name hints; the registry routes a shared diffusers class
by name.

Shared request fields, the batch execution and the tiny-checkpoint machinery live in
``families.common``; offline tokenizers in ``families.tokenizers``; released-size random models
(benchmarks) in ``families.released``. The benchmarks that serve them live in
``tilecast.launcher.bench`` (``batching``, ``peer``, ``step``).
"""
