"""The Wan rows of the video grid (issue 22) beyond the registry-driven family tests.

Wan2.1 T2V 14B, Wan2.1 I2V 480P / 720P and Fun 1.3B InP, Wan2.2 T2V / I2V A14B (two experts) and
TI2V 5B, FastWan / TurboWan: released ids route to their family and take their card's defaults;
image-to-video edge cases (no image, too many, an image to a text-only model, first + last frame,
the size from the image's aspect ratio, which requests merge); both experts run, take
``guidance_scale_2``, get the sequence-parallel plan and stay in host memory while idle under
``--cpu-offload-components``; TI2V runs text- and image-to-video, the latter equal to diffusers'
``WanImageToVideoPipeline`` called directly; sparse-attention releases need the dense fallback;
an I2V server takes an image ``input_reference`` from the official openai SDK; FastWan's DMD and
TurboWan's rCM sampling equal the releases' sampling loops written out.

The tiny checkpoints stand in for the released ones: a copy of a tiny checkpoint's folder under a
released name gets that release's defaults (the variant is read from the name), which is how the
card defaults are checked without the weights.
"""

from __future__ import annotations

import json
import logging
import re
import shutil

import msgspec
import pytest
import torch

from tests.harness import http_server_config, make_context
from tilecast.runtime.config import UnsupportedSettingError
from tilecast.runtime.models.families import images
from tilecast.runtime.models.families.wan import WanFamily, WanT2VPipeline
from tilecast.runtime.models.families.wan22 import Wan22I2VPipeline, Wan22T2VPipeline, Wan22TI2VPipeline
from tilecast.runtime.models.families.wan_i2v import WanI2VPipeline
from tilecast.runtime.pipeline import WorkItem
from tilecast.runtime.registry import resolve_pipeline

DENSE = {"allow_dense_attention_fallback": True}
"""The setting that serves a sparse-attention release (FastWan2.1, TurboWan) with dense attention."""
BATCH_TOL = 1e-4
"""Max abs difference between a request's batched and singleton fp32 output (as tests/test_families)."""
FIRST = images.example_image(48, 32)
"""A first frame (a gradient)."""
LAST = images.example_image(32, 48)
"""Another image: a last frame, or a different first frame."""


@pytest.fixture(scope="module")
def loaded(tiny_cache, tmp_path_factory):
    cache: dict = {}

    def get(cls, path: str | None = None, **settings):
        key = (cls, path, tuple(sorted(settings.items())))
        if key not in cache:
            ctx = make_context(tmp_path_factory.mktemp("wan"), dtype="float32", **settings)
            cache[key] = (cls.load(path or cls.builtin_name, ctx), ctx)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def released(tiny_cache, tmp_path_factory):
    """``released(cls, "Wan2.1-T2V-14B-Diffusers")``: a copy of ``cls``'s tiny checkpoint named as released."""
    root = tmp_path_factory.mktemp("released")

    def copy(cls, name: str) -> str:
        target = root / name
        if not target.exists():
            shutil.copytree(cls.checkpoint.ensure(tiny_cache), target)
        return str(target)

    return copy


def uploads(*frames: bytes) -> dict[str, bytes]:
    return dict(zip(images.upload_names(len(frames)), frames))


def prepared(pipe, frames: tuple[bytes, ...] = (), **fields):
    fields = {"prompt": "a kite over a beach", "width": 32, "height": 32, "num_frames": 5, **fields}
    return pipe.prepare(pipe.params_type(**fields), uploads(*frames))


def run(pipe, ctx, *requests):
    """``requests``: ``(params, frames)`` pairs run as one batch; their video tensors."""
    items = [
        WorkItem(job_id=f"j{i}", params=msgspec.structs.replace(p, return_tensor=True), uploads=uploads(*frames))
        for i, (p, frames) in enumerate(requests)
    ]
    return [out.tensors["video"] for out in pipe.run(items, ctx)]


# ---- routing and card defaults -------------------------------------------------------------


