"""Replay a module's forward as CUDA graphs, one per input signature (``--cuda-graphs``).

A small diffusion step launches many kernels (FLUX at 512² and batch 1: about a thousand per
step), so on a busy host the GPU waits between them (README, Performance). ``GraphedForward`` records the whole forward once per signature (the shapes, dtypes and devices
of its tensor arguments and the values of the others) and afterwards replays it with one launch:
the arguments are copied into the graph's own input buffers, the graph runs, and its outputs are
cloned out, so a later replay never overwrites what a caller holds. Before a graph is instantiated
its small memset nodes become fill kernels (``graph_memsets``: a memset between two kernels of a
replay costs about 6 µs, a kernel about 1).

A signature is run ``warmup_calls`` times without a graph first (``torch.compile`` compiles and
cuDNN picks its plans there, neither of which may happen inside a capture), then captured. All
of one module's graphs allocate from one memory pool: they run one at a time on the same stream,
and every output is cloned before the next replay, so they may reuse each other's intermediates.

The forward must be capturable: device tensors only, no host synchronisation (``.item()``,
data-dependent shapes), no state carried between calls outside its arguments, except state that
``key`` names: its value is part of the signature, so each value gets its own graph (FLUX's
modulation computed in the forward, or read from a buffer a pre-hook filled:
``families.modulation``). Its outputs must be a tensor or a tuple/list of tensors. A capture uses
PyTorch's default (global) error mode, so no other thread may call CUDA meanwhile (tilecast's file
writers get host tensors). The pool keeps the largest captured forward's working memory reserved
for the life of the process.

Shapes: whatever the module takes; nothing is reshaped here.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Callable

import torch

from tilecast.runtime import graph_memsets

logger = logging.getLogger(__name__)

WARMUP_CALLS = 2
"""Plain calls of a new signature before it is captured (the first compiles, the second settles)."""


def _plain(value: Any) -> Any:
    """``value`` as a hashable key: None, numbers, strings, and dicts/lists/tuples of them."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return ("dict", tuple(sorted((str(k), _plain(v)) for k, v in value.items())))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_plain(v) for v in value))
    raise TypeError(
        "a CUDA-graphed forward takes tensors and plain values (None, numbers, strings, and dicts or "
        f"lists of them), got {type(value).__name__}"
    )


def _signature(args: tuple, kwargs: dict) -> tuple:
    def one(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), value.dtype, value.device)
        return _plain(value)

    return tuple(one(a) for a in args), tuple(sorted((k, one(v)) for k, v in kwargs.items()))


def _clone_out(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in out):
        return type(out)(o.clone() for o in out)
    raise TypeError(f"a CUDA-graphed forward must return a tensor or a tuple/list of tensors, got {type(out).__name__}")


class _Captured:
    """One recorded call: its input buffers, its graph and its output buffers."""

    def __init__(self, forward: Callable, args: tuple, kwargs: dict, pool) -> None:
        self.args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        self.kwargs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # one call on a side stream first, as PyTorch's capture recipe asks
            _clone_out(forward(*self.args, **self.kwargs))
        torch.cuda.current_stream().wait_stream(side)
        try:
            self.graph, editable = torch.cuda.CUDAGraph(keep_graph=True), True  # edited, then instantiated
        except TypeError:  # a PyTorch without keep_graph: the graph is instantiated as captured
            self.graph, editable = torch.cuda.CUDAGraph(), False
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = forward(*self.args, **self.kwargs)
        self.memsets_replaced = 0
        if editable:
            self.memsets_replaced = graph_memsets.convert(self.graph.raw_cuda_graph())
            self.graph.instantiate()

    def replay(self, args: tuple, kwargs: dict) -> Any:
        for static, value in zip(self.args, args):
            if isinstance(static, torch.Tensor):
                static.copy_(value)
        for name, value in kwargs.items():
            if isinstance(value, torch.Tensor):
                self.kwargs[name].copy_(value)
        self.graph.replay()
        return _clone_out(self.out)


class GraphedForward:
    """Callable that stands in for ``module.forward``; see the module doc. ``install`` puts it in place."""

    def __init__(
        self, module: torch.nn.Module, *, warmup_calls: int = WARMUP_CALLS, key: Callable[[], Any] = lambda: None
    ) -> None:
        if warmup_calls < 1:
            raise ValueError(f"warmup_calls must be at least 1, got {warmup_calls}")
        self.forward = type(module).forward.__get__(module)
        self.warmup_calls = warmup_calls
        self.key = key
        self.calls: Counter = Counter()
        self.graphs: dict[tuple, _Captured] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, *args, **kwargs) -> Any:
        key = (_signature(args, kwargs), _plain(self.key()))
        captured = self.graphs.get(key)
        if captured is None:
            self.calls[key] += 1
            if self.calls[key] <= self.warmup_calls:
                return self.forward(*args, **kwargs)
            logger.info("capturing a CUDA graph (%d so far) for %s", len(self.graphs) + 1, key)
            captured = self.graphs[key] = _Captured(self.forward, args, kwargs, self.pool)
            logger.info("captured; %d memset nodes became fill kernels", captured.memsets_replaced)
        return captured.replay(args, kwargs)


def check_supported(device: torch.device) -> None:
    """Raise ``ValueError`` naming the problem unless ``device`` can capture CUDA graphs."""
    if device.type != "cuda":
        raise ValueError(f"--cuda-graphs needs a CUDA device; the model is on {device}")


def install(
    module: torch.nn.Module, *, warmup_calls: int = WARMUP_CALLS, key: Callable[[], Any] = lambda: None
) -> GraphedForward:
    """Replace ``module.forward`` by a ``GraphedForward`` of it (module hooks still run around it);
    ``key()``, read at each call after the pre-hooks, is part of the signature (see the module doc)."""
    check_supported(next(module.parameters()).device)
    graphed = GraphedForward(module, warmup_calls=warmup_calls, key=key)
    module.forward = graphed
    return graphed
