"""cuDNN's FP8 attention with the log-sum-exp (``--attention-backend fp8_cudnn``; opt-in).

Where it pays: head dim 128 (FLUX, Qwen-Image, Wan), where an H100 ran it at 1.44-1.47x cuDNN's
bf16 attention (47,616 tokens; 1.25x at 13,824) and tilecast's Triton ``fp8`` at 0.89x; at head dim 64
(Kandinsky 6 SR) both FP8 kernels are about 1.1x and ``fp8`` is 4 dB closer to bf16 (README,
Performance). ``auto`` never picks it. Needs the optional ``nvidia-cudnn-frontend`` package (the
cuDNN graph API in Python; the cuDNN library is PyTorch's own) and a Hopper or newer GPU.

Recipe: ``Q``, ``K``, ``V`` in e4m3 with one scale per tensor (what cuDNN's FP8 forward takes),
the softmax probabilities scaled by 448 into e4m3 for the P·V product, and the output in e4m3 as
well (Hopper's FP8 forward writes no bf16) at ``V``'s scale (an output row is a convex combination
of ``V``'s rows, so ``|O| <= max|V|``), dequantized to the inputs' dtype. The log-sum-exp comes back
in float32, natural log, as every backend's, so Ring merges its chunks. The quantization runs
compiled by Inductor (one reduction and one fused cast per tensor; in eager PyTorch a call took
1.4 ms longer at 47,616 tokens). Per-tensor scales make the error larger than ``fp8``'s per-block
ones: about 6% of the output (relative, Frobenius) on random inputs against 4%
(``tests/test_fp8_attention.py``).

Under ``torch.compile`` the call is one opaque custom op (``tilecast::fp8_cudnn_attention``). One
cuDNN graph is built per query shape, key count, scale and device, on first use (32 are kept).

Shapes: ``q_BSHD`` / ``k_BKHD`` / ``v_BKHD`` as every backend (``kernels/backends.py``).
"""

from __future__ import annotations

import functools

import torch

from .opaque_attention import opaque_attention

E4M3_MAX = 448.0
MIN_CUDA_CAPABILITY = (9, 0)
"""cuDNN's FP8 attention forward: Hopper or newer."""
INSTALL_HINT = "pip install 'tilecast[fp8-cudnn]' (or nvidia-cudnn-frontend)"


def _import_cudnn():
    import cudnn

    return cudnn


def unavailable_reason() -> str | None:
    """Why cuDNN's FP8 attention cannot run here, or ``None`` when it can."""
    try:
        _import_cudnn()
    except ImportError as exc:
        return f"backend 'fp8_cudnn' needs the nvidia-cudnn-frontend package, which failed to import ({exc}); {INSTALL_HINT}"
    if not torch.cuda.is_available():
        return "backend 'fp8_cudnn' needs a CUDA GPU, which is not available"
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CUDA_CAPABILITY:
        return f"backend 'fp8_cudnn' needs cuDNN's FP8 attention (compute capability 9.0 or newer), this GPU has {capability}"
    return None


def _descale(t: torch.Tensor) -> torch.Tensor:
    """``t``'s e4m3 scale, ``max|t| / 448`` in float32, shaped ``(1, 1, 1, 1)`` for the graph, by
    PyTorch's own reduction: on an H100, at 47,616 tokens of 1,792 bf16 channels, this (0.11 ms) and
    the compiled cast (0.25 ms) took 0.36 ms a tensor where the maximum compiled together with the
    cast (for dynamic shapes) took 0.46-0.53 ms."""
    amax = torch.linalg.vector_norm(t, float("inf")).float()  # exact in t's dtype: no float32 copy of t
    return (amax / E4M3_MAX).clamp_min(1e-30).reshape(1, 1, 1, 1)


