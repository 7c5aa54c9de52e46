"""Attention backend registry: every backend returns ``(out_BSHD, lse_BHS)`` with an fp32 lse.

Legend: B batch, S query length, K key/value length, H heads, D head dim.

Backends are registered by name (``register_backend``) and selected by name through
``resolve_backend``; ``"auto"`` (or ``None``) picks the fastest available backend for the device
and dtype. All backends see already-unpadded keys: ``run_backend`` drops padded and masked keys
before calling them, so a backend never needs a mask.

Names:
  ``sdpa_math``       pure-torch reference (materializes the B*H*S*K score matrix), any device.
  ``chunked_math``    pure-torch online softmax over query/key blocks (bounded memory), any device.
  ``sdpa_flash_cpu``  PyTorch's CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu``).
  ``sdpa_cudnn`` / ``sdpa_flash`` / ``sdpa_efficient``  PyTorch's CUDA kernels, called through
                      their ``torch.ops.aten`` entry points with the log-sum-exp requested.
  ``fa``              flash-attn (optional dependency, ``pip install "tilecast[flash]"``).
  ``fp8``             per-block scaled FP8 on tensor cores (Triton, ``kernels/fp8_attention.py``):
                      opt-in only, ``auto`` never picks it (the output moves by about a percent).
  ``fp8_cudnn``       cuDNN's FP8 attention, per-tensor scales (``kernels/fp8_cudnn_attention.py``;
                      optional ``nvidia-cudnn-frontend``): opt-in only, the faster FP8 kernel at
                      head dim 128.
``nabla`` (Kandinsky 6 SR's block-sparse attention, ``kernels/nabla.py``) is a name the capability
table knows but not a registered kernel: it needs the model's mask, so only K6 SR's processor runs
it, and ``resolve_backend("nabla")`` says so.
Aliases (the reference picker's ids): ``torch_sdpa`` → best available ``sdpa_*`` for the device;
``flash_attn`` → ``fa``.
"""

from __future__ import annotations

import importlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import capabilities as caps
from . import fp8_attention, fp8_cudnn_attention

logger = logging.getLogger(__name__)

FLASH_INSTALL_HINT = 'pip install "tilecast[flash]"'

BackendFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""``fn(q_BSHD, k_BKHD, v_BKHD, *, scale) -> (out_BSHD, lse_BHS)``; K >= 1."""


class BackendUnavailableError(ValueError):
    """A backend was named that cannot run here (wrong device or dtype, or a missing package)."""


@dataclass(frozen=True, kw_only=True)
class AttentionBackend:
    """One registered attention implementation."""

    name: str
    """Registry name, used by ``attention(backend=...)`` and ``--attention-backend``."""
    fn: BackendFn
    """The kernel: ``fn(q_BSHD, k_BKHD, v_BKHD, *, scale) -> (out_BSHD, lse_BHS)``."""
    devices: frozenset[str]
    """Device types it runs on (``"cpu"``, ``"cuda"``)."""
    dtypes: frozenset[torch.dtype] | None = None
    """Input dtypes it accepts; ``None`` means any floating dtype."""
    check: Callable[[], str | None] | None = None
    """Optional runtime probe returning why the backend cannot run (``None`` when it can)."""
    returns_lse: bool = True
    """``fn`` returns the log-sum-exp (Ring attention needs it; see ``kernels/capabilities.py``)."""

    @property
    def traits(self) -> caps.BackendTraits:
        """Its capabilities as the torch-free rule set sees them."""
        return caps.BackendTraits(name=self.name, devices=self.devices, returns_lse=self.returns_lse)

    def unavailable_reason(self, device: torch.device | str, dtype: torch.dtype | None = None) -> str | None:
        """Why this backend cannot run on ``device``/``dtype``, or ``None`` if it can."""
        # The probe goes first so a missing optional package is named even on the wrong device.
        if self.check is not None and (reason := self.check()) is not None:
            return reason
        device_type = torch.device(device).type
        if device_type not in self.devices:
            return f"backend {self.name!r} runs on {sorted(self.devices)}, not on {device_type!r}"
        if dtype is not None and self.dtypes is not None and dtype not in self.dtypes:
            names = sorted(str(d).removeprefix("torch.") for d in self.dtypes)
            return f"backend {self.name!r} needs dtype in {names}, got {dtype}"
        return None


_REGISTRY: dict[str, AttentionBackend] = {}
# The selectors' preference orders and the aliases are capability data (kernels/capabilities.py).


def register_backend(backend: AttentionBackend, *, replace: bool = False) -> None:
    """Add ``backend`` to the registry (``replace=True`` to override an existing name); its traits
    go to ``kernels/capabilities.py``, where the topology rules read them."""
    if backend.name in _REGISTRY and not replace:
        raise ValueError(f"attention backend {backend.name!r} is already registered")
    caps.declare(backend.traits, replace=replace)
    _REGISTRY[backend.name] = backend


def backend_names() -> list[str]:
    """Every accepted name: registered backends, ``"auto"``, ``"torch_sdpa"`` and the aliases."""
    return caps.backend_names()


def available_backends(device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> list[str]:
    """Registered backends that can run on ``device`` (and ``dtype`` when given), sorted by name."""
    return sorted(n for n, b in _REGISTRY.items() if b.unavailable_reason(device, dtype) is None)


def resolve_backend(name: str | None, device: torch.device | str, dtype: torch.dtype | None = None) -> AttentionBackend:
    """Map a user-facing name to a runnable backend.

    ``None``/``"auto"`` picks the first available of the device's preference list; ``"torch_sdpa"``
    the first available ``sdpa_*`` kernel. Unknown names raise ``ValueError`` listing the valid
    ones; known but unusable ones raise ``BackendUnavailableError`` saying why.
    """
    device_type = torch.device(device).type
    key = "auto" if name is None else caps.ALIASES.get(name, name)
    if key in caps.SELECTORS:
        order = caps.candidates(key, device_type)
        reasons = []
        for candidate in order:
            reason = _REGISTRY[candidate].unavailable_reason(device, dtype)
            if reason is None:
                return _REGISTRY[candidate]
            reasons.append(reason)
        raise BackendUnavailableError(f"no {key!r} attention backend can run here: {'; '.join(reasons)}")
    backend = _REGISTRY.get(key)
    if backend is None and caps.model_attention(key) is not None:
        raise ValueError(caps.model_attention_message(key))  # e.g. nabla: its model's processor runs it
    if backend is None:
        raise ValueError(caps.unknown_backend_message(name))
    reason = backend.unavailable_reason(device, dtype)
    if reason is not None:
        raise BackendUnavailableError(f"attention backend {name!r} cannot run here: {reason}")
    return backend


# ---------------------------------------------------------------------------------------------
# Pure-torch backends (any device).


def _math(q_BSHD: torch.Tensor, k_BKHD: torch.Tensor, v_BKHD: torch.Tensor, *, scale: float):
    q_BHSD, k_BHKD, v_BHKD = (t.transpose(1, 2).float() for t in (q_BSHD, k_BKHD, v_BKHD))
    scores_BHSK = torch.matmul(q_BHSD, k_BHKD.transpose(-1, -2)) * scale
    lse_BHS = torch.logsumexp(scores_BHSK, dim=-1)
    out_BHSD = torch.matmul(torch.exp(scores_BHSK - lse_BHS.unsqueeze(-1)), v_BHKD)
    return out_BHSD.transpose(1, 2).to(q_BSHD.dtype), lse_BHS


CHUNK_Q = 1024
"""Query rows per block of ``chunked_math``."""
CHUNK_K = 1024
"""Key rows per block of ``chunked_math``."""


def _chunked_math(q_BSHD: torch.Tensor, k_BKHD: torch.Tensor, v_BKHD: torch.Tensor, *, scale: float):
    """Online softmax (flash-attention recurrence) in fp32; peak extra memory O(B*H*CHUNK_Q*CHUNK_K)."""
    q_BHSD, k_BHKD, v_BHKD = (t.transpose(1, 2) for t in (q_BSHD, k_BKHD, v_BKHD))
    num_q, num_k = q_BHSD.shape[2], k_BHKD.shape[2]
    outs, lses = [], []
    for q0 in range(0, num_q, CHUNK_Q):
        qc = q_BHSD[:, :, q0 : q0 + CHUNK_Q].float() * scale
        acc = torch.zeros(*qc.shape[:-1], v_BHKD.shape[-1], dtype=torch.float32, device=qc.device)
        row_max = torch.full(qc.shape[:-1], -math.inf, dtype=torch.float32, device=qc.device)
        row_sum = torch.zeros_like(row_max)
        for k0 in range(0, num_k, CHUNK_K):
            kc = k_BHKD[:, :, k0 : k0 + CHUNK_K].float()
            vc = v_BHKD[:, :, k0 : k0 + CHUNK_K].float()
            scores = torch.matmul(qc, kc.transpose(-1, -2))
            new_max = torch.maximum(row_max, scores.amax(dim=-1))
            correction = torch.exp(row_max - new_max)
            probs = torch.exp(scores - new_max.unsqueeze(-1))
            row_sum = row_sum * correction + probs.sum(dim=-1)
            acc = acc * correction.unsqueeze(-1) + torch.matmul(probs, vc)
            row_max = new_max
        outs.append(acc / row_sum.unsqueeze(-1))
        lses.append(row_max + torch.log(row_sum))
    out_BHSD = torch.cat(outs, dim=2)
    return out_BHSD.transpose(1, 2).to(q_BSHD.dtype), torch.cat(lses, dim=2)


# ---------------------------------------------------------------------------------------------
# PyTorch fused kernels. They take BHSD; lse comes back as (B, H, S[, 1]) or padded on S.


def _lse_BHS(lse: torch.Tensor, num_q: int) -> torch.Tensor:
    if lse.dim() == 4:  # cuDNN returns (B, H, S, 1) on some versions
        lse = lse.squeeze(-1)
    return lse[..., :num_q].float()  # the efficient kernel pads S to a multiple of 32


def _sdpa_flash_cpu(q_BSHD, k_BKHD, v_BKHD, *, scale: float):
    q, k, v = (t.transpose(1, 2) for t in (q_BSHD, k_BKHD, v_BKHD))
    out_BHSD, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)
    return out_BHSD.transpose(1, 2), _lse_BHS(lse, q.shape[2])


def _sdpa_flash(q_BSHD, k_BKHD, v_BKHD, *, scale: float):
    q, k, v = (t.transpose(1, 2) for t in (q_BSHD, k_BKHD, v_BKHD))
    result = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
    return result[0].transpose(1, 2), _lse_BHS(result[1], q.shape[2])


def _sdpa_efficient(q_BSHD, k_BKHD, v_BKHD, *, scale: float):
    q, k, v = (t.transpose(1, 2) for t in (q_BSHD, k_BKHD, v_BKHD))
    result = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False, scale=scale)
    return result[0].transpose(1, 2), _lse_BHS(result[1], q.shape[2])


def _sdpa_cudnn(q_BSHD, k_BKHD, v_BKHD, *, scale: float):
    q, k, v = (t.transpose(1, 2) for t in (q_BSHD, k_BKHD, v_BKHD))
    result = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False, scale=scale)
    return result[0].transpose(1, 2), _lse_BHS(result[1], q.shape[2])


def _op_check(op_name: str) -> Callable[[], str | None]:
    def check() -> str | None:
        if not torch.cuda.is_available():
            return f"{op_name} needs CUDA, which is not available"
        if not hasattr(torch.ops.aten, op_name):
            return f"this PyTorch ({torch.__version__}) has no aten.{op_name}"
        return None

    return check


def _cpu_flash_check() -> str | None:
    if not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return f"this PyTorch ({torch.__version__}) has no CPU flash attention kernel"
    return None


# ---------------------------------------------------------------------------------------------
# flash-attn (optional import).


def _import_flash_attn():
    return importlib.import_module("flash_attn")


def _fa_check() -> str | None:
    try:
        _import_flash_attn()
    except ImportError as exc:
        return f"backend 'fa' needs the flash-attn package, which failed to import ({exc}); install it with {FLASH_INSTALL_HINT}"
    return None


def _fa(q_BSHD, k_BKHD, v_BKHD, *, scale: float):
    flash_attn = _import_flash_attn()
    out_BSHD, lse_BHS, _ = flash_attn.flash_attn_func(
        q_BSHD, k_BKHD, v_BKHD, softmax_scale=scale, causal=False, return_attn_probs=True
    )
    return out_BSHD, _lse_BHS(lse_BHS, q_BSHD.shape[1])


_HALF = frozenset({torch.float16, torch.bfloat16})
_CUDA_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32})


_CPU_FLOATS = frozenset({torch.float32, torch.float64, torch.bfloat16, torch.float16})


def _backend(name: str, fn: BackendFn, **facts) -> AttentionBackend:
    """``name``'s backend, on the devices the capability table gives it (``kernels/capabilities.py``)."""
    return AttentionBackend(name=name, fn=fn, devices=caps.traits(name).devices, **facts)