@pytest.mark.parametrize(
    ("model_id", "family"),
    [
        ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", WanT2VPipeline),
        ("Wan-AI/Wan2.1-T2V-14B-Diffusers", WanT2VPipeline),
        ("Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", WanI2VPipeline),
        ("Wan-AI/Wan2.1-I2V-14B-720P-Diffusers", WanI2VPipeline),
        ("weizhou03/Wan2.1-Fun-1.3B-InP-Diffusers", WanI2VPipeline),
        ("engineerA314/Wan2.1-Fun-V1.1-1.3B-InP-Diffusers", WanI2VPipeline),
        ("Wan-AI/Wan2.2-T2V-A14B-Diffusers", Wan22T2VPipeline),
        ("Wan-AI/Wan2.2-I2V-A14B-Diffusers", Wan22I2VPipeline),
        ("Wan-AI/Wan2.2-TI2V-5B-Diffusers", Wan22TI2VPipeline),
        ("FastVideo/FastWan2.1-T2V-1.3B-Diffusers", WanT2VPipeline),
        ("FastVideo/FastWan2.2-TI2V-5B-FullAttn-Diffusers", Wan22TI2VPipeline),
        ("TurboDiffusion/TurboWan2.1-T2V-1.3B-480P", WanT2VPipeline),
        ("TurboDiffusion/TurboWan2.1-T2V-14B-480P", WanT2VPipeline),
        ("TurboDiffusion/TurboWan2.1-T2V-14B-720P", WanT2VPipeline),
        ("TurboDiffusion/TurboWan2.2-I2V-A14B-720P", Wan22I2VPipeline),
    ],
)
def test_released_wan_ids_route_to_their_family(model_id, family, tmp_path):
    assert resolve_pipeline(str(tmp_path), model_id=model_id) is family
    name = model_id.rpartition("/")[2]
    renamed = tmp_path / "renamed" / name  # a directory of another pipeline class, named as released
    renamed.mkdir(parents=True)
    (renamed / "model_index.json").write_text(json.dumps({"_class_name": "SomeRenamedPipeline"}))
    assert resolve_pipeline(str(renamed)) is family
    # a directory of the class several Wan families declare: its name picks the family
    shared = tmp_path / "shared" / name
    shared.mkdir(parents=True)
    (shared / "model_index.json").write_text(json.dumps({"_class_name": family.diffusers_class}))
    assert resolve_pipeline(str(shared)) is family


def test_an_unnamed_wan_directory_goes_to_the_first_family_of_its_class(tmp_path):
    for class_name, family in (("WanPipeline", WanT2VPipeline), ("WanImageToVideoPipeline", WanI2VPipeline)):
        folder = tmp_path / class_name / "my-video-model"
        folder.mkdir(parents=True)
        (folder / "model_index.json").write_text(json.dumps({"_class_name": class_name}))
        assert resolve_pipeline(str(folder)) is family


@pytest.mark.parametrize(
    ("cls", "name", "expected"),
    [
        # (width, height, num_frames, fps, steps, guidance, guidance_scale_2, flow_shift)
        (WanT2VPipeline, "Wan2.1-T2V-1.3B-Diffusers", (832, 480, 81, 16, 50, 5.0, None, None)),
        (WanT2VPipeline, "Wan2.1-T2V-14B-Diffusers", (1280, 720, 81, 16, 50, 5.0, None, 5.0)),
        (Wan22T2VPipeline, "Wan2.2-T2V-A14B-Diffusers", (1280, 720, 81, 16, 40, 4.0, 3.0, None)),
        (Wan22TI2VPipeline, "Wan2.2-TI2V-5B-Diffusers", (1280, 704, 121, 24, 50, 5.0, None, None)),
        (Wan22TI2VPipeline, "FastWan2.2-TI2V-5B-FullAttn-Diffusers", (1280, 704, 121, 24, 3, 1.0, None, None)),
        (Wan22I2VPipeline, "Wan2.2-I2V-A14B-Diffusers", (1280, 720, 81, 16, 40, 3.5, 3.5, None)),
    ],
)
def test_released_names_take_their_cards_defaults(cls, name, expected, loaded, released):
    pipe, _ = loaded(cls, released(cls, name))
    frames = uploads(images.example_image(64, 36)) if cls.min_images else {}  # 16:9, the card's 1280 x 720
    p = pipe.prepare(pipe.params_type(prompt="x"), frames)
    got = (p.width, p.height, p.num_frames, p.fps, p.num_inference_steps, p.guidance_scale)
    got += (getattr(p, "guidance_scale_2", None), p.flow_shift)
    assert got == expected  # flow shift None: the scheduler's (the tiny one ships 3, the 480P card's)


def test_wan21_14b_flow_shift_follows_the_resolution(loaded, released):
    pipe, _ = loaded(WanT2VPipeline, released(WanT2VPipeline, "Wan2.1-T2V-14B-Diffusers"))
    p480 = pipe.prepare(pipe.params_type(prompt="x", width=832, height=480), {})
    p720 = pipe.prepare(pipe.params_type(prompt="x"), {})
    assert (p480.flow_shift, p720.flow_shift) == (None, 5.0)  # 3 at 480P is the checkpoint's own
    assert pipe.prepare(pipe.params_type(prompt="x", flow_shift=7.0), {}).flow_shift == 7.0


