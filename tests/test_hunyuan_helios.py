"""HunyuanVideo / FastHunyuan and Helios Base / Mid / Distilled: routing by the released ids, each
row's defaults from its card, the refusals, Helios' frame counts, and why the pyramid rows are
served one request at a time. The generic checks (batch == singleton, files, the diffusers
pipeline called directly, ``--compile``, sequence parallelism) run on their tiny checkpoints in
``tests/test_families.py`` and ``tests/test_families_sp.py``."""

from __future__ import annotations

import json
import shutil

import msgspec
import pytest
import torch

from tests.harness import make_context
from tilecast.runtime.models.families import helios
from tilecast.runtime.models.families.helios import HeliosPyramidT2VPipeline, HeliosT2VPipeline
from tilecast.runtime.models.families.hunyuan_video import HunyuanVideoT2VPipeline
from tilecast.runtime.pipeline import WorkItem
from tilecast.runtime.registry import resolve_pipeline

BATCH_TOL = 1e-4


@pytest.fixture(scope="module")
def loaded(tiny_cache, tmp_path_factory):
    """(family class, path or built-in name, model id) -> (pipeline, ctx), loaded once per module."""
    cache: dict = {}

    def get(cls, model_path: str, model_id: str | None = None):
        key = (cls, model_path, model_id)
        if key not in cache:
            ctx = make_context(tmp_path_factory.mktemp("out"), dtype="float32", model_id=model_id)
            cache[key] = (cls.load(model_path, ctx), ctx)
        return cache[key]

    return get


def _run(pipe, ctx, job="j", **fields):
    fields = {"width": 32, "height": 32, "return_tensor": True, **fields}
    params = pipe.prepare(pipe.params_type(**fields), {})
    return pipe.run([WorkItem(job_id=job, params=params)], ctx)[0].tensors["video"]


@pytest.mark.parametrize(
    ("model_id", "family"),
    [
        ("hunyuanvideo-community/HunyuanVideo", HunyuanVideoT2VPipeline),
        ("FastVideo/FastHunyuan-diffusers", HunyuanVideoT2VPipeline),
        ("BestWishYsh/Helios-Base", HeliosT2VPipeline),
        ("BestWishYsh/Helios-Mid", HeliosPyramidT2VPipeline),
        ("BestWishYsh/Helios-Distilled", HeliosPyramidT2VPipeline),
    ],
)
def test_released_ids_route_to_their_family(model_id, family, tmp_path):
    assert resolve_pipeline(str(tmp_path), model_id=model_id) is family
    renamed = tmp_path / model_id.rpartition("/")[2]  # a directory of another pipeline class, named as released
    renamed.mkdir()
    (renamed / "model_index.json").write_text(json.dumps({"_class_name": "SomeRenamedPipeline"}))
    assert resolve_pipeline(str(renamed)) is family


# ---- HunyuanVideo / FastHunyuan ------------------------------------------------------------


def test_hunyuanvideo_defaults_follow_the_release_and_guidance_is_embedded(loaded):
    pipe, _ = loaded(HunyuanVideoT2VPipeline, "tiny/hunyuanvideo")
    p = pipe.prepare(pipe.params_type(prompt="x"), {})
    assert (p.num_inference_steps, p.guidance_scale, p.fps, pipe.row) == (50, 6.0, 24, "HunyuanVideo")
    assert pipe.call_kwargs(p)["max_sequence_length"] == 256 and pipe.pipe.scheduler.config.shift == 7.0
    assert not pipe.guidance_on(p)
    for fields, message in (
        ({"negative_prompt": "blurry"}, "negative_prompt cannot be used by hunyuanvideo: HunyuanVideo is guidance-"),
        ({"true_cfg_scale": 4.0}, "true_cfg_scale cannot be used by hunyuanvideo"),
        ({"num_frames": 6}, "num_frames must be 4k+1"),
        ({"width": 40}, "width must be a multiple of 16"),
        ({"flow_shift": 0.0}, "flow_shift must be in (0, 100]"),
    ):
        with pytest.raises(ValueError, match=re_escape(message)):
            pipe.prepare(pipe.params_type(prompt="x", **fields), {})


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