def _aten_backend(name: str, fn: BackendFn, op_name: str, dtypes: frozenset[torch.dtype]) -> AttentionBackend:
    """A PyTorch fused CUDA kernel, ``aten.<op_name>``: available where CUDA and the op are."""
    return _backend(name, fn, dtypes=dtypes, check=_op_check(op_name))


for _registered in (
    _backend("sdpa_math", _math),
    _backend("chunked_math", _chunked_math),
    _backend("sdpa_flash_cpu", _sdpa_flash_cpu, dtypes=_CPU_FLOATS, check=_cpu_flash_check),
    _aten_backend("sdpa_cudnn", _sdpa_cudnn, "_scaled_dot_product_cudnn_attention", _HALF),
    _aten_backend("sdpa_flash", _sdpa_flash, "_scaled_dot_product_flash_attention", _HALF),
    _aten_backend("sdpa_efficient", _sdpa_efficient, "_scaled_dot_product_efficient_attention", _CUDA_FLOATS),
    _backend("fa", _fa, dtypes=_HALF, check=_fa_check),
    _backend("fp8", fp8_attention.fp8_attention, dtypes=_HALF, check=fp8_attention.unavailable_reason),
    _backend(
        "fp8_cudnn",
        fp8_cudnn_attention.fp8_cudnn_attention,
        dtypes=_HALF,
        check=fp8_cudnn_attention.unavailable_reason,
    ),
):
    register_backend(_registered)