@pytest.mark.parametrize(
    ("name", "steps", "guidance", "max_images", "size"),
    [
        ("Wan2.1-I2V-14B-480P-Diffusers", 40, 5.0, 1, (832, 480)),
        ("Wan2.1-I2V-14B-720P-Diffusers", 40, 5.0, 1, (1280, 720)),
        ("Wan2.1-Fun-1.3B-InP-Diffusers", 50, 6.0, 2, (832, 480)),
    ],
)
def test_i2v_cards_and_the_size_from_the_images_aspect_ratio(name, steps, guidance, max_images, size, loaded, released):
    pipe, _ = loaded(WanI2VPipeline, released(WanI2VPipeline, name))
    assert pipe.max_images == max_images
    square = pipe.prepare(pipe.params_type(prompt="x"), uploads(images.example_image(64, 64)))
    assert (square.num_inference_steps, square.guidance_scale, square.num_frames) == (steps, guidance, 81)
    area = size[0] * size[1]  # the card's max_area; sides rounded down to 16
    side = int(round(area**0.5)) // 16 * 16
    assert (square.width, square.height) == (side, side)
    wide = pipe.prepare(pipe.params_type(prompt="x"), uploads(images.example_image(64, 36)))
    assert wide.width * wide.height <= area and abs(wide.width / wide.height - 64 / 36) < 0.05
    given = pipe.prepare(pipe.params_type(prompt="x", width=320, height=192), uploads(FIRST))
    assert (given.width, given.height) == (320, 192)  # an explicit size wins


# ---- image-to-video edge cases --------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "frames", "message"),
    [
        (WanI2VPipeline, (), "image: wan2.1-i2v needs an input image"),
        (Wan22I2VPipeline, (), "image: wan2.2-i2v-a14b needs an input image"),
        (WanI2VPipeline, (FIRST, LAST, FIRST), "image: wan2.1-i2v takes at most 2 input image(s); got 3"),
        (Wan22I2VPipeline, (FIRST, LAST), "image: wan2.2-i2v-a14b takes at most 1 input image(s); got 2"),
        (Wan22TI2VPipeline, (FIRST, LAST), "image: wan2.2-ti2v-5b takes at most 1 input image(s); got 2"),
        (WanT2VPipeline, (FIRST,), "image: wan2.1-t2v takes no input image; got 1"),
        (Wan22T2VPipeline, (FIRST,), "image: wan2.2-t2v-a14b takes no input image; got 1"),
    ],
)
def test_image_count_is_checked_naming_the_image(cls, frames, message, loaded):
    pipe, _ = loaded(cls)
    with pytest.raises(ValueError, match=re.escape(message)):
        prepared(pipe, frames)


def test_the_480p_release_takes_one_image_fun_inp_two(loaded, released):
    pipe, _ = loaded(WanI2VPipeline, released(WanI2VPipeline, "Wan2.1-I2V-14B-480P-Diffusers"))
    with pytest.raises(ValueError, match=re.escape("takes at most 1 input image(s); got 2")):
        prepared(pipe, (FIRST, LAST))
    fun, _ = loaded(WanI2VPipeline, released(WanI2VPipeline, "Wan2.1-Fun-1.3B-InP-Diffusers"))
    assert prepared(fun, (FIRST, LAST)).image_sizes == [[48, 32], [32, 48]]


def test_i2v_text_length_is_diffusers_fixed_512(loaded):
    pipe, _ = loaded(WanI2VPipeline)
    assert pipe.call_kwargs(prepared(pipe, (FIRST,)))["max_sequence_length"] == 512
    with pytest.raises(ValueError, match="max_sequence_length must be 512 for wan2.1-i2v"):
        prepared(pipe, (FIRST,), max_sequence_length=64)


def test_first_and_last_frame_condition_the_video_and_clip_sees_the_first(loaded):
    pipe, ctx = loaded(WanI2VPipeline)
    one = prepared(pipe, (FIRST,), seed=3)
    two = prepared(pipe, (FIRST, LAST), seed=3)
    clip_batches = []
    hook = pipe.pipe.image_encoder.register_forward_pre_hook(
        lambda module, args, kwargs: clip_batches.append(kwargs["pixel_values"].shape[0]), with_kwargs=True
    )
    try:
        with_last, alone = run(pipe, ctx, (two, (FIRST, LAST)))[0], run(pipe, ctx, (one, (FIRST,)))[0]
    finally:
        hook.remove()
    assert (with_last - alone).abs().max() > 0.01  # the last frame steers the video
    assert clip_batches == [1, 1]  # CLIP encodes the first frame only (no first/last position embedding)
    other = msgspec.structs.replace(two, prompt="another prompt, same frames", seed=4)
    batched = run(pipe, ctx, (two, (FIRST, LAST)), (other, (FIRST, LAST)))
    assert (batched[0] - with_last).abs().max() <= BATCH_TOL


