"""cuDNN's own FP8 attention, as a peer for ``tilecast bench attention --backend cudnn_fp8``.

Not a serving backend: it answers "how fast is NVIDIA's FP8 kernel at this shape", next to
tilecast's ``fp8`` and the bf16 backends, in the same run. It needs the optional
``nvidia-cudnn-frontend`` package (the graph API in Python; the cuDNN library is PyTorch's own)
and a Hopper GPU.

Recipe: e4m3 ``Q``, ``K``, ``V`` with one scale per tensor (what cuDNN's FP8 forward takes), the
softmax probabilities scaled by 448 into e4m3 for the P·V product, and the output in e4m3 too
(Hopper's FP8 forward writes no bf16) at ``V``'s scale (an output row is a convex combination of
``V``'s rows, so ``|O| <= max|V|``), dequantized to bf16. The log-sum-exp comes back in float32
(natural log, as every backend's). The timed call includes the quantization, as ``fp8``'s does
(compiled by Inductor: a reduction and one fused cast per tensor).
"""

from __future__ import annotations

import functools
import math

import torch

E4M3_MAX = 448.0
INSTALL_HINT = "the cudnn_fp8 peer needs the nvidia-cudnn-frontend package (pip install 'tilecast[cudnn-peer]' or nvidia-cudnn-frontend)"


def _cudnn():
    try:
        import cudnn
    except ImportError as exc:
        raise ValueError(INSTALL_HINT) from exc
    return cudnn


def _quantize(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t8, descale)``: ``t`` in e4m3 with one scale for the tensor (``t ~ t8 * descale``)."""
    descale = (t.abs().amax().float() / E4M3_MAX).clamp_min(1e-30)
    return (t.float() / descale).to(torch.float8_e4m3fn), descale.reshape(1, 1, 1, 1)


def _dequantize(t8: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t8 * descale`` in ``dtype``."""
    return (t8.float() * descale.reshape(())).to(dtype)


@functools.cache
def _compiled():
    """``_quantize`` and ``_dequantize`` compiled: each one reduction and one fused cast, as the
    ``fp8`` backend's Triton quantization is (in eager PyTorch a call took 1.4 ms longer: an H100,
    head dim 64, 47,616 tokens)."""
    return torch.compile(_quantize, dynamic=False), torch.compile(_dequantize, dynamic=False)


class CudnnFp8Attention:
    """``fn(q_BSHD, k_BKHD, v_BKHD) -> (out_BSHD in bf16, lse_BHS)``; one cuDNN graph per shape."""

    def __init__(self) -> None:
        self.cudnn = _cudnn()  # a missing package is named before any GPU work
        self._handle = None
        self._graphs: dict[tuple, tuple] = {}

    def _graph(self, shape: tuple[int, int, int, int], device: torch.device):
        if shape in self._graphs:
            return self._graphs[shape]
        cudnn = self.cudnn
        if self._handle is None:
            self._handle = cudnn.create_handle()
        batch, seq, heads, dim = shape
        e4m3, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        graph = cudnn.pygraph(
            io_data_type=e4m3, intermediate_data_type=fp32, compute_data_type=fp32, handle=self._handle
        )
        dims, strides = (batch, heads, seq, dim), (seq * heads * dim, dim, heads * dim, 1)  # BSHD memory
        q, k, v = (graph.tensor(name=n, dim=dims, stride=strides, data_type=e4m3) for n in "qkv")
        scalar = {"dim": (1, 1, 1, 1), "stride": (1, 1, 1, 1), "data_type": fp32}
        names = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
        scales = {name: graph.tensor(name=name, **scalar) for name in names}
        out, lse, amax_s, amax_o = graph.sdpa_fp8(
            q=q,
            k=k,
            v=v,
            **scales,
            is_inference=False,  # False: the graph writes the softmax statistics (the log-sum-exp)
            attn_scale=1.0 / math.sqrt(dim),
            use_causal_mask=False,
            name="sdpa_fp8",
        )
        out.set_output(True).set_dim(dims).set_stride(strides).set_data_type(e4m3)
        lse.set_output(True).set_dim((batch, heads, seq, 1)).set_stride((heads * seq, seq, 1, 1)).set_data_type(fp32)
        for amax in (amax_s, amax_o):
            amax.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(fp32)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        workspace = torch.empty(graph.get_workspace_size(), device=device, dtype=torch.uint8)
        self._graphs[shape] = graph, (q, k, v, out, lse, amax_s, amax_o), scales, workspace
        return self._graphs[shape]

    def __call__(self, q_BSHD: torch.Tensor, k_BKHD: torch.Tensor, v_BKHD: torch.Tensor):
        if q_BSHD.shape != k_BKHD.shape or q_BSHD.shape != v_BKHD.shape:
            raise ValueError(
                f"cudnn_fp8 times self-attention: q, k, v of one shape, got {q_BSHD.shape}, {k_BKHD.shape}"
            )
        graph, (q, k, v, out, lse, amax_s, amax_o), scales, workspace = self._graph(tuple(q_BSHD.shape), q_BSHD.device)
        self.cudnn.set_stream(handle=self._handle, stream=torch.cuda.current_stream(q_BSHD.device).cuda_stream)
        quantize, dequantize = _compiled()
        (q8, descale_q), (k8, descale_k), (v8, descale_v) = (quantize(t) for t in (q_BSHD, k_BKHD, v_BKHD))
        one = torch.ones(1, 1, 1, 1, device=q_BSHD.device)
        scale_o = 1 / descale_v  # |O| <= max|V|: O's scale is V's
        values = [descale_q, descale_k, descale_v, one / E4M3_MAX, one * E4M3_MAX, scale_o]
        out8 = torch.empty(q_BSHD.shape, device=q_BSHD.device, dtype=torch.float8_e4m3fn)
        batch, seq, heads, _ = q_BSHD.shape
        lse_BHS1 = torch.empty(batch, heads, seq, 1, device=q_BSHD.device, dtype=torch.float32)
        amax_buffers = [torch.empty(1, 1, 1, 1, device=q_BSHD.device) for _ in range(2)]
        pack = {q: q8, k: k8, v: v8, out: out8, lse: lse_BHS1, amax_s: amax_buffers[0], amax_o: amax_buffers[1]}
        pack.update({tensor: value for tensor, value in zip(scales.values(), values)})
        graph.execute(pack, workspace, handle=self._handle)
        return dequantize(out8, descale_v, q_BSHD.dtype), lse_BHS1.squeeze(-1)
