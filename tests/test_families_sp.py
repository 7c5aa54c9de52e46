"""Sequence parallelism (Ulysses, Ring, Ulysses x Ring) for the T2I/T2V families on gloo ranks.

Every rank loads the family's tiny checkpoint with the process groups of a ``Topology`` and runs a
merged batch of two requests; the outputs must equal the requests' single-rank singleton outputs
(computed once, in this process, on one thread as each rank runs) within ``SP_TOL`` (fp32, max abs
difference on the ``[0, 1]`` output; measured 7e-7 .. 4e-6 across families and layouts, the
same order as the single-rank batch-vs-singleton difference in ``tests/test_families.py``; with the
padded keys left unmasked the difference is ~2e-3, so the tolerance tells them apart).

The token sequences do not divide by the degree: 48 x 48 pixels give 3 x 3 2x2-packed latent
tokens on FLUX and Qwen-Image (9), 2 x 3 x 3 on Wan with 5 frames (18, on 4 ranks) and 1 x 3 x 3
with 1 frame (9, on 2 ranks); SANA (32x autoencoder, 1x1 patches) gets 96 x 224 pixels, a 7 x 3
grid (21 tokens: 11 per rank on 2 ranks, whose Mix-FFN reads the other shard's edge rows; 6 on 4);
ERNIE-Image splits one joint sequence, 64 x 48 pixels' 4 x 3 image tokens and the longest prompt's
61 text tokens (73); HunyuanVideo 1 x 3 x 3 / 2 x 3 x 3 like Wan, with its padded text split and
masked; Helios-Base one 33-frame chunk (81 current + 26 history tokens = 107; Helios' pyramid: 49 in
its first stage); LTX-2 (32x VAE, 8x in time) gets 96 x 96 pixels and 17 frames, 3 x 3 x 3 video
tokens (27, its audio whole on every rank; its audio is checked in ``tests/test_ltx2.py``); prompts
of different lengths give Qwen-Image a text mask, Z-Image batch padding and ERNIE-Image a
text-padding mask, so the padding and the models' own masks are both exercised (SANA's padded keys
unmasked: ~2e-3; its neighbour rows zeroed: ~3e-3). Variants (Z-Image, Qwen-Image-2512,
ERNIE-Image-Turbo) run their family's transformer and plan unchanged and are not repeated here.
Qwen-Image-Layered takes no size: the 48 x 32 example image at its 640 bucket is 768 x 512 pixels,
one layer: 3 frames (noise, the layer, the input image) of 48 x 32 / 2 x 2 tokens (4608: even, as
every size its rule gives).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed import one_thread, run_ranks
from tests.harness import skip_without_required_modules, tiny_families
from tilecast.runtime.models.families.sequence_parallel import resolve_plan, stream_input
from tilecast.runtime.models.families.z_image import ZImageT2IPipeline

SP_TOL = 1e-4
"""Max abs difference between a request's output in an SP batch and its 1-rank singleton output."""

FAMILIES = {
    name: f"{cls.__module__}:{cls.__qualname__}"
    for name, cls in tiny_families(variants=False).items()
    if cls.cp_plan is not None
}
"""Built-in name → ``"module:Class"`` of every tiny diffusers family with a context-parallel plan (what
the ranks import; not the variants, which run their family's transformer and plan unchanged). A
family without one (``tiny/sd3``, ``tiny/glm-image``: diffusers ships no ``_cp_plan`` for
``SD3Transformer2DModel`` or ``GlmImageTransformer2DModel``) runs replicated only and refuses the
Ulysses and Ring degrees at start-up
(``tests/test_refuse_settings.py``; ``test_families_without_a_plan_refuse_sequence_parallel`` below)."""

REQUESTS = (
    dict(prompt="a red cat on a mat", seed=1),
    dict(prompt="a blue dog, with a much longer prompt than the first one has", seed=2),
)
"""Two requests merged into one batch (different prompt lengths)."""


