"""Ulysses, Ring and Ulysses × Ring attention on gloo ranks vs. single-rank attention.

Legend: B batch, S sequence, H heads, D head dim.
Lengths include ones that do not divide by the SP degree (37 on 4 ranks) and ones where a whole
Ring chunk is padding (5 and 9 on 4 ranks), so masking and the -inf merge are exercised.
Tolerance (fp32): max abs error <= 1e-5 for out and lse (measured <= 1e-6).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks

TOL = 1e-5
LENGTHS = (37, 9, 5, 64)
BACKENDS = ("chunked_math", "sdpa_flash_cpu", "sdpa_math")


def _groups(ulysses: int, ring: int):
    """Groups of a ("ring", "ulysses") mesh built with plain ``dist.new_group`` calls."""
    import torch.distributed as dist

    rank = dist.get_rank()
    # Every rank creates every group, in the same order.
    ulysses_groups = [dist.new_group([r * ulysses + u for u in range(ulysses)]) for r in range(ring)]
    ring_groups = [dist.new_group([r * ulysses + u for r in range(ring)]) for u in range(ulysses)]
    return ulysses_groups[rank // ulysses], ring_groups[rank % ulysses]


def _run_case(rank: int, world_size: int, ulysses: int, ring: int) -> list[tuple]:
    from tilecast.kernels.attention import AttentionParallel, attention, gather_sequence, shard_sequence

    ulysses_group, ring_group = _groups(ulysses, ring)
    errors = []
    for seq_len in LENGTHS:
        generator = torch.Generator().manual_seed(seq_len)
        q_BSHD, k_BSHD, v_BSHD = (torch.randn(2, seq_len, 4, 8, generator=generator) for _ in range(3))
        ref_BSHD, ref_lse_BHS = attention(q_BSHD, k_BSHD, v_BSHD, backend="sdpa_math")
        parallel = AttentionParallel(
            ulysses_group=ulysses_group if ulysses > 1 else None,
            ring_group=ring_group if ring > 1 else None,
            seq_len=seq_len,
        )
        for backend in BACKENDS:
            shards = [shard_sequence(t, 1, parallel)[0] for t in (q_BSHD, k_BSHD, v_BSHD)]
            out_BSHD, lse_BHS = attention(*shards, backend=backend, parallel=parallel)
            assert out_BSHD.shape == shards[0].shape and lse_BHS.dtype == torch.float32
            finite = bool(torch.isfinite(out_BSHD).all() and torch.isfinite(lse_BHS).all())
            out_BSHD = gather_sequence(out_BSHD, 1, parallel, seq_len)
            lse_BHS = gather_sequence(lse_BHS, 2, parallel, seq_len)
            errors.append(
                (
                    seq_len,
                    backend,
                    finite,
                    (out_BSHD - ref_BSHD).abs().max().item(),
                    (lse_BHS - ref_lse_BHS).abs().max().item(),
                )
            )
    return errors


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("ulysses", "ring"),
    [(2, 1), (4, 1), (1, 2), (1, 4), (2, 2)],
    ids=["ulysses2", "ulysses4", "ring2", "ring4", "ulysses2xring2"],
)
def test_sequence_parallel_matches_single_rank(ulysses, ring):
    results = run_ranks(_run_case, ulysses * ring, ulysses, ring, timeout=100)
    for rank, errors in enumerate(results):
        for seq_len, backend, finite, out_err, lse_err in errors:
            assert finite, (rank, seq_len, backend)
            assert out_err <= TOL and lse_err <= TOL, (rank, seq_len, backend, out_err, lse_err)


def _run_bad_heads(rank: int, world_size: int) -> str:
    import torch.distributed as dist

    from tilecast.kernels.attention import AttentionParallel, attention

    q_BSHD = torch.randn(1, 4, 3, 8)  # 3 heads on a Ulysses group of 2
    try:
        attention(q_BSHD, q_BSHD, q_BSHD, parallel=AttentionParallel(ulysses_group=dist.group.WORLD))
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(120)
def test_ulysses_rejects_indivisible_heads():
    for message in run_ranks(_run_bad_heads, 2, timeout=60):
        assert "3 local attention heads do not divide by the Ulysses group size 2" in message


def _fail_or_hang(rank: int, world_size: int, mode: str) -> int:
    import time

    if rank == 1:
        if mode == "raise":
            raise RuntimeError("boom on rank 1")
        time.sleep(600)
    return rank


@pytest.mark.timeout(60)
def test_run_ranks_reports_failures_and_kills_stragglers():
    from tests.distributed import RankError

    with pytest.raises(RankError, match="boom on rank 1"):
        run_ranks(_fail_or_hang, 2, "raise", timeout=30)
    with pytest.raises(TimeoutError, match=r"ranks \[1\]"):
        run_ranks(_fail_or_hang, 2, "hang", timeout=3)