def test_requests_merge_only_with_the_same_images(loaded):
    pipe, _ = loaded(WanI2VPipeline)
    a, b = prepared(pipe, (FIRST,), seed=1), prepared(pipe, (FIRST,), prompt="other", seed=2)
    assert pipe.batch_key(a) == pipe.batch_key(b)  # diffusers takes one first frame per call
    c = prepared(pipe, (images.example_image(48, 32),), seed=1)
    assert pipe.batch_key(c) == pipe.batch_key(a)  # the same pixels, the same digest
    different = prepared(pipe, (LAST,), width=32, height=32, seed=1)
    assert pipe.batch_key(different) != pipe.batch_key(a)
    assert pipe.batch_key(prepared(pipe, (FIRST, LAST))) != pipe.batch_key(a)


def test_the_input_image_conditions_the_video(loaded):
    pipe, ctx = loaded(WanI2VPipeline)
    a = prepared(pipe, (FIRST,), seed=7)
    b = prepared(pipe, (LAST,), seed=7)
    first, second = run(pipe, ctx, (a, (FIRST,)))[0], run(pipe, ctx, (b, (LAST,)))[0]
    assert (first - second).abs().max() > 0.01


# ---- Wan2.2 A14B: two experts ---------------------------------------------------------------


def _expert_calls(pipe) -> dict[str, list[int]]:
    calls: dict[str, list[int]] = {"transformer": [], "transformer_2": []}
    for name in calls:
        getattr(pipe.pipe, name).register_forward_pre_hook(
            lambda module, args, kwargs, name=name: calls[name].append(1), with_kwargs=True
        )
    return calls


@pytest.mark.parametrize("cls", [Wan22T2VPipeline, Wan22I2VPipeline])
def test_both_experts_denoise_and_guidance_scale_2_is_the_low_noise_ones(cls, loaded):
    pipe, ctx = loaded(cls)
    frames = (FIRST,) if cls.max_images else ()
    assert pipe.two_experts and pipe.pipe.config.boundary_ratio in (0.875, 0.9)
    calls = _expert_calls(pipe)
    base = prepared(pipe, frames, seed=2, num_inference_steps=2)
    out = run(pipe, ctx, (base, frames))[0]
    assert calls["transformer"] and calls["transformer_2"]  # step 1 high noise, step 2 low noise
    low = msgspec.structs.replace(base, guidance_scale_2=1.0)
    assert (run(pipe, ctx, (low, frames))[0] - out).abs().max() > 1e-3
    same = msgspec.structs.replace(base, guidance_scale_2=base.guidance_scale)
    assert (run(pipe, ctx, (same, frames))[0] - out).abs().max() <= BATCH_TOL  # unset: diffusers uses guidance_scale
    assert pipe.batch_key(low) != pipe.batch_key(base)


def test_guidance_scale_2_is_refused_by_one_expert_models(loaded):
    pipe, _ = loaded(WanT2VPipeline)
    with pytest.raises(ValueError, match="guidance_scale_2 cannot be used by wan2.1-t2v: it has one denoising expert"):
        prepared(pipe, guidance_scale_2=3.0)


def test_cpu_offload_keeps_the_idle_expert_in_host_memory(loaded):
    resident, ctx = loaded(Wan22T2VPipeline)
    offloaded, _ = loaded(Wan22T2VPipeline, cpu_offload_components="transformer_2")
    expert = offloaded.pipe.transformer_2
    offload = expert._tilecast_component_offload
    host = [host.data_ptr() for _tensor, host in offload.group.slots]
    seen_during_step = []
    expert.register_forward_pre_hook(lambda *_: seen_during_step.append(offload.on_device))
    params = prepared(resident, seed=5, num_inference_steps=3)
    want = run(resident, ctx, (params, ()))[0]
    got = run(offloaded, ctx, (params, ()))[0]
    assert torch.equal(got, want)
    assert list(offloaded.expert_offload.moves) == ["transformer_2"]  # moved in once for its steps
    assert seen_during_step and all(seen_during_step)
    assert not offload.on_device  # back in host memory after the batch
    assert [tensor.data_ptr() for tensor, _host in offload.group.slots] == host


def test_offloaded_experts_are_loaded_straight_into_host_memory(monkeypatch, tiny_cache, tmp_path):
    moved = []
    original = torch.nn.Module.to
    monkeypatch.setattr(
        torch.nn.Module, "to", lambda self, *a, **k: moved.append(type(self).__name__) or original(self, *a, **k)
    )
    ctx = make_context(tmp_path, dtype="float32", cpu_offload_components="transformer_2")
    assert Wan22T2VPipeline.load_options(ctx) == {"host_components": ("transformer_2",)}
    pipe = Wan22T2VPipeline.load(Wan22T2VPipeline.builtin_name, ctx)
    assert moved.count("WanTransformer3DModel") == 1  # the high-noise expert only; transformer_2 never moved
    assert pipe.pipe._execution_device.type == "cpu"


