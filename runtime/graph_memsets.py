"""A captured CUDA graph's memset nodes turned into kernel nodes that write the same bytes.

cuDNN's attention and some of cuBLASLt's GEMM kernels clear a few bytes of their workspace with
``cudaMemsetAsync`` before they run, so a captured FLUX step holds three memset nodes per block
(171 at 512², batch 1). In a graph replay a kernel follows a kernel after about 0.3 µs, but a
memset between two kernels costs about 6 µs: 1.5 µs before it, 1 µs for itself, 3-4 µs before the
next kernel (an H200 profile of the graphed step: about 1 ms of a 36.8 ms step). TensorRT-LLM
and Transformer Engine met the same gap and moved such clears into their kernels; here the graph
is edited after the capture instead: each small memset node is replaced by a node of a fill
kernel with the same destination, value, element size, width, height and pitch, and the same
dependencies, so the graph computes what it captured.

The fill kernel is a few lines of PTX the driver compiles for the GPU at hand (no compiler
needed); the graph is edited through the CUDA driver API (``libcuda``, by ctypes, with the
functions' original ABI names). ``convert`` returns how many nodes it replaced, and 0 where the
driver or a function is missing (the graph is then left as captured).
"""

from __future__ import annotations

import ctypes
import functools
import logging

logger = logging.getLogger(__name__)

MAX_BYTES = 1 << 20
"""Memsets larger than this stay memsets (the copy engine fills large buffers well)."""
THREADS = 256
_MEMSET_NODE, _SUCCESS = 2, 0  # CU_GRAPH_NODE_TYPE_MEMSET, CUDA_SUCCESS

_PTX_HEAD = """.version 7.0
.target sm_70
.address_size 64
"""
_PTX_ENTRY = """
.visible .entry tilecast_fill_{bits}(.param .u64 p_dst, .param .u64 p_pitch, .param .u32 p_value, .param .u64 p_width)
{{
    .reg .pred %p<2>;
    .reg .b16 %h<2>;
    .reg .b32 %r<6>;
    .reg .b64 %rd<10>;
    ld.param.u64 %rd1, [p_dst];
    ld.param.u64 %rd2, [p_pitch];
    ld.param.u32 %r1, [p_value];
    ld.param.u64 %rd3, [p_width];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mul.wide.u32 %rd4, %r2, %r3;
    cvt.u64.u32 %rd5, %r4;
    add.u64 %rd4, %rd4, %rd5;
    setp.ge.u64 %p1, %rd4, %rd3;
    @%p1 bra DONE;
    mov.u32 %r5, %ctaid.y;
    cvt.u64.u32 %rd6, %r5;
    mul.lo.u64 %rd6, %rd6, %rd2;
    add.u64 %rd7, %rd1, %rd6;
    shl.b64 %rd8, %rd4, {shift};
    add.u64 %rd7, %rd7, %rd8;
    cvt.u16.u32 %h1, %r1;
    {store};
DONE:
    ret;
}}
"""
_STORES = {1: "st.global.u8 [%rd7], %h1", 2: "st.global.u16 [%rd7], %h1", 4: "st.global.u32 [%rd7], %r1"}
FILL_PTX = _PTX_HEAD + "".join(
    _PTX_ENTRY.format(bits=8 * size, shift=size.bit_length() - 1, store=store) for size, store in _STORES.items()
)
"""One entry per element size: ``tilecast_fill_{8,16,32}(dst, pitch, value, width)`` writes ``value``
to ``width`` elements of row ``blockIdx.y`` (at ``dst + row * pitch``)."""


class _MemsetParams(ctypes.Structure):  # CUDA_MEMSET_NODE_PARAMS
    _fields_ = [
        ("dst", ctypes.c_uint64),
        ("pitch", ctypes.c_size_t),
        ("value", ctypes.c_uint),
        ("elementSize", ctypes.c_uint),
        ("width", ctypes.c_size_t),
        ("height", ctypes.c_size_t),
    ]


class _KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS (v1, cuGraphAddKernelNode's)
    _fields_ = [
        ("func", ctypes.c_void_p),
        ("gridDimX", ctypes.c_uint),
        ("gridDimY", ctypes.c_uint),
        ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint),
        ("blockDimY", ctypes.c_uint),
        ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint),
        ("kernelParams", ctypes.POINTER(ctypes.c_void_p)),
        ("extra", ctypes.POINTER(ctypes.c_void_p)),
    ]