def _pipeline_class(name: str):
    from tilecast.runtime.cache import resolve_ref

    return resolve_ref(FAMILIES[name])


def _fields(name: str, world: int) -> dict:
    """48 x 48 pixels: 3 x 3 latent tokens after the VAE's 8x and the 2x2 patches (odd); Wan: one
    latent frame on 2 ranks (9 tokens), two on 4 ranks (18 tokens, padded to 20)."""
    fields = dict(width=48, height=48, num_inference_steps=2, return_tensor=True)
    if name == "tiny/sana-1.5-1.6b":  # DC-AE's 32x, 1x1 patches: 7 rows of 3 tokens (2 ranks: 11 each, 4: 6)
        fields.update(width=96, height=224)
    if name == "tiny/ernie-image":  # one joint sequence: 4 x 3 image tokens (16 px each) + 61 text tokens, odd
        fields["width"] = 64
    if name.startswith("tiny/wan"):
        fields["num_frames"] = 1 if world == 2 else 5
    if name == "tiny/hunyuanvideo":  # 1 latent frame of 3 x 3 tokens on 2 ranks (9), 2 frames on 4 (18)
        fields["num_frames"] = 1 if world == 2 else 5
    if name == "tiny/helios-base":  # one chunk: 81 current + 26 history tokens (107), 81 for cross-attention
        fields["num_frames"] = 33
    if name == "tiny/helios-distilled":  # 4x VAE, three pyramid stages: 9 + 40 history tokens (49) first
        fields.update(width=32, height=32, num_frames=33, num_inference_steps=1)  # 1 step a stage: 6 forwards
    if name == "tiny/ltx-2":  # 32x VAE, 1x1 patches, 8x in time: 3 x 3 x 3 video tokens (27); audio whole
        fields.update(width=96, height=96, num_frames=17)
    if name == "tiny/wan2.2-ti2v-5b":  # 16x VAE, 2x2 patches: 3 x 1 tokens per latent frame (3, or 6 on 4 ranks)
        fields.update(width=96, height=32)
    if name == "tiny/qwen-image-layered":  # no size: the 640 bucket, 768 x 512 for the 48 x 32 example image;
        del fields["width"], fields["height"]  # one layer: 3 frames (noise, layer, input) of 48 x 32 / 2 tokens
        fields["layers"] = 1
    return fields


def _context(rank: int, world_size: int, output_dir, groups, ulysses: int = 1, ring: int = 1, **settings):
    from tilecast.runtime.config import ServeConfig
    from tilecast.runtime.pipeline import RankContext

    config = ServeConfig(num_gpus=world_size, ulysses_degree=ulysses, ring_degree=ring, dtype="float32", **settings)
    return RankContext(
        rank=rank,
        world_size=world_size,
        device=torch.device("cpu"),
        cpu_group=None,
        device_group=None,
        output_dir=output_dir,
        groups=groups,
        settings=config,
    )


def _generate(pipeline, ctx, requests: list[dict], fields: dict) -> list[torch.Tensor]:
    from tilecast.runtime.pipeline import WorkItem

    items = [  # an image-to-video family gets its example first frame (``example_uploads``)
        WorkItem(
            job_id=f"j{i}",
            params=pipeline.prepare(pipeline.params_type(**request, **fields), pipeline.example_uploads()),
            uploads=pipeline.example_uploads(),
        )
        for i, request in enumerate(requests)
    ]
    size = pipeline.max_batch_size  # a singleton-only family (Edit Plus, Helios' pyramid) runs them one by one
    return [out for start in range(0, len(items), size) for out in pipeline.generate(items[start : start + size], ctx)]