def _quantize(t: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """``t / descale`` in e4m3 (``t ~ t8 * descale``)."""
    return (t.float() / descale.reshape(())).to(torch.float8_e4m3fn)


def _dequantize(t8: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t8 * descale`` in ``dtype``."""
    return (t8.float() * descale.reshape(())).to(dtype)


@functools.cache
def _compiled():
    """``_quantize`` and ``_dequantize`` compiled (each one fused cast), for every shape at once:
    compiled per shape, a server of many shapes (and Ring's chunks) reached Dynamo's recompile limit
    (8) and fell back to eager."""
    return torch.compile(_quantize, dynamic=True), torch.compile(_dequantize, dynamic=True)


@functools.cache
def _handle(device_index: int):
    return _import_cudnn().create_handle()


@functools.lru_cache(maxsize=32)  # a graph (and its workspace) per shape: bounded for servers of many shapes
def _graph(shape_q: tuple[int, ...], num_k: int, scale: float, device_index: int):
    """``(graph, (q, k, v, out, lse), per-call scales, fixed, workspace)`` for queries of ``shape_q``
    (BSHD) and ``num_k`` keys: the per-call scales are ``(descale_q, descale_k, descale_v, scale_o)``'s
    graph tensors; ``fixed`` binds the rest once (the softmax's e4m3 scale, and the two amaxes the
    graph writes and nothing reads)."""
    cudnn = _import_cudnn()
    batch, num_q, heads, dim = shape_q
    e4m3, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(
        io_data_type=e4m3, intermediate_data_type=fp32, compute_data_type=fp32, handle=_handle(device_index)
    )

    def bshd(name: str, length: int):  # BSHD memory, described as cuDNN's (B, H, S, D)
        dims, strides = (batch, heads, length, dim), (length * heads * dim, dim, heads * dim, 1)
        return graph.tensor(name=name, dim=dims, stride=strides, data_type=e4m3), dims, strides

    q, q_dims, q_strides = bshd("q", num_q)
    k, _, _ = bshd("k", num_k)
    v, _, _ = bshd("v", num_k)
    scalar = {"dim": (1, 1, 1, 1), "stride": (1, 1, 1, 1), "data_type": fp32}
    names = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
    scales = [graph.tensor(name=name, **scalar) for name in names]
    out, lse, amax_s, amax_o = graph.sdpa_fp8(
        q=q,
        k=k,
        v=v,
        **dict(zip(names, scales)),
        is_inference=False,  # False: the graph writes the softmax statistics (the log-sum-exp)
        attn_scale=scale,
        use_causal_mask=False,
        name="sdpa_fp8",
    )
    out.set_output(True).set_dim(q_dims).set_stride(q_strides).set_data_type(e4m3)
    lse.set_output(True).set_dim((batch, heads, num_q, 1)).set_stride((heads * num_q, num_q, 1, 1))
    lse.set_data_type(fp32)
    for amax in (amax_s, amax_o):
        amax.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(fp32)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    device = torch.device("cuda", device_index)
    workspace = torch.empty(graph.get_workspace_size(), device=device, dtype=torch.uint8)
    descale_q, descale_k, descale_v, descale_s, scale_s, scale_o = scales
    fixed = {
        tensor: torch.full((1, 1, 1, 1), value, device=device)
        for tensor, value in ((descale_s, 1 / E4M3_MAX), (scale_s, E4M3_MAX), (amax_s, 0.0), (amax_o, 0.0))
    }
    return graph, (q, k, v, out, lse), (descale_q, descale_k, descale_v, scale_o), fixed, workspace


def run(
    q_BSHD: torch.Tensor, k_BKHD: torch.Tensor, v_BKHD: torch.Tensor, *, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out_BSHD, lse_BHS)``: quantize, run the cuDNN graph, dequantize (see the module doc); ``out``
    in ``q``'s dtype, ``lse`` float32 in natural-log units."""
    batch, num_q, heads, dim = q_BSHD.shape
    if k_BKHD.shape != v_BKHD.shape or k_BKHD.shape[::2] != (batch, heads) or k_BKHD.shape[-1] != dim:
        raise ValueError(
            f"fp8_cudnn needs K and V of Q's batch, heads and head dim; got q {tuple(q_BSHD.shape)}, "
            f"k {tuple(k_BKHD.shape)}, v {tuple(v_BKHD.shape)}"
        )
    if dim % 16:
        raise ValueError(f"fp8_cudnn needs a head dim that is a multiple of 16, got {dim}")
    device = q_BSHD.device
    index = device.index if device.index is not None else torch.cuda.current_device()
    graph, (q, k, v, out, lse), scales, fixed, workspace = _graph(
        tuple(q_BSHD.shape), k_BKHD.shape[1], float(scale), index
    )
    handle = _handle(index)
    _import_cudnn().set_stream(handle=handle, stream=torch.cuda.current_stream(device).cuda_stream)
    quantize, dequantize = _compiled()
    inputs = (q_BSHD, k_BKHD, v_BKHD)
    descale_q, descale_k, descale_v = descales = [_descale(t) for t in inputs]
    q8, k8, v8 = (quantize(t, d).contiguous() for t, d in zip(inputs, descales))  # the graph reads dense BSHD
    out8 = torch.empty(q_BSHD.shape, device=device, dtype=torch.float8_e4m3fn)
    lse_BHS1 = torch.empty(batch, heads, num_q, 1, device=device, dtype=torch.float32)
    pack = {q: q8, k: k8, v: v8, out: out8, lse: lse_BHS1, **fixed}
    pack.update(zip(scales, (descale_q, descale_k, descale_v, 1 / descale_v)))  # O at V's scale
    graph.execute(pack, workspace, handle=handle)
    return dequantize(out8, descale_v, q_BSHD.dtype), lse_BHS1.squeeze(-1)


fp8_cudnn_attention = opaque_attention("fp8_cudnn_attention", run)
"""``(out_BSHD, lse_BHS)`` as every backend, as one custom op (``run``'s computation)."""