def test_cpu_offload_of_both_experts_swaps_them(loaded):
    pipe, ctx = loaded(Wan22T2VPipeline, cpu_offload_components="transformer,transformer_2")
    run(pipe, ctx, (prepared(pipe, seed=5, num_inference_steps=3), ()))
    assert list(pipe.expert_offload.moves) == ["transformer", "transformer_2"]
    assert not any(o.on_device for o in pipe.expert_offload.offloads.values())


@pytest.mark.parametrize(
    ("cls", "components", "message"),
    [
        (Wan22T2VPipeline, "vae", "vae cannot be offloaded by wan2.2-t2v-a14b"),
        (WanT2VPipeline, "transformer_2", "the checkpoint has no transformer_2"),
    ],
)
def test_cpu_offload_of_what_a_wan_family_cannot_offload_is_refused(cls, components, message, tiny_cache, tmp_path):
    ctx = make_context(tmp_path, dtype="float32", cpu_offload_components=components)
    with pytest.raises(UnsupportedSettingError, match=re.escape(message)):
        cls.load(cls.builtin_name, ctx)


def test_layerwise_offload_streams_both_experts_blocks_and_keeps_the_output(loaded):
    """``--layerwise-offload-components transformer transformer_2``: every block of both experts is
    a streamed group that comes to the device as it runs; the output is the resident one's."""
    resident, ctx = loaded(Wan22T2VPipeline)
    streamed, _ = loaded(
        Wan22T2VPipeline,
        layerwise_offload_components="transformer,transformer_2",
        dit_offload_prefetch_size=2,
        dit_layerwise_resident_layers=0,
    )
    assert set(streamed.streamers) == {"transformer", "transformer_2"}
    for name, streamer in streamed.streamers.items():
        expert = getattr(streamed.pipe, name)
        assert [group.name for group in streamer.groups] == [f"{name}.blocks.{i}" for i in range(len(expert.blocks))]
    params = prepared(resident, seed=5, num_inference_steps=3)
    want = run(resident, ctx, (params, ()))[0]
    got = run(streamed, ctx, (params, ()))[0]
    assert torch.equal(got, want)
    assert all(group.onloads > 0 for streamer in streamed.streamers.values() for group in streamer.groups)
    assert not any(streamer.onloaded() for streamer in streamed.streamers.values())  # all back on the host


@pytest.mark.parametrize(
    ("cls", "components", "message"),
    [
        (Wan22T2VPipeline, "vae", "vae cannot be streamed by wan2.2-t2v-a14b"),
        (WanT2VPipeline, "transformer_2", "the checkpoint has no transformer_2"),
    ],
)
def test_layerwise_offload_of_what_a_wan_family_cannot_stream_is_refused(
    cls, components, message, tiny_cache, tmp_path
):
    ctx = make_context(tmp_path, dtype="float32", layerwise_offload_components=components)
    with pytest.raises(UnsupportedSettingError, match=re.escape(message)):
        cls.load(cls.builtin_name, ctx)


def test_transformer_2_is_a_known_offload_component_elsewhere_refused():
    from tilecast.runtime.placement_config import parse_components

    assert parse_components("transformer_2, transformer", "--cpu-offload-components") == (
        "transformer",
        "transformer_2",
    )
    assert "transformer_2" not in parse_components("all", "--cpu-offload-components")  # all: K6 SR's


def test_compile_compiles_both_experts(tiny_cache, tmp_path):
    pipe = Wan22T2VPipeline.load(Wan22T2VPipeline.builtin_name, make_context(tmp_path, dtype="float32", compile=True))
    for expert in (pipe.pipe.transformer, pipe.pipe.transformer_2):
        blocks = [m for m in expert.modules() if type(m).__name__ in expert._repeated_blocks]
        assert blocks and all(block._compiled_call_impl is not None for block in blocks)


def _expert_split_ranks(rank, world_size, cache_dir, output_dir) -> dict:
    import os

    os.environ["TILECAST_CACHE"] = cache_dir
    from tests.test_families_sp import _context
    from tilecast.runtime.topology import Topology

    topology = Topology(num_gpus=world_size, ulysses_degree=world_size, ring_degree=1)
    ctx = _context(rank, world_size, output_dir, topology.groups(topology.build_mesh("cpu")), ulysses=world_size)
    pipe = Wan22T2VPipeline.load(Wan22T2VPipeline.builtin_name, ctx)
    lengths = []
    pipe.pipe.transformer_2.blocks[0].register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append(kwargs.get("hidden_states", args[0] if args else None).shape[1]),
        with_kwargs=True,
    )
    params = pipe.prepare(pipe.params_type(prompt="a", width=48, height=48, num_frames=1), {})
    pipe.generate([WorkItem(job_id="j", params=params)], ctx)
    state = pipe.pipe.transformer_2._tilecast_sequence_parallel
    return {"lengths": lengths, "split": state.splits["hidden_states"].true_len}