class _Driver:
    """The driver functions used here, and the fill kernels loaded in the current context."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        module = ctypes.c_void_p()
        self.check("cuModuleLoadData", ctypes.byref(module), ctypes.c_char_p(FILL_PTX.encode()))
        self.fills = {}
        for size in _STORES:
            function = ctypes.c_void_p()
            name = f"tilecast_fill_{8 * size}".encode()
            self.check("cuModuleGetFunction", ctypes.byref(function), module, ctypes.c_char_p(name))
            self.fills[size] = function

    def check(self, name: str, *args) -> None:
        result = getattr(self.lib, name)(*args)
        if result != _SUCCESS:
            raise RuntimeError(f"{name} failed with CUresult {result}")

    def nodes(self, name: str, owner) -> list[ctypes.c_void_p]:
        """A node list the driver fills (``cuGraphGetNodes`` and the like): asked for its size first."""
        count = ctypes.c_size_t(0)
        self.check(name, owner, None, ctypes.byref(count))
        if count.value == 0:  # the driver refuses a second call with an empty list (CUDA_ERROR_INVALID_VALUE)
            return []
        found = (ctypes.c_void_p * count.value)()
        self.check(name, owner, found, ctypes.byref(count))
        return [ctypes.c_void_p(found[i]) for i in range(count.value)]


@functools.cache
def _driver(device_index: int) -> _Driver | None:
    """The driver and the fill kernels of ``device_index``'s context (PyTorch's current one then)."""
    try:
        return _Driver()
    except (OSError, AttributeError, RuntimeError) as exc:
        logger.warning("CUDA graphs keep their memset nodes: %s", exc)
        return None


def _current_driver() -> _Driver | None:
    import torch

    return _driver(torch.cuda.current_device())


def _replace(driver: _Driver, graph: ctypes.c_void_p, node: ctypes.c_void_p, memset: _MemsetParams) -> None:
    """Put a fill kernel node in ``node``'s place (same dependencies, same dependents), then remove it."""
    dependencies = driver.nodes("cuGraphNodeGetDependencies", node)
    dependents = driver.nodes("cuGraphNodeGetDependentNodes", node)
    values = (
        ctypes.c_uint64(memset.dst),
        ctypes.c_uint64(memset.pitch),
        ctypes.c_uint(memset.value),
        ctypes.c_uint64(memset.width),
    )
    arguments = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))  # the driver copies them
    params = _KernelParams(
        func=driver.fills[memset.elementSize],
        gridDimX=(memset.width + THREADS - 1) // THREADS,
        gridDimY=memset.height,
        gridDimZ=1,
        blockDimX=THREADS,
        blockDimY=1,
        blockDimZ=1,
        sharedMemBytes=0,
        kernelParams=arguments,
        extra=None,
    )
    kernel = ctypes.c_void_p()
    before = (ctypes.c_void_p * len(dependencies))(*(d.value for d in dependencies)) if dependencies else None
    count = ctypes.c_size_t(len(dependencies))
    driver.check("cuGraphAddKernelNode", ctypes.byref(kernel), graph, before, count, ctypes.byref(params))
    if dependents:
        sources = (ctypes.c_void_p * len(dependents))(*([kernel.value] * len(dependents)))
        targets = (ctypes.c_void_p * len(dependents))(*(d.value for d in dependents))
        driver.check("cuGraphAddDependencies", graph, sources, targets, ctypes.c_size_t(len(dependents)))
    driver.check("cuGraphDestroyNode", node)


def _memset_nodes(driver: _Driver, graph: ctypes.c_void_p) -> list[ctypes.c_void_p]:
    """``graph``'s memset nodes."""
    found = []
    for node in driver.nodes("cuGraphGetNodes", graph):
        kind = ctypes.c_int()
        driver.check("cuGraphNodeGetType", node, ctypes.byref(kind))
        if kind.value == _MEMSET_NODE:
            found.append(node)
    return found


def convert(raw_graph: int) -> int:
    """Replace the small memset nodes of the captured, not yet instantiated graph ``raw_graph``
    (``torch.cuda.CUDAGraph(keep_graph=True).raw_cuda_graph()``) by fill kernel nodes; returns how many."""
    driver = _current_driver()
    if driver is None:
        return 0
    graph = ctypes.c_void_p(raw_graph)
    replaced = 0
    try:
        for node in _memset_nodes(driver, graph):
            memset = _MemsetParams()
            driver.check("cuGraphMemsetNodeGetParams", node, ctypes.byref(memset))
            size = memset.elementSize * memset.width * memset.height
            if memset.elementSize in driver.fills and 0 < size <= MAX_BYTES and memset.height <= 65535:
                _replace(driver, graph, node, memset)
                replaced += 1
    except RuntimeError as exc:
        # Every step of a replacement leaves a graph that computes the same bytes (a fill kernel
        # beside its memset writes what the memset writes), so a failure only stops the conversion.
        logger.warning("stopped replacing memset nodes after %d: %s", replaced, exc)
    return replaced


def count(raw_graph: int) -> int:
    """How many memset nodes ``raw_graph`` holds."""
    driver = _current_driver()
    if driver is None:
        raise RuntimeError("the CUDA driver's graph functions are not available here")
    return len(_memset_nodes(driver, ctypes.c_void_p(raw_graph)))
