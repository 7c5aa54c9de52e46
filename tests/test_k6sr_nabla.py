"""``--attention-backend nabla``: Kandinsky 6 SR's NABLA block-sparse attention in tilecast.

The transformer is the ``tiny/k6sr`` checkpoint's (12 heads of 16, 2 blocks), loaded from its
``transformer/`` folder; its config carries diffusers' defaults ``nabla_threshold = 0.8`` and
``nabla_window = (11, 7, 7)``. The input is a 2-frame 16x16 token grid: 512 tokens, 8 NABLA blocks
of 64 (2x2 blocks of 8x8 per frame). At that size the checkpoint's (11, 7, 7) sliding-tile prior
covers every block (density 1, NABLA == dense), so the pruning cases use a copy of the checkpoint
whose config says ``nabla_window = (1, 1, 1)`` and ``nabla_threshold = 0.5`` (the prior keeps only a
block's own frame-neighbour blocks; the threshold drops about half the rest).

Reference: diffusers' own ``Kandinsky6SRAttnProcessor`` (its q/k/v, norms, rotary, its
``nabla_block_mask`` call on its ``sparse_params``) on the same weights and input. Its flex call is
what diffusers runs compiled on a GPU, where the kernel skips the blocks the ``BlockMask`` leaves
out. Uncompiled (the CPU), PyTorch's flex applies only a ``BlockMask``'s ``mask_mod`` and diffusers'
mask has none, so diffusers' eager NABLA is plain dense attention (pinned below). The reference
therefore runs diffusers' processor with its attention call replaced by SDPA under the token mask
that the BlockMask's block map spells (``to_dense``): the block-sparse result, computed independently
of tilecast's flex path.

Tolerance: fp32, ``ATOL = 1e-4`` on the transformer's outputs (magnitude ~1). Measured (``-s``):
tilecast's NABLA vs diffusers' block-sparse NABLA 8.3e-7 at density 0.558, while dense differs from
it by 1.7e-2; diffusers' uncompiled flex vs dense 9.5e-7 (it is dense); Ulysses 2 vs one rank 0.0,
TP 2 vs one rank 1.2e-6 (the row-parallel all-reduce).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.distributed import run_ranks

ATOL = 1e-4
FRAMES, GRID = 2, 16
"""Token grid of the test input: 2 x 16 x 16 = 512 tokens = 8 NABLA blocks."""
PRUNING = {"nabla_window": [1, 1, 1], "nabla_threshold": 0.5}


@pytest.fixture(scope="module")
def checkpoint(tiny_cache) -> Path:
    from tilecast.runtime.models.k6sr.tiny import ensure_tiny_k6sr

    return ensure_tiny_k6sr() / "transformer"


@pytest.fixture(scope="module")
def pruning_checkpoint(checkpoint, tmp_path_factory) -> Path:
    """The tiny transformer with a NABLA config that prunes at this size."""
    target = tmp_path_factory.mktemp("nabla") / "transformer"
    shutil.copytree(checkpoint, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **PRUNING}))
    return target


def _load(path: Path):
    from diffusers.models.transformers.transformer_kandinsky6_sr import Kandinsky6SRTransformer3DModel

    return Kandinsky6SRTransformer3DModel.from_pretrained(str(path), torch_dtype=torch.float32).eval()


def _inputs(in_channels: int = 33):
    generator = torch.Generator().manual_seed(1)
    return torch.randn(1, FRAMES, GRID, GRID, in_channels, generator=generator), torch.tensor([500.0])


def _tilecast(model, backend: str | None):
    from tilecast.runtime.models.k6sr.attention import install_dense_attention, nabla_density, reset_nabla_stats

    install_dense_attention(model, backend=backend)
    reset_nabla_stats(model)
    hidden_states, timestep = _inputs()
    with torch.no_grad():
        out = model(hidden_states, timestep).sample
    return out, nabla_density(model)


def _diffusers(model, monkeypatch, *, block_sparse: bool = True):
    """diffusers' NABLA processor; ``block_sparse``: its flex call as the compiled kernel computes it."""
    from diffusers.models.transformers import transformer_kandinsky6_sr as module

    def block_sparse_attention(query, key, value, attn_mask, **_):  # BSHD in and out, as diffusers' dispatch
        q_block, kv_block = attn_mask.BLOCK_SIZE
        blocks = attn_mask.to_dense().to(torch.bool)
        tokens = blocks.repeat_interleave(q_block, dim=-2).repeat_interleave(kv_block, dim=-1)
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (query, key, value)), attn_mask=tokens)
        return out.transpose(1, 2)

    model.set_attn_processor(module.Kandinsky6SRAttnProcessor())
    hidden_states, timestep = _inputs()
    with monkeypatch.context() as patch:
        if block_sparse:
            patch.setattr(module, "dispatch_attention_fn", block_sparse_attention)
        with torch.no_grad():
            return model(hidden_states, timestep).sample


