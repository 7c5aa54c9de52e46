"""``attention(..., key_mask=...)``: keys masked anywhere, per batch row, on one rank and across
Ulysses / Ring / Ulysses x Ring gloo ranks, equal a dense masked reference (fp32, max abs <= 1e-5).

The sharded case is the families' layout (``families.sequence_parallel``): a local sequence made of
two segments ([text shard, image shard]) each padded to a multiple of the degree, so padded keys
sit in the middle of the exchanged sequence as well as at its end, plus a per-row text mask.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks

TOL = 1e-5


def _reference(q_BSHD, k_BSHD, v_BSHD, mask_BK):
    scores = torch.einsum("bshd,bkhd->bhsk", q_BSHD, k_BSHD) / q_BSHD.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask_BK[:, None, None, :], float("-inf"))
    return torch.einsum("bhsk,bkhd->bshd", scores.softmax(-1), v_BSHD)


def test_one_rank_key_mask_per_row_and_shared():
    from tilecast.kernels.attention import attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 7, 2, 8, generator=g) for _ in range(3))
    per_row = torch.tensor([[1, 1, 0, 1, 1, 1, 1], [1, 0, 0, 0, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    shared = torch.tensor([1, 0, 1, 1, 0, 1, 1], dtype=torch.bool).expand(3, -1)
    for mask in (per_row, shared, torch.ones(3, 7, dtype=torch.bool)):
        for backend in ("sdpa_math", "chunked_math", "sdpa_flash_cpu"):
            out, lse = attention(q, k, v, backend=backend, key_mask=mask)
            assert (out - _reference(q, k, v, mask)).abs().max() <= TOL, (backend, mask)
            assert lse.shape == (3, 2, 7)
    with pytest.raises(ValueError, match="key_mask has shape"):
        attention(q, k, v, key_mask=per_row[:, :5])


def _segments(rank, world_size, ulysses, ring):
    from torch.distributed.device_mesh import init_device_mesh

    from tilecast.kernels.attention import attention
    from tilecast.kernels.collectives import AttentionParallel

    mesh = init_device_mesh("cpu", (ring, ulysses), mesh_dim_names=("ring", "ulysses"))
    par = AttentionParallel(
        ulysses_group=mesh.get_group("ulysses") if ulysses > 1 else None,
        ring_group=mesh.get_group("ring") if ring > 1 else None,
    )
    g = torch.Generator().manual_seed(1)
    lengths = (5, 7)  # text, image: neither divides by 2 or 4
    segs = [[torch.randn(2, n, 4, 8, generator=g) for n in lengths] for _ in range(3)]  # q, k, v
    text_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    full = [torch.cat(parts, dim=1) for parts in segs]
    want = _reference(*full, torch.cat([text_mask, torch.ones(2, lengths[1], dtype=torch.bool)], dim=1))

    n, sp = world_size, par.sp_rank
    local_lens = [-(-length // n) for length in lengths]

    def shard(x, length, local):  # pad the segment to n * local, take this rank's part
        x = torch.cat([x, x.new_zeros(x.shape[0], n * local - length, *x.shape[2:])], dim=1)
        return x[:, sp * local : (sp + 1) * local]

    local = [torch.cat([shard(x, L, ll) for x, L, ll in zip(parts, lengths, local_lens)], dim=1) for parts in segs]
    valid = [torch.arange(sp * ll, (sp + 1) * ll) < L for L, ll in zip(lengths, local_lens)]
    mask = torch.cat([shard(text_mask, lengths[0], local_lens[0]) & valid[0], valid[1].expand(2, -1)], dim=1)
    out, _lse = attention(*local, parallel=par, backend="sdpa_math", key_mask=mask)
    # compare the real query rows of this rank's shard
    want_local = [shard(w, L, ll) for w, L, ll in zip(want.split(list(lengths), dim=1), lengths, local_lens)]
    got_local = out.split(local_lens, dim=1)
    return max(
        ((g_ - w_)[:, v_].abs().max().item() if v_.any() else 0.0) for g_, w_, v_ in zip(got_local, want_local, valid)
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("ulysses", "ring"), [(2, 1), (1, 2), (2, 2)], ids=["ulysses2", "ring2", "ulysses2xring2"])
def test_sharded_segments_with_padding_and_row_masks(ulysses, ring):
    errors = run_ranks(_segments, ulysses * ring, ulysses, ring, timeout=100)
    assert max(errors) <= TOL, errors