def test_hunyuanvideo_tokenizer_crops_exactly_the_template_as_the_release(loaded):
    """The pipeline drops the first ``crop_start`` (95) Llama tokens: the template's system part. The
    tiny tokenizer splits that part into 95 tokens as Llama 3's does, so the kept tokens start with
    the user's prompt."""
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    pipe, _ = loaded(HunyuanVideoT2VPipeline, "tiny/hunyuanvideo")
    tokenizer = pipe.pipe.tokenizer
    template, crop = DEFAULT_PROMPT_TEMPLATE["template"], DEFAULT_PROMPT_TEMPLATE["crop_start"]
    ids = tokenizer(template.format("a cat")).input_ids
    assert len(tokenizer(template.split("{}")[0]).input_ids) == crop == 95
    assert tokenizer.decode(ids[crop:]) == "a cat<|eot_id|>"
    assert ids[0] == tokenizer.bos_token_id and tokenizer.padding_side == "right"


def test_fasthunyuan_row_takes_its_card_defaults_and_flow_shift_is_per_batch(loaded, tiny_cache, tmp_path):
    fast_dir = tmp_path / "FastHunyuan-diffusers"  # the release's name picks the row
    shutil.copytree(HunyuanVideoT2VPipeline.checkpoint.ensure(tiny_cache), fast_dir)
    fast, ctx = loaded(HunyuanVideoT2VPipeline, str(fast_dir))
    p = fast.prepare(fast.params_type(prompt="x"), {})
    assert (fast.row, p.num_inference_steps, p.guidance_scale, fast.pipe.scheduler.config.shift) == (
        "FastHunyuan",
        6,
        6.0,
        17.0,
    )
    by_id, _ = loaded(HunyuanVideoT2VPipeline, "tiny/hunyuanvideo", "FastVideo/FastHunyuan-diffusers")
    assert by_id.row == "FastHunyuan"

    base, base_ctx = loaded(HunyuanVideoT2VPipeline, "tiny/hunyuanvideo")
    default = _run(base, base_ctx, prompt="rain", seed=1, num_inference_steps=2, num_frames=5)
    shifted = _run(base, base_ctx, prompt="rain", seed=1, num_inference_steps=2, num_frames=5, flow_shift=17.0)
    on_fast = _run(fast, ctx, prompt="rain", seed=1, num_inference_steps=2, num_frames=5)
    assert (default - shifted).abs().max() > 1e-4  # the shift changes the schedule ...
    assert (shifted - on_fast).abs().max() <= BATCH_TOL  # ... to FastHunyuan's, for that batch only
    assert base.pipe.scheduler.config.shift == 7.0
    assert torch.equal(default, _run(base, base_ctx, prompt="rain", seed=1, num_inference_steps=2, num_frames=5))


# ---- Helios --------------------------------------------------------------------------------


def test_helios_base_defaults_follow_its_card(loaded):
    pipe, _ = loaded(HeliosT2VPipeline, "tiny/helios-base")
    p = pipe.prepare(pipe.params_type(prompt="x"), {})
    assert (p.num_inference_steps, p.guidance_scale, p.num_frames, p.fps) == (50, 5.0, 33, 24)
    assert pipe.guidance_on(p) and pipe.call_kwargs(p)["max_sequence_length"] == 512
    assert pipe.max_batch_size == 16 and pipe.denoising_steps(p) == 50
    assert pipe.denoising_steps(msgspec.structs.replace(p, num_frames=97)) == 150  # three chunks
    for fields, message in (
        ({"num_frames": 5}, "num_frames must be 32k+1 in 33..1025 for helios-base"),
        ({"num_frames": 34}, "num_frames must be 32k+1"),
        ({"guidance_scale": 1.0, "negative_prompt": "x"}, "negative_prompt cannot be used by helios-base"),
    ):
        with pytest.raises(ValueError, match=re_escape(message)):
            pipe.prepare(pipe.params_type(prompt="x", **fields), {})