def run_backend(
    backend: AttentionBackend,
    q_BSHD: torch.Tensor,
    k_BKHD: torch.Tensor,
    v_BKHD: torch.Tensor,
    *,
    scale: float,
    kv_len: int | None = None,
    key_mask_BK: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``backend`` on the first ``kv_len`` keys (the rest are padding and get zero weight).

    With ``kv_len == 0`` no key is valid: the output is zero and the lse ``-inf``, which the Ring
    merge treats as an empty partial result. ``key_mask_BK`` (bool, ``True`` = attend) further
    selects keys per batch row: the backend runs on the selected keys only (one call when every
    row selects the same keys, else one call per row), so no backend needs a mask and the lse is
    that of the selected keys.
    """
    num_keys = k_BKHD.shape[1]
    if key_mask_BK is not None and key_mask_BK.shape != (k_BKHD.shape[0], num_keys):
        raise ValueError(f"key_mask_BK has shape {tuple(key_mask_BK.shape)}; keys are {tuple(k_BKHD.shape[:2])}")
    if kv_len is not None and kv_len < num_keys:
        if kv_len <= 0:
            return _empty_result(q_BSHD, v_BKHD)
        k_BKHD, v_BKHD = k_BKHD[:, :kv_len], v_BKHD[:, :kv_len]
        key_mask_BK = None if key_mask_BK is None else key_mask_BK[:, :kv_len]
    if key_mask_BK is None:
        return backend.fn(q_BSHD, k_BKHD, v_BKHD, scale=scale)
    key_mask_BK = key_mask_BK.to(torch.bool)
    if bool((key_mask_BK == key_mask_BK[:1]).all()):
        return _run_selected(backend, q_BSHD, k_BKHD, v_BKHD, key_mask_BK[0], scale)
    parts = [
        _run_selected(backend, q_BSHD[b : b + 1], k_BKHD[b : b + 1], v_BKHD[b : b + 1], key_mask_BK[b], scale)
        for b in range(q_BSHD.shape[0])
    ]
    return torch.cat([out for out, _ in parts], dim=0), torch.cat([lse for _, lse in parts], dim=0)


def _empty_result(q_BSHD: torch.Tensor, v_BKHD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over no key: zero output, ``-inf`` lse."""
    batch, num_q, heads, _ = q_BSHD.shape
    out = q_BSHD.new_zeros(batch, num_q, heads, v_BKHD.shape[-1])
    lse = torch.full((batch, heads, num_q), -math.inf, dtype=torch.float32, device=q_BSHD.device)
    return out, lse


def _run_selected(backend, q_BSHD, k_BKHD, v_BKHD, keep_K: torch.Tensor, scale: float):
    """``backend`` on the keys where ``keep_K`` is ``True`` (a slice when they are a prefix)."""
    num_kept = int(keep_K.sum())
    if num_kept == 0:
        return _empty_result(q_BSHD, v_BKHD)
    if num_kept == keep_K.shape[0]:
        return backend.fn(q_BSHD, k_BKHD, v_BKHD, scale=scale)
    if bool(keep_K[:num_kept].all()):
        return backend.fn(q_BSHD, k_BKHD[:, :num_kept], v_BKHD[:, :num_kept], scale=scale)
    index = keep_K.nonzero().squeeze(1)
    return backend.fn(q_BSHD, k_BKHD.index_select(1, index), v_BKHD.index_select(1, index), scale=scale)
