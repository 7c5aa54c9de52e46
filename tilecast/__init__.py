"""tilecast: a serving runtime for diffusion models on torchrun ranks.

Subpackages: ``tilecast.scheduler`` (rank-0 ZeroMQ scheduler, protocol, batching, client),
``tilecast.runtime`` (rank execution, pipelines), ``tilecast.kernels`` (attention and
collectives), ``tilecast.launcher`` (the ``tilecast`` CLI).
"""

__version__ = "0.1.0"