def _record_kernel_calls() -> list:
    """Make the automatic CPU attention backend record the query shape ``(B, S, H, D)`` of every
    kernel call (in this process only: each rank is a process of its own)."""
    import dataclasses

    from tilecast.kernels import backends

    calls: list = []
    auto = backends.resolve_backend(None, "cpu", torch.float32)
    inner = getattr(auto.fn, "inner", auto.fn)

    def fn(q_BSHD, k_BKHD, v_BKHD, *, scale):
        calls.append(tuple(q_BSHD.shape))
        return inner(q_BSHD, k_BKHD, v_BKHD, scale=scale)

    fn.inner = inner
    backends.register_backend(dataclasses.replace(auto, fn=fn), replace=True)
    return calls


REPLICATED_PROCESSORS = ("TextOnlyAttnProcessor", "ReplicatedAttnProcessor")
"""Attention on tokens the plan does not split (HunyuanVideo's token refiner on the text)."""


def _first_split_attention(transformer):
    """The first attention layer whose tokens the plan splits."""
    return next(
        m
        for m in transformer.modules()
        if hasattr(m, "set_processor") and type(m.processor).__name__ not in REPLICATED_PROCESSORS
    )


def _sp_ranks(rank, world_size, name, ulysses, ring, cache_dir, output_dir, fields, settings=None) -> dict:
    """One rank: load with an Ulysses x Ring topology, run the merged batch; outputs and what attention saw."""
    os.environ["TILECAST_CACHE"] = cache_dir
    from tilecast.runtime.topology import Topology

    topology = Topology(num_gpus=world_size, ulysses_degree=ulysses, ring_degree=ring)
    groups = topology.groups(topology.build_mesh("cpu"))
    calls = _record_kernel_calls()
    ctx = _context(rank, world_size, output_dir, groups, ulysses, ring, **(settings or {}))
    pipeline = _pipeline_class(name).load(name, ctx)
    queries = []
    first = _first_split_attention(pipeline.pipe.transformer)
    first.register_forward_pre_hook(
        lambda module, args, kwargs: queries.append((kwargs.get("hidden_states", args[0] if args else None)).shape[1]),
        with_kwargs=True,
    )
    outputs = _generate(pipeline, ctx, list(REQUESTS), fields)
    state = pipeline.pipe.transformer._tilecast_sequence_parallel
    splits = {name: (split.true_len, split.local_len) for name, split in state.splits.items()}
    return {
        "outputs": outputs,
        "kernel_queries": calls,
        "layer_queries": queries,
        "splits": splits,
        "heads": pipeline.pipe.transformer.config.get("num_attention_heads")
        or pipeline.pipe.transformer.config.get("n_heads"),
    }


def _references(name: str, cache_dir, output_dir, fields) -> tuple[list[torch.Tensor], list, list]:
    """Each request alone on one rank, on one thread (as the ranks run); what attention saw."""
    calls = _record_kernel_calls()
    ctx = _context(0, 1, output_dir, None)
    with one_thread():
        pipeline = _pipeline_class(name).load(name, ctx)
        queries = []
        first = _first_split_attention(pipeline.pipe.transformer)
        first.register_forward_pre_hook(
            lambda module, args, kwargs: queries.append(
                (kwargs.get("hidden_states", args[0] if args else None)).shape[1]
            ),
            with_kwargs=True,
        )
        outputs, firsts = [], []
        for request in REQUESTS:
            seen = len(queries)
            outputs.append(_generate(pipeline, ctx, [request], fields)[0])
            firsts.append(queries[seen])  # the first split layer's tokens in this request's first call
    return outputs, calls, firsts


_REFERENCE_CACHE: dict = {}


def _reference(name, tiny_cache, tmp_path_factory, fields):
    key = (name, tuple(sorted(fields.items())))
    if key not in _REFERENCE_CACHE:
        _REFERENCE_CACHE[key] = _references(name, tiny_cache, tmp_path_factory.mktemp("ref"), fields)
    return _REFERENCE_CACHE[key]