def test_helios_frame_counts_are_whole_chunks_and_the_job_gets_exactly_num_frames(loaded):
    """``HeliosPipeline`` generates whole chunks of 33 frames and keeps ``4k + 1`` of them: 33, 65 and
    97 frames exactly, 129 of 132 for four chunks, 165 for five. Every ``32k + 1`` request fits in
    the chunks it asks for; tilecast returns its first ``num_frames`` frames."""
    for num_frames in range(33, helios.MAX_FRAMES + 1, 32):
        assert helios.generated_frames(num_frames) >= num_frames, num_frames
    assert [helios.generated_frames(n) for n in (33, 65, 97, 129, 161)] == [33, 65, 97, 129, 165]
    pipe, ctx = loaded(HeliosT2VPipeline, "tiny/helios-base")
    progress: list = []
    ctx.on_progress = lambda done, total: progress.append((done, total))
    video = _run(pipe, ctx, prompt="a river", seed=3, num_frames=161, num_inference_steps=1, guidance_scale=1.0)
    assert video.shape == (161, 3, 32, 32) and torch.isfinite(video).all()
    assert progress == [(i, 5) for i in range(1, 6)]  # five chunks of one step


def test_helios_base_negative_prompt_is_per_request_in_a_batch(loaded):
    pipe, ctx = loaded(HeliosT2VPipeline, "tiny/helios-base")
    fields = dict(width=32, height=32, num_inference_steps=2, return_tensor=True)
    plain = pipe.prepare(pipe.params_type(prompt="a lighthouse", seed=5, **fields), {})
    negative = msgspec.structs.replace(plain, negative_prompt="fog, night, blurry")
    out = pipe.run([WorkItem(job_id="plain", params=plain), WorkItem(job_id="neg", params=negative)], ctx)
    alone = pipe.run([WorkItem(job_id="neg-alone", params=negative)], ctx)[0].tensors["video"]
    assert (out[0].tensors["video"] - out[1].tensors["video"]).abs().max() > 0.01
    assert (alone - out[1].tensors["video"]).abs().max() <= BATCH_TOL


def test_helios_distilled_defaults_and_refusals(loaded):
    pipe, ctx = loaded(HeliosPyramidT2VPipeline, "tiny/helios-distilled")
    p = pipe.prepare(pipe.params_type(prompt="x"), {})
    assert pipe.distilled and (p.num_inference_steps, p.guidance_scale) == (2, 1.0) and not pipe.guidance_on(p)
    kwargs = pipe.call_kwargs(p)
    assert kwargs["pyramid_num_inference_steps_list"] == [2, 2, 2] and kwargs["is_amplify_first_chunk"]
    assert "num_inference_steps" not in kwargs and pipe.max_batch_size == 1
    assert pipe.size_multiple == 32  # 4x tiny VAE x 2x2 patches x 2^2 pyramid halvings (64 as released)
    with pytest.raises(ValueError, match="guidance_scale must be at most 1.0 for helios-pyramid"):
        pipe.prepare(pipe.params_type(prompt="x", guidance_scale=5.0), {})
    with pytest.raises(ValueError, match="negative_prompt cannot be used by helios-pyramid: Helios-Distilled"):
        pipe.prepare(pipe.params_type(prompt="x", negative_prompt="blurry"), {})
    with pytest.raises(ValueError, match="width must be a multiple of 32"):
        pipe.prepare(pipe.params_type(prompt="x", width=48), {})
    progress: list = []
    ctx.on_progress = lambda done, total: progress.append((done, total))
    _run(pipe, ctx, prompt="a river", seed=2)
    assert progress == [(i, 12) for i in range(1, 13)]  # 3 stages x 2 steps, doubled in the first chunk


def test_helios_mid_runs_cfg_zero_star_with_its_card_defaults(tiny_cache, tmp_path):
    """A Helios-Mid checkpoint: ``HeliosPyramidPipeline`` with ``is_distilled`` false, CFG-Zero* and
    the pyramid ``HeliosScheduler`` (made here from the tiny Distilled one)."""
    from diffusers import HeliosScheduler

    mid = tmp_path / "Helios-Mid"
    shutil.copytree(HeliosPyramidT2VPipeline.checkpoint.ensure(tiny_cache), mid)
    index = json.loads((mid / "model_index.json").read_text())
    index.update(is_distilled=False, is_cfg_zero_star=True, scheduler=["diffusers", "HeliosScheduler"])
    (mid / "model_index.json").write_text(json.dumps(index))
    HeliosScheduler(stages=3).save_config(mid / "scheduler")
    ctx = make_context(tmp_path / "out", dtype="float32")
    pipe = HeliosPyramidT2VPipeline.load(str(mid), ctx)
    p = pipe.prepare(pipe.params_type(prompt="x"), {})
    assert not pipe.distilled and (p.num_inference_steps, p.guidance_scale) == (20, 5.0) and pipe.guidance_on(p)
    assert pipe.call_kwargs(p)["pyramid_num_inference_steps_list"] == [20, 20, 20]
    # 32x32: stage 0 is one patch wide, where diffusers' CFG-Zero* would fail on a non-contiguous view
    plain = _run(pipe, ctx, prompt="a lighthouse", seed=5, num_inference_steps=2)
    negative = _run(pipe, ctx, prompt="a lighthouse", seed=5, num_inference_steps=2, negative_prompt="fog")
    assert plain.shape == (33, 3, 32, 32) and (plain - negative).abs().max() > 1e-3  # it steers