@pytest.mark.timeout(200)
def test_the_low_noise_expert_runs_sequence_parallel_too(tiny_cache, tmp_path):
    """Both experts get the plan: the low-noise expert's blocks see half of the 9 tokens (padded)."""
    from tests.distributed import run_ranks

    Wan22T2VPipeline.checkpoint.ensure(tiny_cache)
    results = run_ranks(_expert_split_ranks, 2, str(tiny_cache), tmp_path, timeout=150)
    for result in results:
        assert result["split"] == 9 and result["lengths"] and set(result["lengths"]) == {5}


# ---- Wan2.2 TI2V 5B -------------------------------------------------------------------------


def test_ti2v_runs_text_and_image_to_video(loaded, tiny_cache):
    import diffusers

    pipe, ctx = loaded(Wan22TI2VPipeline)
    text = prepared(pipe, seed=4, num_inference_steps=2)
    image = prepared(pipe, (FIRST,), seed=4, num_inference_steps=2)
    assert pipe.batch_key(text) != pipe.batch_key(image)  # never merged: two different diffusers calls
    t2v, i2v = run(pipe, ctx, (text, ()))[0], run(pipe, ctx, (image, (FIRST,)))[0]
    assert (t2v - i2v).abs().max() > 0.01
    other = msgspec.structs.replace(image, prompt="a longer prompt for the second request", seed=9)
    assert (run(pipe, ctx, (image, (FIRST,)), (other, (FIRST,)))[0] - i2v).abs().max() <= BATCH_TOL

    direct = diffusers.WanImageToVideoPipeline.from_pretrained(str(Wan22TI2VPipeline.checkpoint.ensure(tiny_cache)))
    direct.set_progress_bar_config(disable=True)
    assert direct.config.expand_timesteps  # diffusers' TI2V example: the image-to-video class on the same folder
    with torch.inference_mode():
        theirs = direct(
            image=images.load_images(uploads(FIRST))[0],
            prompt=image.prompt,
            negative_prompt="",
            width=32,
            height=32,
            num_frames=5,
            num_inference_steps=2,
            guidance_scale=image.guidance_scale,
            max_sequence_length=Wan22TI2VPipeline.max_sequence_length,
            generator=torch.Generator().manual_seed(4),
            output_type="pt",
            return_dict=False,
        )[0][0].float()
    assert (theirs - i2v).abs().max() <= 1e-5


def test_ti2v_defaults_24_fps_and_honours_the_parallel_decode(loaded, tmp_path):
    pipe, _ = loaded(Wan22TI2VPipeline)
    assert prepared(pipe).fps == 24 and pipe.size_multiple == 32
    with pytest.raises(ValueError, match="width must be a multiple of 32"):
        prepared(pipe, width=48)
    # One rank: honoured, without effect (tests/test_wan_decode.py decodes it on 2 and 4 ranks).
    settings = dict(dtype="float32", vae={"use_parallel_decode": True})
    parallel = Wan22TI2VPipeline.load(Wan22TI2VPipeline.builtin_name, make_context(tmp_path, **settings))
    assert not parallel.parallel_decode


# ---- distilled releases: sparse attention ---------------------------------------------------


def test_sparse_attention_releases_need_the_dense_fallback(loaded, released, tmp_path, caplog):
    path = released(WanT2VPipeline, "FastWan2.1-T2V-1.3B-Diffusers")
    with pytest.raises(
        UnsupportedSettingError, match=r"video sparse attention \(VSA\).*--allow-dense-attention-fallback"
    ):
        WanT2VPipeline.load(path, make_context(tmp_path, dtype="float32"))
    with caplog.at_level(logging.WARNING, logger="tilecast.runtime.models.families.wan"):
        pipe, _ = loaded(WanT2VPipeline, path, **DENSE)
    assert "DENSE attention instead of its video sparse attention" in caplog.text
    p = pipe.prepare(pipe.params_type(prompt="x"), {})
    assert (p.width, p.height, p.num_frames, p.num_inference_steps, p.guidance_scale) == (832, 448, 61, 3, 1.0)
    assert not pipe.guidance_on(p) and pipe.pipe.scheduler.spec.kind == "dmd"
    turbo = released(Wan22I2VPipeline, "TurboWan2.2-I2V-A14B-720P")
    with pytest.raises(UnsupportedSettingError, match=r"SLA \(sparse-linear attention\)"):
        Wan22I2VPipeline.load(turbo, make_context(tmp_path, dtype="float32"))


def test_a_turbowan_pth_folder_is_refused_clearly(tmp_path):
    folder = tmp_path / "TurboWan2.1-T2V-1.3B-480P"
    folder.mkdir()
    (folder / "TurboWan2.1-T2V-1.3B-480P.pth").touch()
    assert resolve_pipeline(str(folder), model_id="TurboDiffusion/TurboWan2.1-T2V-1.3B-480P") is WanT2VPipeline
    ctx = make_context(tmp_path / "out", dtype="float32", allow_dense_attention_fallback=True)
    with pytest.raises(ValueError, match="has no model_index.json: wan2.1-t2v loads diffusers-format Wan checkpoints"):
        WanT2VPipeline.load(str(folder), ctx)