def test_checkpoint_config_and_input_make_several_blocks(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["nabla_threshold"] == 0.8 and config["nabla_window"] == [11, 7, 7]
    assert FRAMES * GRID * GRID // 64 == 8


def test_nabla_matches_diffusers_block_sparse_and_differs_from_dense(pruning_checkpoint, monkeypatch):
    model = _load(pruning_checkpoint)
    reference = _diffusers(model, monkeypatch)
    diffusers_eager = _diffusers(model, monkeypatch, block_sparse=False)
    started = time.perf_counter()
    ours, density = _tilecast(model, "nabla")
    elapsed = time.perf_counter() - started
    dense, no_density = _tilecast(model, None)
    err = (ours - reference).abs().max().item()
    gap = (dense - reference).abs().max().item()
    eager_gap = (diffusers_eager - dense).abs().max().item()
    print(f"nabla vs diffusers: {err:.3g}; dense vs nabla: {gap:.3g}; density {density:.3f}; {elapsed:.2f}s")
    print(f"diffusers' uncompiled flex vs dense: {eager_gap:.3g}")
    assert reference.abs().max() > 0.1
    assert err <= ATOL
    assert 0 < density < 1  # the threshold pruned blocks...
    assert gap > 10 * ATOL  # ...which changes the output, so the parity above means something
    assert no_density is None  # the dense path runs no NABLA call
    assert eager_gap <= ATOL  # diffusers' uncompiled flex ignores the block lists: dense


def test_density_tracks_the_config_and_full_density_is_dense(checkpoint, pruning_checkpoint):
    released = _load(checkpoint)  # (11, 7, 7) covers all 8 blocks at this size
    ours, density = _tilecast(released, "nabla")
    dense, _ = _tilecast(released, None)
    assert density == 1.0
    assert (ours - dense).abs().max().item() <= ATOL

    everything = _load(pruning_checkpoint)
    everything.register_to_config(nabla_threshold=1.0)  # every block's mass counts: all kept
    ours, density = _tilecast(everything, "nabla")
    dense, _ = _tilecast(everything, None)
    assert density == 1.0
    assert (ours - dense).abs().max().item() <= ATOL

    pruned = _load(pruning_checkpoint)
    _, density = _tilecast(pruned, "nabla")
    assert 0 < density < 1


def _block_sparse_reference(q, k, v, sta, threshold):
    """Dense attention under the token mask diffusers' NABLA block mask spells, in float32."""
    from diffusers.models.transformers.transformer_kandinsky6_sr import nabla_block_mask

    from tilecast.kernels.nabla import NABLA_BLOCK

    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    blocks = nabla_block_mask(q, k, sta, thr=threshold).to_dense().bool()  # from the kernel's own inputs
    q, k, v = q.float(), k.float(), v.float()
    tokens = blocks.repeat_interleave(NABLA_BLOCK, -2).repeat_interleave(NABLA_BLOCK, -1)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~tokens, float("-inf"))
    lse = scores.logsumexp(-1)
    return ((scores - lse[..., None]).exp() @ v).transpose(1, 2), lse, blocks


def test_nabla_attention_returns_the_block_sparse_lse():
    from tilecast.kernels.nabla import NABLA_BLOCK, nabla_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4 * NABLA_BLOCK, 3, 8) for _ in range(3))
    sta = torch.eye(4, dtype=torch.bool)
    result = nabla_attention(q, k, v, sta_mask=sta, threshold=0.5)
    out, lse, blocks = _block_sparse_reference(q, k, v, sta, 0.5)
    assert (result.out_BSHD - out).abs().max() <= 1e-5
    assert (result.lse_BHS - lse).abs().max() <= 1e-5
    assert result.total_blocks == 2 * 3 * 4 * 4
    assert int(result.kept_blocks) == int(blocks.sum())
    assert 0 < result.density < 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nabla_on_cuda_runs_the_compiled_block_sparse_kernel():
    """The compiled flex kernel (64-token tiles) on the GPU, bf16 at head dim 64: within 2e-2 of the
    float32 block-sparse reference (bf16 rounding), and the same kept blocks."""
    from tilecast.kernels.nabla import NABLA_BLOCK, nabla_attention

    gen = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 16 * NABLA_BLOCK, 4, 64, device="cuda", generator=gen).bfloat16() for _ in range(3))
    sta = torch.eye(16, dtype=torch.bool, device="cuda") | torch.eye(16, dtype=torch.bool, device="cuda").roll(1, 1)
    result = nabla_attention(q, k, v, sta_mask=sta, threshold=0.5)
    out, lse, blocks = _block_sparse_reference(q, k, v, sta, 0.5)
    print(
        f"NABLA on CUDA: density {result.density:.3f}, max out error {(result.out_BSHD.float() - out).abs().max():.2e}"
    )
    assert (result.out_BSHD.float() - out).abs().max() <= 2e-2
    assert (result.lse_BHS - lse).abs().max() <= 2e-2
    assert int(result.kept_blocks) == int(blocks.sum()) and 0 < result.density < 1