def _check(name, ulysses, ring, tiny_cache, tmp_path_factory, **settings):
    skip_without_required_modules(_pipeline_class(name))
    fields = _fields(name, ulysses * ring)
    _pipeline_class(name).checkpoint.ensure(tiny_cache)  # built once, here, before the ranks start
    references, ref_calls, ref_queries = _reference(name, tiny_cache, tmp_path_factory, fields)
    world = ulysses * ring
    results = run_ranks(
        _sp_ranks,
        world,
        name,
        ulysses,
        ring,
        str(tiny_cache),
        tmp_path_factory.mktemp("sp"),
        fields,
        settings,
        timeout=500 if settings else 150,
    )
    errors = []
    for rank, result in enumerate(results):
        for i, (got, want) in enumerate(zip(result["outputs"], references)):
            assert got.shape == want.shape, (rank, i, got.shape, want.shape)
            errors.append((got - want).abs().max().item())
            assert errors[-1] <= SP_TOL, (
                f"{name} ulysses={ulysses} ring={ring} rank {rank} request {i}: {errors[-1]:.3g}"
            )
        # The work really is split: the first attention layer gets ceil(S / N) of the S image tokens
        # it gets on one rank, and no attention kernel call gets more than 1/N of the (query tokens x
        # heads) of the largest one-rank call (Ulysses: every token, 1/U of the heads; Ring: 1/R of
        # the tokens, every head), padding aside.
        # a merged batch pads to its longest request (ERNIE-Image's joint [image, text] sequence);
        # a family served one request at a time (Helios' pyramid) starts with the first request alone
        merged = _pipeline_class(name).max_batch_size >= len(REQUESTS)
        full = max(ref_queries) if merged else ref_queries[0]
        assert result["layer_queries"][0] == -(-full // world), (rank, result["layer_queries"][0], full)
        heads = result["heads"]
        work = max(s * h for _b, s, h, _d in result["kernel_queries"])
        largest = max((s * h for _b, s, h, _d in ref_calls), default=None)
        if largest is not None:  # FLUX runs tilecast's kernels on one rank too
            assert work * world <= largest + 2 * world * heads and work < largest, (rank, work, largest)
        # The sequence did not divide by the degree: the image tokens were padded and still matched.
        family = _pipeline_class(name)
        true_len, local_len = result["splits"][stream_input(resolve_plan(family.cp_plan))]
        # Z-Image pads every region to 32 tokens itself; Helios' pyramid ends on its full-resolution
        # stage, whose token count is even (its first stage's 49 tokens were padded); Qwen-Image-Layered's
        # sizes are multiples of 32 pixels (diffusers' rule), so every frame has an even token grid
        if not issubclass(family, ZImageT2IPipeline) and name not in (
            "tiny/helios-distilled",
            "tiny/qwen-image-layered",
        ):
            assert true_len % world and local_len == -(-true_len // world), (rank, true_len, local_len)
    print(f"{name} ulysses={ulysses} ring={ring}: max |SP - one rank| = {max(errors):.3g}")
    return results


TWO_RANK_FAMILIES = sorted(
    set(FAMILIES) & {"tiny/flux", "tiny/qwen-image", "tiny/z-image-turbo", "tiny/wan2.1-t2v", "tiny/sana-1.5-1.6b"}
)
"""Families that also run Ulysses 2 and Ring 2 alone on two ranks: the first four families, and SANA,
whose Mix-FFN reads its neighbours' edge rows only when a shard has more than two rows. Every family
runs Ulysses 2 x Ring 2 on four ranks, which takes both exchanges (and keeps CI's time in bounds)."""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", TWO_RANK_FAMILIES)
@pytest.mark.parametrize(("ulysses", "ring"), [(2, 1), (1, 2)], ids=["ulysses2", "ring2"])
def test_two_ranks_match_one_rank(name, ulysses, ring, tiny_cache, tmp_path_factory):
    _check(name, ulysses, ring, tiny_cache, tmp_path_factory)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_ulysses_times_ring_on_four_ranks_matches_one_rank(name, tiny_cache, tmp_path_factory):
    _check(name, 2, 2, tiny_cache, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compiled_blocks_under_ulysses_match_one_rank(tiny_cache, tmp_path_factory):
    # --compile: diffusers' regional compilation of the blocks, with the split hooks and the
    # processors' collectives inside (graph breaks at the data-dependent mask checks). ~2 min on CPU.
    _check("tiny/flux", 2, 1, tiny_cache, tmp_path_factory, compile=True)


def test_sequence_parallel_refuses_cuda_graphs(monkeypatch):
    from types import SimpleNamespace

    from tilecast.runtime.models.families import sequence_parallel

    monkeypatch.setattr(sequence_parallel, "sequence_degrees", lambda groups: (2, 1))
    ctx = SimpleNamespace(groups=object(), settings=SimpleNamespace(cuda_graphs=True, attention_backend=None))
    with pytest.raises(ValueError, match="--cuda-graphs"):
        sequence_parallel.install_for_family(SimpleNamespace(transformer=None), _pipeline_class("tiny/flux"), ctx)


def test_plan_paths_and_input_names_are_checked():
    from torch import nn

    from tilecast.runtime.models.families.sequence_parallel import (
        _parameter_index,
        resolve_plan,
        stream_input,
        submodules,
    )

    class Block(nn.Module):
        def forward(self, x, attn_mask=None):
            return x

    model = nn.Module()
    model.blocks = nn.ModuleList([Block(), Block(), Block()])
    assert submodules(model, "") == [model]
    assert submodules(model, "blocks.-1") == [model.blocks[2]]
    assert submodules(model, "blocks.*") == list(model.blocks)
    with pytest.raises(ValueError, match="no submodule 'layers'"):
        submodules(model, "layers.0")
    with pytest.raises(ValueError, match="index 3 out of range"):
        submodules(model, "blocks.3")
    assert _parameter_index(model.blocks[0], "attn_mask", "blocks.0") == 1
    with pytest.raises(ValueError, match="has no input 'hidden_states'"):
        _parameter_index(model.blocks[0], "hidden_states", "blocks.0")
    # every family's plan resolves, and its stream input is the image / token stream
    streams = {name: stream_input(resolve_plan(_pipeline_class(name).cp_plan)) for name in FAMILIES}
    assert streams == {
        "tiny/flux": "hidden_states",
        "tiny/qwen-image": "hidden_states",
        "tiny/qwen-image-edit": "hidden_states",
        "tiny/qwen-image-edit-2511": "hidden_states",
        "tiny/qwen-image-layered": "hidden_states",
        "tiny/z-image-turbo": "x",
        "tiny/wan2.1-t2v": "hidden_states",
        "tiny/wan2.1-i2v-14b-480p": "hidden_states",
        "tiny/wan2.2-t2v-a14b": "hidden_states",
        "tiny/wan2.2-i2v-a14b": "hidden_states",
        "tiny/wan2.2-ti2v-5b": "hidden_states",
        "tiny/sana-1.5-1.6b": "hidden_states",
        "tiny/flux.2-dev": "hidden_states",
        "tiny/flux.2-klein-4b": "hidden_states",
        "tiny/ernie-image": "x",
        "tiny/helios-base": "hidden_states",
        "tiny/helios-distilled": "hidden_states",
        "tiny/hunyuanvideo": "hidden_states",
        "tiny/ltx-2": "hidden_states",
    }


def test_families_without_a_plan_refuse_sequence_parallel():
    from tilecast.runtime.config import ServeConfig, UnsupportedSettingError

    unplanned = {name: cls for name, cls in tiny_families().items() if cls.cp_plan is None}
    assert set(unplanned) == {"tiny/sd3", "tiny/glm-image"}
    for name, cls in unplanned.items():
        for degrees in ({"ulysses_degree": 2}, {"ring_degree": 2}):
            with pytest.raises(UnsupportedSettingError, match="not supported by"):
                cls.check_settings(ServeConfig(device="cpu", num_gpus=2, **degrees), name)