def test_every_wan_family_declares_its_variants_hints():
    for cls in (WanT2VPipeline, WanI2VPipeline, Wan22T2VPipeline, Wan22I2VPipeline, Wan22TI2VPipeline):
        assert issubclass(cls, WanFamily) and cls.model_id_hints == tuple(cls.variants)
        assert cls.fallback_variant in cls.variants


# ---- served ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def i2v_http_server(tiny_cache, tmp_path_factory):
    from tilecast.runtime.inproc import InProcessServer

    config = http_server_config("tiny/wan2.1-i2v-14b-480p", tmp_path_factory.mktemp("out"))
    with InProcessServer(config) as server:
        yield server


@pytest.mark.timeout(300)
def test_openai_sdk_sends_an_image_input_reference_to_an_i2v_server(i2v_http_server, tmp_path):
    import io

    import av
    import openai

    png = tmp_path / "first.png"
    png.write_bytes(FIRST)
    sdk = openai.OpenAI(base_url=f"{i2v_http_server.http_url}/v1", api_key="unused", max_retries=0, timeout=120)
    with png.open("rb") as reference:
        video = sdk.videos.create(
            prompt="the gradient starts to move",
            model="wan2.1-i2v",
            size="32x32",
            input_reference=reference,
            extra_body={"num_frames": 5, "num_inference_steps": 2, "seed": 3},
        )
    while video.status in ("queued", "in_progress"):
        video = sdk.videos.retrieve(video.id)
    assert video.status == "completed", video
    with av.open(io.BytesIO(sdk.videos.download_content(video.id).read())) as container:
        frames = list(container.decode(video=0))
    assert len(frames) == 5 and (frames[0].width, frames[0].height) == (32, 32)
    with pytest.raises(openai.BadRequestError, match="needs an input image"):
        sdk.videos.create(prompt="no image", model="wan2.1-i2v", size="32x32", extra_body={"num_frames": 5})
    import httpx

    health = httpx.get(f"{i2v_http_server.http_url}/health_generate", timeout=120)  # sends the example image
    assert health.status_code == 200 and health.json()["state"] == "completed", health.text


@pytest.mark.timeout(300)
def test_an_image_input_reference_to_a_text_to_video_server_is_a_400(tiny_cache, tmp_path):
    import openai

    from tilecast.runtime.inproc import InProcessServer

    png = tmp_path / "first.png"
    png.write_bytes(FIRST)
    config = http_server_config("tiny/wan2.2-t2v-a14b", tmp_path)
    with InProcessServer(config) as server, png.open("rb") as reference:
        sdk = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="takes no image reference") as refused:
            sdk.videos.create(prompt="x", model="wan2.2-t2v-a14b", size="32x32", input_reference=reference)
    assert refused.value.param == "input_reference"


# ---- FastWan / TurboWan: few-step sampling --------------------------------------------------------------------