def test_token_count_must_fill_blocks():
    from tilecast.kernels.nabla import nabla_attention

    q = torch.randn(1, 100, 2, 8)
    with pytest.raises(ValueError, match="multiple of 64 tokens"):
        nabla_attention(q, q, q, sta_mask=torch.ones(1, 1, dtype=torch.bool), threshold=0.8)


# ----------------------------------------------------------------------------- parallel
def _run_parallel(rank: int, world_size: int, checkpoint: str, tp: int, ulysses: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from tilecast.runtime.models.k6sr.attention import nabla_density, reset_nabla_stats
    from tilecast.runtime.models.k6sr.dit_parallel import apply_dit_parallel, dit_groups_from_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (1, ulysses, tp), mesh_dim_names=("ring", "ulysses", "tp"))
    model = _load(Path(checkpoint))
    reference, density = _tilecast(model, "nabla")
    groups = dit_groups_from_mesh(mesh)
    apply_dit_parallel(model, **groups, backend="nabla")
    reset_nabla_stats(model)
    hidden_states, timestep = _inputs()
    with torch.no_grad():
        output = model(hidden_states, timestep).sample
    result = {
        "err": (output - reference).abs().max().item(),
        "density": density,
        "parallel_density": nabla_density(model, [groups["tp_group"], groups["ulysses_group"]]),
        "local_density": nabla_density(model),
    }
    ring_mesh = init_device_mesh("cpu", (world_size, 1, 1), mesh_dim_names=("ring", "ulysses", "tp"))
    try:  # the same ranks as a Ring group: refused before any exchange
        apply_dit_parallel(_load(Path(checkpoint)), **dit_groups_from_mesh(ring_mesh), backend="nabla")
    except ValueError as exc:
        result["ring_refused"] = str(exc)
    return result


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("tp", "ulysses"), [(1, 2), (2, 1)], ids=["ulysses2", "tp2"])
def test_sharded_heads_match_one_rank(pruning_checkpoint, tp, ulysses):
    started = time.perf_counter()
    results = run_ranks(_run_parallel, tp * ulysses, str(pruning_checkpoint), tp, ulysses, timeout=120)
    print(f"tp {tp} ulysses {ulysses}: errors {[r['err'] for r in results]}, {time.perf_counter() - started:.1f}s")
    for rank, result in enumerate(results):
        assert result["err"] <= ATOL, (rank, result)
        assert 0 < result["density"] < 1
        # The ranks' heads together make the one-rank count.
        assert result["parallel_density"] == pytest.approx(result["density"], abs=1e-12), (rank, result)
        assert "--attention-backend nabla with --ring-degree" in result["ring_refused"], (rank, result)
    assert sum(r["local_density"] for r in results) / len(results) == pytest.approx(results[0]["density"])


def test_ring_is_refused_naming_both_flags(tmp_path):
    """At preflight (topology rules) and at load; ``apply_dit_parallel`` too (in the sharded test)."""
    from tests.harness import make_context
    from tilecast.runtime.models.k6sr.pipeline import K6SRPipeline
    from tilecast.runtime.topology import kernel_errors

    ctx = make_context(tmp_path, world_size=2, ring_degree=2, attention_backend="nabla")
    with pytest.raises(ValueError, match="--attention-backend nabla with --ring-degree"):
        K6SRPipeline.load("tiny/k6sr", ctx)
    (error,) = kernel_errors(ring_degree=2, attention_backend="nabla")
    assert "--attention-backend nabla" in error and "--ring-degree" in error
    assert kernel_errors(ring_degree=1, attention_backend="nabla") == []


def test_other_models_refuse_nabla(tmp_path):
    from tests.harness import make_context
    from tilecast.kernels.attention import attention
    from tilecast.runtime.config import UnsupportedSettingError
    from tilecast.runtime.models.k6sr.pipeline import K6SRPipeline
    from tilecast.runtime.pipeline import Pipeline

    settings = make_context(tmp_path, attention_backend="nabla").settings
    K6SRPipeline.check_settings(settings, "tiny/k6sr")  # served here

    class Other(Pipeline):
        family = "other"
        honoured_settings = frozenset({"dtype", "attention_backend"})

    with pytest.raises(UnsupportedSettingError, match="Kandinsky 6 SR's own block-sparse attention"):
        Other.check_settings(settings, "some/model")
    q = torch.randn(1, 64, 2, 8)
    with pytest.raises(ValueError, match="no other model serves it"):
        attention(q, q, q, backend="nabla")