def test_helios_pyramid_serves_singletons_because_merging_changes_each_request(loaded):
    """Why ``max_batch_size = 1``: ``HeliosPyramidPipeline.sample_block_noise`` draws the block noise
    that re-noises each pyramid stage for the whole batch from the first request's generator, so
    a merged request's video depends on its batch mates (Helios-Base has no such step and merges)."""
    pipe, ctx = loaded(HeliosPyramidT2VPipeline, "tiny/helios-distilled")
    fields = dict(width=32, height=32, return_tensor=True)
    items = [
        WorkItem(job_id=f"j{i}", params=pipe.prepare(pipe.params_type(prompt=prompt, seed=i, **fields), {}))
        for i, prompt in enumerate(("a red cat on a mat", "a blue dog, much longer prompt than the first"))
    ]
    alone = [pipe.run([item], ctx)[0].tensors["video"] for item in items]
    with torch.inference_mode():
        merged = pipe.pipe(**pipe.call_args(items), return_dict=False)[0].float()
    for i in range(2):
        assert (merged[i] - alone[i]).abs().max() > 0.01, f"request {i} merged equals its singleton"


def _scheduler_with(gamma: float):
    from types import SimpleNamespace

    return SimpleNamespace(scheduler=SimpleNamespace(config=SimpleNamespace(gamma=gamma)))


def test_pyramid_block_noise_works_at_the_released_gamma_where_diffusers_float32_covariance_is_indefinite():
    """At the released ``gamma = 1/3`` diffusers' float32 covariance has a negative eigenvalue (its
    Cholesky factorization succeeds or fails by the CPU's rounding); ``block_noise`` factors it in
    float64 and draws noise with that covariance. Where float32 is well conditioned (``gamma``
    0.25, the tiny checkpoint's), it equals diffusers' draw within float32 rounding; the served
    pyramid pipeline uses it."""
    from diffusers import HeliosPyramidPipeline

    third = 1 / 3
    float32_cov = torch.eye(4) * (1 + third) - torch.ones(4, 4) * third + torch.eye(4) * 1e-8
    assert torch.linalg.eigvalsh(float32_cov.double()).min() < 0  # diffusers' matrix, not positive definite

    noise = helios.block_noise(_scheduler_with(third), 2, 4, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    assert noise.shape == (2, 4, 3, 64, 64) and noise.dtype == torch.float32
    patches = noise.view(2, 4, 3, 32, 2, 32, 2).permute(0, 1, 2, 3, 5, 4, 6).reshape(-1, 4).double()
    expected = torch.eye(4, dtype=torch.float64) * (1 + third) - third
    torch.testing.assert_close(patches.T @ patches / len(patches), expected, rtol=0, atol=0.02)

    pipe = _scheduler_with(0.25)
    ours = helios.block_noise(pipe, 1, 4, 2, 16, 32, generator=torch.Generator().manual_seed(3))
    theirs = HeliosPyramidPipeline.sample_block_noise(pipe, 1, 4, 2, 16, 32, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_served_pyramid_pipeline_draws_block_noise_in_float64(loaded):
    """The loaded Helios-Distilled pipeline's ``sample_block_noise`` is ``block_noise``: it serves a
    request at the released ``gamma`` (1/3) on any CPU."""
    pipe, ctx = loaded(HeliosPyramidT2VPipeline, "tiny/helios-distilled")
    pipe.pipe.scheduler.register_to_config(gamma=1 / 3)
    try:
        video = _run(pipe, ctx, prompt="a lighthouse", seed=5, num_inference_steps=1)
    finally:
        pipe.pipe.scheduler.register_to_config(gamma=0.25)
    assert video.shape == (33, 3, 32, 32) and torch.isfinite(video).all()
