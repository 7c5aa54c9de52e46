"""Kandinsky 6 video super-resolution (issue 3): the ``tiny/k6sr`` checkpoint, loading, PyAV I/O,
tiling, dense attention, the compute stages and the ``K6SRPipeline``.

Import the pipeline lazily (``tilecast.runtime.models.k6sr.pipeline:K6SRPipeline``): this package's
``__init__`` stays free of torch/diffusers imports so that light modules (``params``) load fast.
"""
