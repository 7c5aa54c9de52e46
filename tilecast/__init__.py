"""tilecast: a serving runtime for diffusion models on torchrun ranks.

Subpackages: ``tilecast.scheduler`` (rank-0 ZeroMQ scheduler, protocol, batching, client),
``tilecast.runtime`` (rank execution, pipelines), ``tilecast.kernels`` (attention and
collectives), ``tilecast.launcher`` (the ``tilecast`` CLI).
"""

import os as _os
import sys as _sys

__version__ = "0.1.0"

# pyproject maps the checkout's top-level folders (kernels/, runtime/, ...) under ``tilecast``. The
# checkout root itself on sys.path (``python -m tilecast`` run from it) would make ``import kernels``
# find our folder instead of the PyPI package of that name that transformers imports; take it off.
# Only a checkout's root: installed, ``tilecast/`` sits in site-packages (or a ``--target`` folder),
# which must stay on the path for every other package.
_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_ROOT, "pyproject.toml")) and _os.path.isdir(_os.path.join(_ROOT, "kernels")):
    _sys.path[:] = [entry for entry in _sys.path if _os.path.abspath(entry or _os.curdir) != _ROOT]
