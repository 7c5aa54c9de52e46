"""NABLA block-sparse attention (Kandinsky 6 SR's released attention) on PyTorch's flex attention.

Legend: B batch, S tokens (the full sequence after any Ulysses exchange), H heads (this rank's),
D head dim, N = S / 64 token blocks. q/k/v ``BSHD``; out ``BSHD``; lse ``BHS`` fp32, natural log
of the scaled scores, as every backend of ``kernels/backends.py`` returns it.

The mask is diffusers' own: ``nabla_block_mask`` (block means of q and k, a softmax over the block
map, the smallest set of key blocks per query block whose mass reaches ``threshold``, OR the static
sliding-tile prior ``sta_mask`` built by ``sliding_tile_mask``) is imported and called, never
re-implemented. Tokens arrive in diffusers' fractal order (every 64-token block is an 8x8 spatial
patch of one frame; ``Kandinsky6SRTransformer3DModel.forward`` does the reordering and refuses grids
that are not multiples of 8), so ``S`` is always a multiple of 64 here.

How the mask runs:

- CUDA: ``torch.compile(flex_attention)`` with ``kernel_options={"BLOCK_M": 64, "BLOCK_N": 64}``
  (inside ``--compile``'s compiled blocks, the enclosing compile takes the same call).
  The mask's sparsity granularity is 64 tokens, and inductor's flex template refuses a tile that
  does not divide it ("Q and KV block size must be divisible by BLOCK_M and BLOCK_N"), which is what
  the default 128-token tiles hit on Hopper. The kept blocks are all "full" blocks (no mask_mod is
  evaluated), so skipped blocks cost nothing.
- Anywhere else (CPU): eager flex. PyTorch's eager flex ignores a ``BlockMask``'s block lists and
  applies only its ``mask_mod`` (diffusers' mask has none, so diffusers' uncompiled NABLA is plain
  dense attention). tilecast therefore rebuilds the same block lists with a ``mask_mod`` that reads
  the block map, so the eager result is the block-sparse one the compiled kernel computes.

Sequence parallelism: under Ulysses each rank holds every token of a subset of heads after the
all-to-all, and NABLA's mask is per (batch, head), so the mask is built from the local heads there
and the result equals one rank's. Ring attention is refused: a rank would see only a K/V chunk, but
the block selection needs every key block of a query block at once (``RING_REFUSAL``). TP splits
heads too and composes the same way (nothing to do here: the processor passes the local heads).

``nabla_attention`` also returns how many of the ``B * H * N * N`` blocks it kept; ``NablaStats``
accumulates that on the device (no host sync per call) for ``--attention-backend nabla`` reports.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import warnings

import torch

from .capabilities import NABLA_RING_REFUSAL
from .collectives import AttentionParallel
from .ulysses import check_heads, ulysses_attention

logger = logging.getLogger(__name__)

NABLA = "nabla"
"""The ``--attention-backend`` name."""
NABLA_BLOCK = 64
"""Tokens per NABLA block (diffusers: an 8x8 patch, ``FRACTAL_BLOCK_SIZE ** 2``)."""
RING_REFUSAL = NABLA_RING_REFUSAL
"""Why Ring cannot run NABLA (``kernels/capabilities.py`` and the K6 SR loader refuse with it)."""


@dataclasses.dataclass
class NablaStats:
    """Kept and total NABLA blocks since the last ``reset``, summed on the device."""

    kept: torch.Tensor | None = None
    total: int = 0
    calls: int = 0

    def add(self, kept: torch.Tensor, total: int) -> None:
        self.kept = kept if self.kept is None else self.kept + kept
        self.total += total
        self.calls += 1

    def reset(self) -> None:
        self.kept, self.total, self.calls = None, 0, 0

    def density(self) -> float | None:
        """Kept blocks / all blocks in (0, 1] (one host sync), ``None`` before any call."""
        return None if self.kept is None or self.total == 0 else float(self.kept) / self.total


@dataclasses.dataclass(frozen=True)
class NablaResult:
    """One ``nabla_attention`` call: the attention result and the blocks it kept (this rank's heads)."""

    out_BSHD: torch.Tensor
    lse_BHS: torch.Tensor
    kept_blocks: torch.Tensor
    """Kept (query block, key block) pairs summed over batch and heads: a 0-d int64 device tensor."""
    total_blocks: int
    """``B * H * N * N`` over this rank's heads."""

    @property
    def density(self) -> float:
        """Kept / total blocks (a host sync)."""
        return float(self.kept_blocks) / self.total_blocks


def nabla_block_mask(q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, sta_NN: torch.Tensor, threshold: float):
    """diffusers' NABLA ``BlockMask`` (``transformer_kandinsky6_sr.nabla_block_mask``, looked up per
    call so a patched diffusers is honoured)."""
    from diffusers.models.transformers import transformer_kandinsky6_sr as k6sr

    return k6sr.nabla_block_mask(q_BHSD, k_BHSD, sta_NN, thr=threshold, block_size=NABLA_BLOCK)


def _eager_block_mask(mask):
    """``mask`` (block lists only) with a ``mask_mod`` reading its block map, so eager flex, which
    applies only the ``mask_mod``, computes the same block-sparse attention as the compiled kernel."""
    from torch.nn.attention.flex_attention import BlockMask

    q_block, kv_block = mask.BLOCK_SIZE
    blocks_BHNN = mask.to_dense().to(torch.bool)

    def in_kept_block(b, h, q_idx, kv_idx):
        return blocks_BHNN[b, h, q_idx // q_block, kv_idx // kv_block]

    return BlockMask.from_kv_blocks(
        mask.kv_num_blocks,
        mask.kv_indices,
        mask.full_kv_num_blocks,
        mask.full_kv_indices,
        BLOCK_SIZE=mask.BLOCK_SIZE,
        mask_mod=in_kept_block,
        seq_lengths=mask.seq_lengths,
    )


@functools.cache
def _compiled_flex():
    """flex attention compiled once per process. Default ``dynamic``: the sequence length becomes
    symbolic after the first change, so tiles of other sizes or frame counts do not each compile
    (and never hit the recompile limit, past which torch runs the uncompiled, dense-in-memory flex)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


@torch.compiler.disable  # under --compile on the CPU too: inductor's CPU flex has no lse and fails on these masks
def _eager_flex(q_BHSD, k_BHSD, v_BHSD, mask, *, scale: float):
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    with warnings.catch_warnings():  # eager on purpose: the block map's mask_mod makes it exact
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(
            q_BHSD, k_BHSD, v_BHSD, block_mask=_eager_block_mask(mask), scale=scale, return_aux=AuxRequest(lse=True)
        )


def compiled_flex_kwargs(mask, scale: float) -> dict:
    """The compiled kernel's keyword arguments: the mask as diffusers builds it, the lse, and kernel
    tiles that divide the mask's blocks (64 where the default would be 128)."""
    from torch.nn.attention.flex_attention import AuxRequest

    q_block, kv_block = mask.BLOCK_SIZE
    return {
        "block_mask": mask,
        "scale": scale,
        "return_aux": AuxRequest(lse=True),
        "kernel_options": {"BLOCK_M": min(q_block, 64), "BLOCK_N": min(kv_block, 64)},
    }


def flex_block_sparse(q_BHSD, k_BHSD, v_BHSD, mask, *, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out_BHSD, lse_BHS)`` of flex attention under the block mask ``mask`` (see the module
    docstring for CUDA vs eager)."""
    from torch.nn.attention.flex_attention import flex_attention

    if q_BHSD.device.type == "cuda":
        # Inside compiled DiT blocks (--compile) dynamo compiles flex_attention itself.
        flex = flex_attention if torch.compiler.is_compiling() else _compiled_flex()
        out, aux = flex(q_BHSD, k_BHSD, v_BHSD, **compiled_flex_kwargs(mask, scale))
    else:
        out, aux = _eager_flex(q_BHSD, k_BHSD, v_BHSD, mask, scale=scale)
    return out, aux.lse.float()


def _local_nabla(q_BSHD, k_BSHD, v_BSHD, *, sta_NN, threshold, scale, seq_len) -> NablaResult:
    """NABLA on full-sequence tensors; tokens past ``seq_len`` are Ulysses padding (dropped, and
    their output rows zero)."""
    padded = q_BSHD.shape[1]
    num_tokens = padded if seq_len is None else seq_len
    if num_tokens % NABLA_BLOCK:
        raise ValueError(
            f"NABLA attention needs a multiple of {NABLA_BLOCK} tokens (8x8 token blocks), got {num_tokens}"
        )
    num_blocks = num_tokens // NABLA_BLOCK
    if tuple(sta_NN.shape) != (num_blocks, num_blocks):
        raise ValueError(f"sta_mask has shape {tuple(sta_NN.shape)}; {num_tokens} tokens make {num_blocks} blocks")
    q, k, v = (t[:, :num_tokens].transpose(1, 2) for t in (q_BSHD, k_BSHD, v_BSHD))
    mask = nabla_block_mask(q, k, sta_NN, threshold)
    out_BHSD, lse_BHS = flex_block_sparse(q, k, v, mask, scale=scale)
    out_BSHD = out_BHSD.transpose(1, 2).to(q_BSHD.dtype)
    if num_tokens < padded:
        out_BSHD = torch.nn.functional.pad(out_BSHD, (0, 0, 0, 0, 0, padded - num_tokens))
        lse_BHS = torch.nn.functional.pad(lse_BHS, (0, padded - num_tokens), value=-math.inf)
    kept = mask.full_kv_num_blocks.sum(dtype=torch.int64) + mask.kv_num_blocks.sum(dtype=torch.int64)
    batch, heads = q.shape[:2]
    return NablaResult(out_BSHD, lse_BHS, kept, batch * heads * num_blocks * num_blocks)


def nabla_attention(
    q_BSHD: torch.Tensor,
    k_BSHD: torch.Tensor,
    v_BSHD: torch.Tensor,
    *,
    sta_mask: torch.Tensor,
    threshold: float,
    parallel: AttentionParallel | None = None,
    scale: float | None = None,
) -> NablaResult:
    """NABLA attention of ``q``/``k``/``v`` (fractal token order) with diffusers' mask.

    ``sta_mask``: the ``(N, N)`` bool sliding-tile prior over the whole sequence's blocks, and
    ``threshold`` the cumulative-mass threshold (both from diffusers' ``sparse_params``, i.e. the
    checkpoint's ``nabla_window`` / ``nabla_threshold``). ``parallel``: Ulysses only (``ValueError``
    with ``RING_REFUSAL`` for a Ring group); with it, q/k/v are this rank's sequence shards and the
    result is the matching shard, the kept-block count that of this rank's heads.
    """
    scale = 1.0 / math.sqrt(q_BSHD.shape[-1]) if scale is None else scale
    par = parallel or AttentionParallel()
    if par.ring_group is not None and par.ring_size > 1:
        raise ValueError(RING_REFUSAL)
    local = functools.partial(_local_nabla, sta_NN=sta_mask, threshold=threshold, scale=scale)
    if par.ulysses_group is None or par.ulysses_size <= 1:
        return local(q_BSHD, k_BSHD, v_BSHD, seq_len=par.seq_len)
    check_heads(q_BSHD.shape[2], par.ulysses_group)
    results: list[NablaResult] = []

    def attend(q, k, v):  # full sequence, this rank's heads
        results.append(local(q, k, v, seq_len=par.seq_len))
        return results[-1].out_BSHD, results[-1].lse_BHS

    out_BSHD, lse_BHS = ulysses_attention(q_BSHD, k_BSHD, v_BSHD, group=par.ulysses_group, attend=attend)
    return NablaResult(out_BSHD, lse_BHS, results[0].kept_blocks, results[0].total_blocks)
