"""The diffusers-pipeline families tilecast serves: one module per family (its declaration, its
tiny checkpoint, its context-parallel plan where tilecast writes one).

Which families exist is ``runtime/registry.py``'s ``PIPELINES`` (and the README's "Models served"
table, with each one's requests, batching and ranks); this index does not repeat them.

Shared request fields, the batch execution and the tiny-checkpoint machinery live in
``families.common``; offline tokenizers in ``families.tokenizers``; released-size random models
(benchmarks) in ``families.released``. The benchmarks that serve them live in
``tilecast.launcher.bench`` (``batching``, ``peer``, ``step``).
"""