def test_ulysses_padding_is_dropped_before_the_mask():
    """Under Ulysses the exchanged sequence may end in padding: NABLA runs on the true tokens only."""
    from tilecast.kernels.collectives import AttentionParallel
    from tilecast.kernels.nabla import nabla_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 256, 2, 8) for _ in range(3))
    sta = torch.eye(4, dtype=torch.bool)
    plain = nabla_attention(q, k, v, sta_mask=sta, threshold=0.5)
    pad = [torch.cat([t, torch.randn(1, 2, 2, 8)], dim=1) for t in (q, k, v)]
    padded = nabla_attention(*pad, sta_mask=sta, threshold=0.5, parallel=AttentionParallel(seq_len=256))
    assert torch.equal(padded.out_BSHD[:, :256], plain.out_BSHD)
    assert torch.equal(padded.lse_BHS[..., :256], plain.lse_BHS)
    assert not padded.out_BSHD[:, 256:].any() and int(padded.kept_blocks) == int(plain.kept_blocks)


def test_served_job_reports_density(checkpoint, pruning_checkpoint, tmp_path):
    """``--attention-backend nabla`` on a checkpoint whose config prunes: the job's info carries the
    density, and the video differs from the dense default's."""
    from tests.harness import make_context
    from tilecast.runtime.models.k6sr.params import SRParams
    from tilecast.runtime.models.k6sr.pipeline import K6SRPipeline
    from tilecast.runtime.pipeline import WorkItem
    from tilecast.runtime.synthetic import write_test_video

    model_dir = tmp_path / "k6sr-pruning"
    shutil.copytree(checkpoint.parent, model_dir)  # the tiny checkpoint...
    shutil.copy(pruning_checkpoint / "config.json", model_dir / "transformer" / "config.json")  # ...pruning
    video = write_test_video(tmp_path / "in.mp4", 64, 32, 1, 24.0, audio=False)  # x4: one 256x128 tile, 2 blocks
    frames = {}
    for backend in ("nabla", None):
        ctx = make_context(tmp_path / f"out-{backend}", attention_backend=backend, allowed_video_dirs=[str(tmp_path)])
        pipe = K6SRPipeline.load(str(model_dir), ctx)
        params = pipe.prepare(SRParams(video_path=str(video), sr_resolution_scale=4, return_frames=True), {})
        item = WorkItem(job_id=f"job-{backend}", params=params, uploads={"video": video.read_bytes()})
        output = pipe.run([item], ctx)[0]
        frames[backend] = output.tensors["frames"].float()
        if backend == "nabla":
            assert 0 < output.info["nabla_density"] < 1, output.info
        else:
            assert "nabla_density" not in output.info
    assert frames["nabla"].shape == frames[None].shape == (1, 128, 256, 3)
    assert (frames["nabla"] - frames[None]).abs().max() > 0


def test_bench_k6sr_takes_the_backend_and_refuses_unknown_names():
    from typer.testing import CliRunner

    from tilecast.launcher import cli

    result = CliRunner().invoke(cli.app, ["bench", "k6sr", "--attention-backend", "nope", "--peer", "none"])
    assert result.exit_code != 0 and "unknown attention backend 'nope'" in result.output


def test_the_cuda_call_is_a_valid_flex_call():
    """The compiled CUDA path cannot run here; its arguments go through PyTorch's flex API on the CPU
    (eagerly: the kernel tiles are then unused and the block lists ignored, so only the API is checked)."""
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    from tilecast.kernels.nabla import compiled_flex_kwargs, nabla_block_mask

    q, k, v = (torch.randn(1, 2, 128, 8) for _ in range(3))
    kwargs = compiled_flex_kwargs(nabla_block_mask(q, k, torch.eye(2, dtype=torch.bool), 0.5), 0.25)
    assert kwargs["kernel_options"] == {"BLOCK_M": 64, "BLOCK_N": 64}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, aux = flex_attention(q, k, v, **kwargs)
    assert out.shape == q.shape and aux.lse.shape == (1, 2, 128)


def test_each_call_logs_its_density_at_debug(pruning_checkpoint, caplog):
    model = _load(pruning_checkpoint)
    with caplog.at_level("DEBUG", logger="tilecast.runtime.models.k6sr.attention"):
        _, density = _tilecast(model, "nabla")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("nabla: kept")]
    assert len(lines) == 2  # one per block's attention call
    assert all("of 768 blocks" in line for line in lines), lines  # 12 heads x 8 x 8 blocks