def test_fastwan_samples_with_fastvideos_dmd_steps(loaded, released):
    """Diffusers' WanPipeline driving the DMD scheduler equals FastVideo's DMD loop written out: x0
    from the flow prediction at 1000 / 757 / 522, noised again with fresh noise from the request's
    generator, sigmas from the shift-8 training schedule (nearest timestep)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipe, ctx = loaded(WanT2VPipeline, released(WanT2VPipeline, "FastWan2.1-T2V-1.3B-Diffusers"), **DENSE)
    train = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=8.0)

    def sigma(t: int) -> float:
        return float(train.sigmas[(train.timesteps - t).abs().argmin()])

    params = prepared(pipe, seed=11)
    diffusers_kwargs = pipe.call_args([WorkItem(job_id="j", params=params)])
    with torch.inference_mode():
        ours = pipe.pipe(**{**diffusers_kwargs, "output_type": "latent"}, return_dict=False)[0]
        generator = torch.Generator().manual_seed(11)
        embeds, _ = pipe.pipe.encode_prompt(
            params.prompt, do_classifier_free_guidance=False, max_sequence_length=pipe.max_sequence_length
        )
        latents = torch.randn((1, 16, 2, 4, 4), generator=generator)
        for i, t in enumerate((1000, 757, 522)):
            v = pipe.pipe.transformer(
                hidden_states=latents,
                timestep=torch.tensor([float(t)]),
                encoder_hidden_states=embeds,
                return_dict=False,
            )[0]
            x0 = (latents.double() - sigma(t) * v.double()).float()
            if i == 2:
                latents = x0
            else:
                nxt = sigma((757, 522)[i])
                latents = (1 - nxt) * x0 + nxt * torch.randn(latents.shape[1:], generator=generator).unsqueeze(0)
    assert (ours - latents).abs().max() <= 1e-5


def test_fastwan_dmd_batches_and_refuses_other_steps_guidance_and_flow_shift(loaded, released):
    pipe, ctx = loaded(Wan22TI2VPipeline, released(Wan22TI2VPipeline, "FastWan2.2-TI2V-5B-FullAttn-Diffusers"))
    a, b = prepared(pipe, seed=1), prepared(pipe, prompt="a second, longer prompt", seed=2)
    alone = run(pipe, ctx, (a, ()))[0]
    pair = run(pipe, ctx, (a, ()), (b, ()))
    assert (pair[0] - alone).abs().max() <= BATCH_TOL and (pair[1] - alone).abs().max() > 0.01
    image = prepared(pipe, (FIRST,), seed=1)  # image-to-video through the same DMD steps
    assert (run(pipe, ctx, (image, (FIRST,)))[0] - alone).abs().max() > 0.01
    for fields, message in (
        ({"num_inference_steps": 4}, "num_inference_steps must be one of 3 for FastWan2.2-TI2V-5B-FullAttn"),
        ({"guidance_scale": 3.0}, "guidance_scale must be at most 1.0 for FastWan2.2-TI2V-5B-FullAttn"),
        ({"flow_shift": 3.0}, "flow_shift cannot be used by wan2.2-ti2v-5b"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            prepared(pipe, **fields)


@pytest.mark.parametrize("steps", [4, 2])
def test_turbowan_samples_with_turbodiffusions_rcm_steps(steps, loaded, released):
    """Diffusers' WanPipeline driving the rCM scheduler equals TurboDiffusion's loop written out
    (``wan2.1_t2v_infer.py``): TrigFlow times atan(80), 1.5, 1.4, 1.0 as rectified-flow levels, the
    start noise scaled by the first, x0 from the flow prediction, noised again to the next level."""
    import math

    pipe, ctx = loaded(WanT2VPipeline, released(WanT2VPipeline, "TurboWan2.1-T2V-1.3B-480P"), **DENSE)
    params = prepared(pipe, seed=13, num_inference_steps=steps)
    assert pipe.prepare(pipe.params_type(prompt="x"), {}).num_inference_steps == 4
    with torch.inference_mode():
        ours = pipe.pipe(
            **{**pipe.call_args([WorkItem(job_id="j", params=params)]), "output_type": "latent"}, return_dict=False
        )[0]
        generator = torch.Generator().manual_seed(13)
        embeds, _ = pipe.pipe.encode_prompt(
            params.prompt, do_classifier_free_guidance=False, max_sequence_length=pipe.max_sequence_length
        )
        times = torch.tensor([math.atan(80.0), *[1.5, 1.4, 1.0][: steps - 1], 0.0], dtype=torch.float64)
        levels = torch.sin(times) / (torch.cos(times) + torch.sin(times))
        x = torch.randn((1, 16, 2, 4, 4), generator=generator).double() * levels[0]
        for t_cur, t_next in zip(levels[:-1], levels[1:]):
            v = pipe.pipe.transformer(
                hidden_states=x.float(),
                timestep=(t_cur * 1000).float().reshape(1),
                encoder_hidden_states=embeds,
                return_dict=False,
            )[0].double()
            x0 = x - t_cur * v
            x = (
                x0
                if t_next == 0
                else (1 - t_next) * x0 + t_next * torch.randn(x.shape[1:], generator=generator).double()
            )
    assert (ours - x.float()).abs().max() <= 1e-5


def test_turbowan22_i2v_switches_experts_at_the_boundary_and_refuses_five_steps(loaded, released):
    pipe, ctx = loaded(Wan22I2VPipeline, released(Wan22I2VPipeline, "TurboWan2.2-I2V-A14B-720P"), **DENSE)
    calls = _expert_calls(pipe)
    params = prepared(pipe, (FIRST,), seed=2)
    assert (params.num_inference_steps, params.guidance_scale, params.guidance_scale_2) == (4, 1.0, 1.0)
    out = run(pipe, ctx, (params, (FIRST,)))[0]
    # levels 0.99 0.93 | 0.85 0.61: TurboDiffusion's "t < 0.9" switch is diffusers' 1000 t < 900
    assert (len(calls["transformer"]), len(calls["transformer_2"])) == (2, 2)
    other = msgspec.structs.replace(params, prompt="another prompt", seed=3)
    assert (run(pipe, ctx, (params, (FIRST,)), (other, (FIRST,)))[0] - out).abs().max() <= BATCH_TOL
    with pytest.raises(ValueError, match=re.escape("num_inference_steps must be one of 1, 2, 3, 4")):
        prepared(pipe, (FIRST,), num_inference_steps=5)
