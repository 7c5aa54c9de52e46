"""A captured CUDA graph's memset nodes become fill kernels (``runtime.graph_memsets``; CUDA only).

- memset nodes of each element size (1, 2 and 4 bytes), one- and two-dimensional (rows at a
  pitch), added to a captured graph through the driver: after ``convert`` the graph holds no
  memset node, and its replay writes exactly the bytes the memsets would have (the rest of the
  buffer untouched);
- cuDNN's attention captured as ``--cuda-graphs`` captures it: its memsets are replaced and the
  replay equals the eager call bit for bit.
Without a GPU: the fill kernels' PTX assembles for Hopper (Triton's ``ptxas``, where installed), and
the graph editing runs against a stand-in driver that keeps a graph in Python (the driver's
answers, including its refusal to fill an empty node list): each small memset node, a root one too,
gives way to a fill kernel node with its dependencies, dependents and parameters; a large one stays;
a driver error stops the conversion without losing a node's work.
"""

from __future__ import annotations

import ctypes
import importlib.util
import subprocess
from pathlib import Path

import pytest
import torch


def needs_cuda(test):
    """A ``cuda`` test (CUDA graphs need a GPU)."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")(test))


def _ptxas() -> Path | None:
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return path if path.is_file() else None


@pytest.mark.skipif(_ptxas() is None, reason="needs Triton's ptxas")
def test_the_fill_kernels_assemble_for_hopper(tmp_path):
    from tilecast.runtime.graph_memsets import FILL_PTX

    (tmp_path / "fill.ptx").write_text(FILL_PTX)
    done = subprocess.run(
        [str(_ptxas()), "-arch=sm_90", str(tmp_path / "fill.ptx"), "-o", str(tmp_path / "fill.cubin")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    cubin = (tmp_path / "fill.cubin").read_bytes()
    assert all(f"tilecast_fill_{bits}\0".encode() in cubin for bits in (8, 16, 32))


class _FakeGraphDriver:
    """The driver functions ``graph_memsets`` calls, over a graph of ``nodes``: id -> dict(type,
    deps, memset params or kernel record). Node handles are the ids (from 1)."""

    def __init__(self, fail: str | None = None) -> None:
        self.nodes: dict[int, dict] = {}
        self.fail = fail
        self.made = 0

    def add(self, kind: int, deps=(), memset=None) -> int:
        self.made += 1
        node = self.made
        self.nodes[node] = dict(type=kind, deps=list(deps), memset=memset)
        return node

    def __getattr__(self, name):
        def call(*args):
            if name == self.fail:
                return 999
            return getattr(self, "_" + name)(*args)

        return call

    @staticmethod
    def _fill(array, count_ref, items) -> int:
        if array is not None and count_ref._obj.value == 0:
            return 1  # what the driver answers: CUDA_ERROR_INVALID_VALUE
        if array is None:
            count_ref._obj.value = len(items)
        else:
            for i, item in enumerate(items):
                array[i] = item
        return 0

    def _cuGraphGetNodes(self, graph, array, count_ref):
        return self._fill(array, count_ref, list(self.nodes))

    def _cuGraphNodeGetType(self, node, kind_ref):
        kind_ref._obj.value = self.nodes[node.value]["type"]
        return 0

    def _cuGraphMemsetNodeGetParams(self, node, params_ref):
        ctypes.pointer(params_ref._obj)[0] = self.nodes[node.value]["memset"]
        return 0

    def _cuGraphNodeGetDependencies(self, node, array, count_ref):
        return self._fill(array, count_ref, self.nodes[node.value]["deps"])

    def _cuGraphNodeGetDependentNodes(self, node, array, count_ref):
        return self._fill(array, count_ref, [n for n, v in self.nodes.items() if node.value in v["deps"]])

    def _cuGraphAddKernelNode(self, node_ref, graph, before, count, params_ref):
        params = params_ref._obj
        args = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint, ctypes.c_uint64]
        values = [kind.from_address(params.kernelParams[i]).value for i, kind in enumerate(args)]
        deps = [] if before is None else [before[i] for i in range(count.value)]
        node = self.add(0, deps)
        grid = (params.gridDimX, params.gridDimY, params.blockDimX)
        self.nodes[node]["kernel"] = dict(func=params.func, args=values, grid=grid)
        node_ref._obj.value = node
        return 0

    def _cuGraphAddDependencies(self, graph, sources, targets, count):
        for i in range(count.value):
            self.nodes[targets[i]]["deps"].append(sources[i])
        return 0

    def _cuGraphDestroyNode(self, node):
        del self.nodes[node.value]
        for other in self.nodes.values():
            other["deps"] = [d for d in other["deps"] if d != node.value]
        return 0


def _fake(monkeypatch, fail=None):
    from tilecast.runtime import graph_memsets

    lib = _FakeGraphDriver(fail)
    driver = graph_memsets._Driver.__new__(graph_memsets._Driver)
    driver.lib, driver.fills = lib, {1: 101, 2: 102, 4: 104}
    monkeypatch.setattr(graph_memsets, "_current_driver", lambda: driver)
    memset = graph_memsets._MemsetParams
    root = lib.add(2, memset=memset(dst=4096, pitch=0, value=0, elementSize=4, width=1, height=1))
    first = lib.add(0)
    small = lib.add(2, [first], memset(dst=8192, pitch=1024, value=0xBEEF, elementSize=2, width=300, height=3))
    middle = lib.add(0, [small, root])
    large = lib.add(2, [middle], memset(dst=1 << 20, pitch=0, value=0, elementSize=1, width=4 << 20, height=1))
    lib.add(0, [large])
    return lib, dict(root=root, first=first, small=small, middle=middle, large=large)


def test_memset_nodes_give_way_to_fill_kernels_in_the_graph(monkeypatch):
    from tilecast.runtime import graph_memsets

    lib, n = _fake(monkeypatch)
    assert graph_memsets.convert(1) == 2 and graph_memsets.count(1) == 1  # the 4 MiB memset stays
    kernels = {node: v["kernel"] for node, v in lib.nodes.items() if "kernel" in v}
    assert n["root"] not in lib.nodes and n["small"] not in lib.nodes and n["large"] in lib.nodes
    (root_fill, root_kernel), (small_fill, small_kernel) = sorted(kernels.items())
    assert lib.nodes[root_fill]["deps"] == [] and root_kernel["func"] == 104
    assert root_kernel["args"] == [4096, 0, 0, 1] and root_kernel["grid"] == (1, 1, graph_memsets.THREADS)
    assert lib.nodes[small_fill]["deps"] == [n["first"]] and small_kernel["func"] == 102
    assert small_kernel["args"] == [8192, 1024, 0xBEEF, 300] and small_kernel["grid"][:2] == (2, 3)
    assert sorted(lib.nodes[n["middle"]]["deps"]) == sorted([root_fill, small_fill])


def test_a_driver_error_stops_the_conversion_and_keeps_each_nodes_work(monkeypatch, caplog):
    from tilecast.runtime import graph_memsets

    lib, n = _fake(monkeypatch, fail="cuGraphAddDependencies")
    assert graph_memsets.convert(1) == 0
    assert "stopped replacing memset nodes after 0" in caplog.text
    assert n["root"] in lib.nodes  # the memset still runs; the fill kernel beside it writes the same bytes


def _add_memset(graph: int, dst: int, *, value: int, element_size: int, width: int, height: int, pitch: int):
    from tilecast.runtime import graph_memsets

    driver = graph_memsets._current_driver()
    context, node = ctypes.c_void_p(), ctypes.c_void_p()
    driver.check("cuCtxGetCurrent", ctypes.byref(context))
    params = graph_memsets._MemsetParams(
        dst=dst, pitch=pitch, value=value, elementSize=element_size, width=width, height=height
    )
    driver.check(
        "cuGraphAddMemsetNode",
        ctypes.byref(node),
        ctypes.c_void_p(graph),
        None,
        ctypes.c_size_t(0),
        ctypes.byref(params),
        context,
    )


CASES = [  # element size, value, width (elements), height, pitch (bytes)
    (1, 0xAB, 1000, 1, 1000),
    (2, 0xBEEF, 300, 3, 1024),
    (4, 0xDEADBEEF, 777, 1, 3108),
    (4, 0, 5, 7, 64),
]


@needs_cuda
def test_memset_nodes_become_kernels_that_write_the_same_bytes():
    from tilecast.runtime import graph_memsets

    buffers = [torch.full((8192,), 0x11, dtype=torch.uint8, device="cuda") for _ in CASES]
    other = torch.zeros(16, device="cuda")
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        other.add_(1)
    for buffer, (size, value, width, height, pitch) in zip(buffers, CASES):
        _add_memset(
            graph.raw_cuda_graph(),
            buffer.data_ptr() + 16,
            value=value,
            element_size=size,
            width=width,
            height=height,
            pitch=pitch,
        )
    assert graph_memsets.count(graph.raw_cuda_graph()) == len(CASES)
    assert graph_memsets.convert(graph.raw_cuda_graph()) == len(CASES)
    assert graph_memsets.count(graph.raw_cuda_graph()) == 0
    graph.instantiate()
    graph.replay()
    torch.cuda.synchronize()
    for buffer, (size, value, width, height, pitch) in zip(buffers, CASES):
        want = torch.full((8192,), 0x11, dtype=torch.uint8)
        element = torch.tensor([value], dtype=torch.int64).view(torch.uint8)[:size]  # little-endian bytes
        for row in range(height):
            start = 16 + row * pitch
            want[start : start + width * size] = element.repeat(width)
        assert torch.equal(buffer.cpu(), want), (size, value, width, height, pitch)
    assert torch.equal(other.cpu(), torch.ones(16))


@needs_cuda
def test_cudnn_attention_graph_without_memsets_equals_eager():
    from tilecast.kernels.backends import _sdpa_cudnn
    from tilecast.runtime import graph_memsets

    gen = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 1536, 24, 128, device="cuda", generator=gen).bfloat16() for _ in range(3))
    eager = _sdpa_cudnn(q, k, v, scale=0.09)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        out = _sdpa_cudnn(q, k, v, scale=0.09)
    memsets = graph_memsets.count(graph.raw_cuda_graph())
    print(f"cuDNN attention: {memsets} memset nodes captured")
    assert memsets >= 1  # what this module is for: cuDNN clears part of its workspace each call
    assert graph_memsets.convert(graph.raw_cuda_graph()) == memsets
    graph.instantiate()
    graph.replay()
    assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])
