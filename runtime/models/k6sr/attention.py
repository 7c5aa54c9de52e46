"""Attention processor for the Kandinsky 6 SR transformer: dense by default, NABLA opt-in.

diffusers' ``Kandinsky6SRAttnProcessor`` runs NABLA sparse attention on the ``flex`` backend.
tilecast serves the dense path by default: this processor computes query/key/value, the per-head
RMS norms and the 3-D rotary embedding exactly as diffusers does, then calls the single
attention entry point ``tilecast.kernels.attention.attention`` (which picks the backend and
applies Ulysses/Ring parallelism); ``sparse_params`` is then ignored.

With ``backend="nabla"`` (``--attention-backend nabla``) it runs NABLA instead,
``tilecast.kernels.nabla.nabla_attention``, on the ``sparse_params`` diffusers' transformer
builds from the checkpoint's ``nabla_window`` / ``nabla_threshold`` (the sliding-tile prior
``sta_mask`` and ``threshold``), under Ulysses too (Ring is refused). Every call adds its kept
blocks to the processor's ``stats`` (``NablaStats``, on the device); ``nabla_density`` reads the
transformer's total, and a DEBUG log line gives each call's density.

Heads are unflattened with the head dimension taken from ``attn.query_norm`` (not
``attn.num_heads``), so a column-sharded (tensor-parallel) projection with fewer local heads
works unchanged.

Shapes: ``x_BSC`` (batch, tokens, channels); ``q_BSHD`` (batch, tokens, heads, head dim);
``rope_S1D22`` (tokens, 1, head dim / 2, 2, 2) rotation matrices.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from diffusers.models.transformers.transformer_kandinsky6_sr import Kandinsky6SRAttention, apply_rotary

from tilecast.kernels.attention import attention
from tilecast.kernels.nabla import NABLA, NablaStats, nabla_attention

logger = logging.getLogger(__name__)


class K6SRDenseAttnProcessor:
    """Drop-in processor for ``Kandinsky6SRAttention``: dense attention, or NABLA with ``backend="nabla"``.

    ``backend`` and ``parallel`` are passed through to ``tilecast.kernels.attention.attention``
    (or ``kernels.nabla.nabla_attention``) on every call; set them as attributes (``None`` lets the
    kernel choose a dense backend).
    """

    def __init__(self, *, backend: str | None = None, parallel: Any = None) -> None:
        self.backend = backend
        """Attention backend name (``None``: the kernel's default)."""
        self.parallel = parallel
        """Sequence-parallel description for Ulysses/Ring (``None``: single rank)."""
        self.stats = NablaStats()
        """Kept and total NABLA blocks of this layer's calls (this rank's heads) since the last reset."""

    def __call__(
        self,
        attn: Kandinsky6SRAttention,
        hidden_states: torch.Tensor,
        rotary_emb: torch.Tensor,
        sparse_params: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        x_BSC = hidden_states
        head_dim = attn.query_norm.normalized_shape[-1]
        q_BSHD = attn.to_query(x_BSC).unflatten(-1, (-1, head_dim))
        k_BSHD = attn.to_key(x_BSC).unflatten(-1, (-1, head_dim))
        v_BSHD = attn.to_value(x_BSC).unflatten(-1, (-1, head_dim))
        q_BSHD = attn.query_norm(q_BSHD.float()).type_as(q_BSHD)
        k_BSHD = attn.key_norm(k_BSHD.float()).type_as(k_BSHD)
        q_BSHD = apply_rotary(q_BSHD, rotary_emb)
        k_BSHD = apply_rotary(k_BSHD, rotary_emb)
        if self.backend == NABLA:
            out_BSHD = self._nabla(q_BSHD, k_BSHD, v_BSHD, sparse_params)
        else:
            out_BSHD, _lse_BHS = attention(q_BSHD, k_BSHD, v_BSHD, backend=self.backend, parallel=self.parallel)
        return attn.out_layer(out_BSHD.flatten(2, 3))

    def _nabla(self, q_BSHD, k_BSHD, v_BSHD, sparse_params: dict[str, Any] | None) -> torch.Tensor:
        if not sparse_params or "sta_mask" not in sparse_params or "threshold" not in sparse_params:
            raise ValueError(
                "--attention-backend nabla needs the transformer's sparse_params (sta_mask, threshold), "
                "which Kandinsky6SRTransformer3DModel.forward passes to every block"
            )
        result = nabla_attention(
            q_BSHD,
            k_BSHD,
            v_BSHD,
            sta_mask=sparse_params["sta_mask"],
            threshold=float(sparse_params["threshold"]),
            parallel=self.parallel,
        )
        self.stats.add(result.kept_blocks, result.total_blocks)
        if logger.isEnabledFor(logging.DEBUG):  # the density is a host sync: only when it is logged
            logger.debug(
                "nabla: kept %d of %d blocks (density %.4f, threshold %s)",
                int(result.kept_blocks),
                result.total_blocks,
                result.density,
                sparse_params["threshold"],
            )
        return result.out_BSHD


def install_dense_attention(transformer: torch.nn.Module, *, backend: str | None = None, parallel: Any = None) -> int:
    """Give every ``Kandinsky6SRAttention`` of ``transformer`` its own ``K6SRDenseAttnProcessor``.

    diffusers' ``set_processor`` accepts processors outside ``_available_processors`` (it only
    assigns the attribute), so the public API is used. Returns the number of layers replaced.
    """
    count = 0
    for module in transformer.modules():
        if isinstance(module, Kandinsky6SRAttention):
            module.set_processor(K6SRDenseAttnProcessor(backend=backend, parallel=parallel))
            count += 1
    if count == 0:
        raise ValueError(f"{type(transformer).__name__} has no Kandinsky6SRAttention layers to replace")
    logger.debug("installed dense attention (backend=%s) on %d layers", backend, count)
    return count


def dense_processors(transformer: torch.nn.Module) -> list[K6SRDenseAttnProcessor]:
    """The installed processors, e.g. to retarget ``backend``/``parallel`` after loading."""
    return [
        module.processor
        for module in transformer.modules()
        if isinstance(module, Kandinsky6SRAttention) and isinstance(module.processor, K6SRDenseAttnProcessor)
    ]


def reset_nabla_stats(transformer: torch.nn.Module) -> None:
    """Zero the NABLA counters of every processor (e.g. at the start of a request)."""
    for processor in dense_processors(transformer):
        processor.stats.reset()


def nabla_density(transformer: torch.nn.Module, groups: Iterable[Any] = ()) -> float | None:
    """Kept / total NABLA blocks over every layer's calls since the last reset, in (0, 1]; ``None``
    when no NABLA call ran. ``groups``: process groups whose ranks hold other heads of the same
    calls (Ulysses, TP); their counts are summed in (every rank of them must call this)."""
    stats = [p.stats for p in dense_processors(transformer) if p.stats.kept is not None]
    if not stats:
        return None
    kept = sum(s.kept for s in stats).to(torch.float64)
    counts = torch.stack([kept, kept.new_tensor(float(sum(s.total for s in stats)))])
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
    return float(counts[0] / counts[1])
