"""LTX-2 / LTX-2.3 text- and image-to-video with audio (``families.ltx2``) on tiny checkpoints, one rank and gloo ranks.

The generic family tests (``tests/test_families.py``, ``tests/test_families_sp.py``, the refusal
matrix and the served row) cover the text-to-video video; here: the MP4's AAC track against the
job's info (decoded with PyAV), the audio of a merged batch and of sequence-parallel ranks against the
singleton one-rank audio, the audio against diffusers' ``LTX2Pipeline`` called directly, the released
ids, the cards' recipes (LTX-2 and an LTX-2.3-configured tiny pipeline: gated attention, prompt
modulation, per-modality connectors, STG through the perturbed attention processor), image-to-video
(per-request first frames in a batch, against ``LTX2ImageToVideoPipeline``), the request checks and
the OpenAI SDK's ``videos.create``.

Measured (fp32, CPU), max abs difference: batched vs singleton video ~1.2e-6 (LTX-2.3 ~1.3e-6,
image-to-video ~1.7e-6), audio ~6e-8..9e-8; 2 SP ranks vs one rank video 2e-6..4.7e-6, audio
~1e-7, the transformer's audio predictions 4e-7..1.7e-6 (0.25 if the video-to-audio partials are
not merged across the ranks).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from fractions import Fraction

import msgspec
import pytest
import torch

from tests.distributed import one_thread, run_ranks
from tests.harness import http_server_config, make_context
from tilecast.runtime.models.families.ltx2 import RECIPES, LTX2Params, LTX2T2VPipeline
from tilecast.runtime.pipeline import WorkItem
from tilecast.runtime.registry import resolve_pipeline

BATCH_TOL = 1e-4
"""Max abs difference between a request's batched (or SP) and singleton fp32 video and audio."""
SMALL = dict(width=64, height=64, num_frames=9, num_inference_steps=2)
"""The smallest request: 2 x 2 latent pixels, 2 latent frames, 9 audio latent frames."""


@pytest.fixture(scope="module")
def ltx(tiny_cache, tmp_path_factory):
    ctx = make_context(tmp_path_factory.mktemp("ltx-2"), dtype="float32")
    return LTX2T2VPipeline.load("tiny/ltx-2", ctx), ctx


def _params(pipe, uploads=None, **fields):
    return pipe.prepare(LTX2Params(**{**SMALL, **fields}), uploads or {})


def _run(pipe, ctx, *params, uploads=()):
    uploads = list(uploads) or [{}] * len(params)
    return pipe.run(
        [WorkItem(job_id=f"j{i}", params=p, uploads=u) for i, (p, u) in enumerate(zip(params, uploads))], ctx
    )


def _png(seed: int, size=(80, 48)) -> bytes:
    """A random RGB picture as PNG bytes (not the output size: the pipeline resizes it)."""
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


# ---- the file --------------------------------------------------------------------------------


def test_mp4_carries_the_audio_as_an_aac_track_of_the_reported_duration(ltx):
    import av

    pipe, ctx = ltx
    out = _run(pipe, ctx, _params(pipe, prompt="waves on a beach", seed=3, fps=25, return_tensor=True))[0]
    info = out.info
    audio = info["audio"]
    assert (info["num_frames"], info["fps"]) == (9, 25)
    assert audio["sample_rate"] == 24000 == pipe.pipe.vocoder.config.output_sampling_rate
    assert audio["channels"] == 2 and audio["samples"] == out.tensors["audio"].shape[1]
    assert audio["duration_s"] == audio["samples"] / 24000 and audio["duration_s"] > 0.2
    assert out.tensors["audio"].abs().max() <= 1.0 and out.tensors["audio"].std() > 0
    with av.open(str(out.files[0].path)) as container:
        video, sound = container.streams.video[0], container.streams.audio[0]
        assert (video.codec_context.name, video.pix_fmt, video.width, video.height) == ("h264", "yuv420p", 64, 64)
        assert video.average_rate == 25
        assert sound.codec_context.name == "aac" and sound.sample_rate == 24000 and sound.channels == 2
        assert sound.duration * sound.time_base == Fraction(audio["samples"], 24000)  # the track as written
        frames = list(container.decode(video=0))
    assert len(frames) == info["num_frames"]
    with av.open(str(out.files[0].path)) as container:
        decoded = sum(frame.samples for frame in container.decode(audio=0))
    assert audio["samples"] <= decoded < audio["samples"] + 2 * 1024  # AAC's priming and last-frame padding


# ---- batch == singleton, and diffusers called directly -----------------------------------------


def test_batched_video_and_audio_match_their_singletons(ltx):
    """The grid's '?' for LTX-2: a merged ``LTX2Pipeline`` call draws each request's video and audio
    noise from its own generator and decodes per sample, so both outputs match the singleton ones
    (video ~1e-6, audio ~1e-7): the family batches."""
    pipe, ctx = ltx
    a = _params(pipe, prompt="a red cat on a mat", seed=1, return_tensor=True)
    b = _params(pipe, prompt="a blue dog, much longer prompt than the first", seed=2, return_tensor=True)
    alone = _run(pipe, ctx, a)[0]
    pair = _run(pipe, ctx, a, b)
    assert pipe.max_batch_size > 1 and pair[0].info["batch_size"] == 2
    for kind in ("video", "audio"):
        diff = (alone.tensors[kind] - pair[0].tensors[kind]).abs().max().item()
        assert diff <= BATCH_TOL, f"{kind}: batched differs from singleton by {diff:.3g}"
        print(f"LTX-2 {kind}: max |batched - singleton| = {diff:.3g}")
        assert (pair[0].tensors[kind] - pair[1].tensors[kind]).abs().max() > 0, kind
    assert (pair[0].tensors["video"] - pair[1].tensors["video"]).abs().max() > 0.01


def test_audio_equals_the_diffusers_pipeline_called_directly(ltx, tiny_cache):
    from diffusers import LTX2Pipeline

    pipe, ctx = ltx
    params = _params(pipe, prompt="a lighthouse at dusk", seed=5, return_tensor=True)
    ours = _run(pipe, ctx, params)[0].tensors
    direct = LTX2Pipeline.from_pretrained(str(LTX2T2VPipeline.checkpoint.ensure(tiny_cache)))
    direct.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        video, audio = direct(
            prompt=params.prompt,
            negative_prompt="",
            width=64,
            height=64,
            num_inference_steps=2,
            max_sequence_length=1024,
            generator=torch.Generator().manual_seed(5),
            output_type="pt",
            return_dict=False,
            **pipe.card_kwargs(params),
        )
    assert (ours["video"] - video[0]).abs().max() <= 1e-5
    assert ours["audio"].shape == audio[0].shape and (ours["audio"] - audio[0].float()).abs().max() <= 1e-5


# ---- routing and the cards ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "model_id",
    ["Lightricks/LTX-2", "Lightricks/LTX-2.3", "diffusers/LTX-2.3-Diffusers", "dg845/LTX-2.3-Diffusers"],
)
def test_released_ltx2_ids_route_to_ltx2(model_id, tmp_path):
    assert resolve_pipeline(str(tmp_path), model_id=model_id) is LTX2T2VPipeline
    renamed = tmp_path / model_id.rpartition("/")[2]  # a directory of another pipeline class, named as released
    renamed.mkdir()
    (renamed / "model_index.json").write_text(json.dumps({"_class_name": "SomeRenamedPipeline"}))
    assert resolve_pipeline(str(renamed)) is LTX2T2VPipeline


def test_ltx2_defaults_follow_its_card(ltx):
    pipe, _ = ltx
    assert pipe.recipe is RECIPES["LTX-2"]
    p = pipe.prepare(LTX2Params(prompt="x"), {})
    assert (p.width, p.height, p.num_frames, p.fps) == (768, 512, 121, 24)
    assert (p.num_inference_steps, p.guidance_scale) == (40, 4.0) and pipe.guidance_on(p)
    kwargs = pipe.call_kwargs(p)
    assert kwargs["max_sequence_length"] == 1024 and kwargs["frame_rate"] == 24.0 and kwargs["num_frames"] == 121
    assert (kwargs["audio_guidance_scale"], kwargs["stg_scale"], kwargs["modality_scale"]) == (4.0, 0.0, 1.0)
    assert (kwargs["guidance_rescale"], kwargs["use_cross_timestep"]) == (0.0, False)
    assert pipe.num_frames_rule == (8, 1) and pipe.size_multiple == 32
    off = pipe.call_kwargs(msgspec.structs.replace(p, guidance_scale=1.0))
    assert (off["guidance_scale"], off["audio_guidance_scale"], off["stg_scale"], off["modality_scale"]) == (
        1.0,
        1.0,
        0.0,
        1.0,
    )
    health, _ = pipe.health_request()
    assert (health["width"], health["height"], health["num_frames"]) == (64, 64, 9)  # not the card's 768 x 512 x 121


def test_fps_conditions_the_model_so_it_is_in_the_batch_key(ltx):
    pipe, ctx = ltx
    a, b = _params(pipe, prompt="x", fps=24), _params(pipe, prompt="y", fps=25)
    assert pipe.batch_key(a) != pipe.batch_key(b)
    assert pipe.batch_key(a) == pipe.batch_key(_params(pipe, prompt="z", seed=9, negative_prompt="blur"))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_frames": 10}, "num_frames must be 8k+1"),
        ({"width": 32}, "width must be at least 64 for ltx-2"),
        ({"height": 80}, "height must be a multiple of 32"),
        ({"max_sequence_length": 100}, "max_sequence_length must be a multiple of 8 for ltx-2"),
        ({"max_sequence_length": 2048}, "max_sequence_length must be in 1..1024"),
        ({"fps": 0}, "fps must be in 1..120"),
        ({"guidance_scale": 1.0, "negative_prompt": "x"}, "negative_prompt cannot be used by ltx-2"),
        ({"output_format": "png"}, "output_format must be one of mp4"),
    ],
)
def test_prepare_refuses_bad_requests_naming_the_field(fields, message, ltx):
    pipe, _ = ltx
    with pytest.raises(ValueError, match=re.escape(message)):
        _params(pipe, prompt="x", **fields)


# ---- image-to-video ------------------------------------------------------------------------------


def test_an_input_image_runs_image_to_video_per_request_in_a_batch(ltx, tiny_cache):
    """A batch whose requests send a first frame runs ``LTX2ImageToVideoPipeline`` over the same
    modules; each request keeps its own image in a merged batch (video ~2e-6, audio ~1e-7 from its
    singleton), equals diffusers' image-to-video pipeline given that one image with its default CRF
    re-compression, and text-only requests do not merge with image ones."""
    import io

    from diffusers import LTX2ImageToVideoPipeline
    from PIL import Image

    pipe, ctx = ltx
    uploads = [{"image.0": _png(1)}, {"image.0": _png(2)}]
    a = _params(pipe, uploads[0], prompt="a red cat on a mat", seed=1, return_tensor=True)
    b = _params(pipe, uploads[1], prompt="a blue dog, much longer prompt than the first", seed=2, return_tensor=True)
    text_only = _params(pipe, prompt="a red cat on a mat", seed=1, return_tensor=True)
    assert a.image_sizes == [[80, 48]] and pipe.batch_key(a) == pipe.batch_key(b) != pipe.batch_key(text_only)
    alone = _run(pipe, ctx, a, uploads=uploads[:1])[0]
    pair = _run(pipe, ctx, a, b, uploads=uploads)
    for kind in ("video", "audio"):
        diff = (alone.tensors[kind] - pair[0].tensors[kind]).abs().max().item()
        assert diff <= BATCH_TOL, f"{kind}: batched differs from singleton by {diff:.3g}"
        print(f"LTX-2 image-to-video {kind}: max |batched - singleton| = {diff:.3g}")
    assert (pair[0].tensors["video"] - pair[1].tensors["video"]).abs().max() > 0.01
    unconditioned = _run(pipe, ctx, text_only)[0].tensors["video"]
    assert (unconditioned - alone.tensors["video"]).abs().max() > 0.01  # the image conditions the video

    direct = LTX2ImageToVideoPipeline.from_pretrained(str(LTX2T2VPipeline.checkpoint.ensure(tiny_cache)))
    direct.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        video, audio = direct(
            image=Image.open(io.BytesIO(uploads[0]["image.0"])),
            prompt=a.prompt,
            negative_prompt="",
            width=64,
            height=64,
            num_inference_steps=2,
            max_sequence_length=1024,
            generator=torch.Generator().manual_seed(1),
            output_type="pt",
            return_dict=False,
            **pipe.card_kwargs(a),
        )
    assert (alone.tensors["video"] - video[0]).abs().max() <= 1e-5
    assert (alone.tensors["audio"] - audio[0].float()).abs().max() <= 1e-5


def test_more_than_one_input_image_is_refused(ltx):
    pipe, _ = ltx
    with pytest.raises(ValueError, match="image"):
        _params(pipe, {"image.0": _png(1), "image.1": _png(2)}, prompt="x")


# ---- LTX-2.3 -----------------------------------------------------------------------------------


def build_tiny_ltx23():
    """``tiny/ltx-2``'s pipeline with LTX-2.3's transformer and connectors: gated attention, prompt
    (cross-attention) modulation, the perturbed-attention processor for STG, per-modality text
    projections in the connectors in place of the transformer's caption projections."""
    from diffusers import LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    from tilecast.runtime.models.families import ltx2

    base = ltx2.build_tiny_ltx2()
    dims = dict(num_attention_heads=2, attention_head_dim=8, audio_num_attention_heads=2, audio_attention_head_dim=8)
    base.transformer = LTX2VideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        cross_attention_dim=16,
        audio_in_channels=8,
        audio_out_channels=8,
        audio_cross_attention_dim=16,
        num_layers=1,
        caption_channels=ltx2.TEXT_DIM,
        rope_type="split",
        gated_attn=True,
        cross_attn_mod=True,
        audio_gated_attn=True,
        audio_cross_attn_mod=True,
        perturbed_attn=True,
        use_prompt_embeddings=False,
        **dims,
    ).eval()
    base.connectors = LTX2TextConnectors(
        caption_channels=ltx2.TEXT_DIM,
        text_proj_in_factor=ltx2.TEXT_LAYERS + 1,
        video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=8,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=ltx2.REGISTERS,
        video_gated_attn=True,
        audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=8,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=ltx2.REGISTERS,
        audio_gated_attn=True,
        rope_type="split",
        per_modality_projections=True,
        video_hidden_dim=16,
        audio_hidden_dim=16,
        proj_bias=True,
    ).eval()
    base.register_modules(transformer=base.transformer, connectors=base.connectors)
    return base


@pytest.fixture(scope="module")
def ltx23_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("models") / "LTX-2.3-Diffusers"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(23)
        build_tiny_ltx23().save_pretrained(str(directory))
    return directory


def _with_stg_at_block_0(pipeline):
    """STG at the tiny transformer's one block (the card's block 28 does not exist in it)."""
    pipeline.recipe = dataclasses.replace(pipeline.recipe, stg_blocks=(0,))
    return pipeline


def test_ltx23_checkpoint_takes_the_23_recipe_and_batches(ltx23_dir, tmp_path):
    ctx = make_context(tmp_path, dtype="float32")
    pipe = LTX2T2VPipeline.load(str(ltx23_dir), ctx)
    assert resolve_pipeline(str(ltx23_dir)) is LTX2T2VPipeline and pipe.recipe is RECIPES["LTX-2.3"]
    p = pipe.prepare(LTX2Params(prompt="x"), {})
    assert (p.num_inference_steps, p.guidance_scale) == (30, 3.0)
    kwargs = pipe.call_kwargs(p)
    assert (kwargs["audio_guidance_scale"], kwargs["stg_scale"], kwargs["modality_scale"]) == (7.0, 1.0, 3.0)
    assert (kwargs["guidance_rescale"], kwargs["spatio_temporal_guidance_blocks"], kwargs["use_cross_timestep"]) == (
        0.7,
        [28],
        True,
    )
    _with_stg_at_block_0(pipe)
    a = _params(pipe, prompt="a red cat on a mat", seed=1, return_tensor=True)
    b = _params(pipe, prompt="a blue dog, much longer prompt than the first", seed=2, return_tensor=True)
    alone = _run(pipe, ctx, a)[0]
    pair = _run(pipe, ctx, a, b)
    for kind in ("video", "audio"):
        diff = (alone.tensors[kind] - pair[0].tensors[kind]).abs().max().item()
        assert diff <= BATCH_TOL, f"{kind}: batched differs from singleton by {diff:.3g}"
        print(f"LTX-2.3 {kind}: max |batched - singleton| = {diff:.3g}")
    no_stg = dataclasses.replace(pipe.recipe, stg_scale=0.0)
    with_stg, pipe.recipe = pipe.recipe, no_stg
    assert (_run(pipe, ctx, a)[0].tensors["video"] - alone.tensors["video"]).abs().max() > 1e-4  # STG acts
    pipe.recipe = with_stg


# ---- sequence parallel: the audio too ------------------------------------------------------------


def _sp_rank(rank, world_size, model, ulysses, ring, cache_dir, output_dir, requests):
    os.environ["TILECAST_CACHE"] = cache_dir
    from tests.test_families_sp import _context
    from tilecast.runtime.topology import Topology

    topology = Topology(num_gpus=world_size, ulysses_degree=ulysses, ring_degree=ring)
    ctx = _context(rank, world_size, output_dir, topology.groups(topology.build_mesh("cpu")), ulysses, ring)
    pipeline = _with_stg_at_block_0(LTX2T2VPipeline.load(model, ctx))
    items = [_item(pipeline, f"j{i}", r) for i, r in enumerate(requests)]
    video, audio = pipeline.generate_outputs(items, ctx)
    return {"video": video, "audio": audio, "audio_predictions": _audio_predictions(pipeline, ctx, requests[0])}


def _audio_predictions(pipeline, ctx, request) -> torch.Tensor:
    """The transformer's audio outputs at every call of ``request`` alone (the decoded audio of the
    tiny vocoder barely moves with them; these carry the video-to-audio attention directly)."""
    calls = []
    hook = pipeline.pipe.transformer.register_forward_hook(lambda module, args, output: calls.append(output[1]))
    try:
        pipeline.generate([_item(pipeline, "p", request)], ctx)
    finally:
        hook.remove()
    return torch.cat(calls).float()  # LTX-2.3: the STG and modality passes run the positive half alone


SP_REQUESTS = [
    dict(prompt="a red cat on a mat", seed=1, width=96, height=96, num_frames=17, num_inference_steps=2),
    dict(
        prompt="a blue dog, with a much longer prompt",
        seed=2,
        width=96,
        height=96,
        num_frames=17,
        num_inference_steps=2,
    ),
]
"""27 video tokens (padded on 2 and 4 ranks), 17 audio tokens whole on every rank."""


def _item(pipeline, job_id: str, request: dict) -> WorkItem:
    """A work item of ``request``; its ``image`` seed, if any, becomes the uploaded first frame."""
    request = dict(request)
    seed = request.pop("image", None)
    uploads = {} if seed is None else {"image.0": _png(seed)}
    return WorkItem(job_id=job_id, params=pipeline.prepare(LTX2Params(**request), uploads), uploads=uploads)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("version", "ulysses", "ring"),
    [("LTX-2", 1, 2), ("LTX-2.3", 2, 1), ("LTX-2 image-to-video", 2, 1)],
    ids=["ltx-2-ring2", "ltx-2.3-ulysses2", "i2v-ulysses2"],
)  # (the video alone on every layout: tests/test_families_sp.py)
def test_sequence_parallel_ranks_match_one_rank_in_video_and_audio(
    version, ulysses, ring, tiny_cache, ltx23_dir, tmp_path
):
    """The video-to-audio attention reads video keys from every rank (merged by log-sum-exp), so the
    audio is checked too; LTX-2.3's STG pass runs the perturbed processor's rule at block 0;
    image-to-video's per-token timestep is split with the video tokens (``ltx2_cp_plan``)."""
    model = str(ltx23_dir) if version == "LTX-2.3" else "tiny/ltx-2"
    requests = [{**r, "image": i + 1} for i, r in enumerate(SP_REQUESTS)] if "image" in version else SP_REQUESTS
    LTX2T2VPipeline.checkpoint.ensure(tiny_cache)
    ctx = make_context(tmp_path / "ref", dtype="float32")
    with one_thread():
        reference = _with_stg_at_block_0(LTX2T2VPipeline.load(model, ctx))
        singles = [reference.generate_outputs([_item(reference, "r", r)], ctx) for r in requests]
        predictions = _audio_predictions(reference, ctx, requests[0])
    results = run_ranks(
        _sp_rank, ulysses * ring, model, ulysses, ring, str(tiny_cache), tmp_path / "sp", requests, timeout=200
    )
    errors = {"video": 0.0, "audio": 0.0, "audio_predictions": 0.0}
    for rank, result in enumerate(results):
        errors["audio_predictions"] = max(
            errors["audio_predictions"], (result["audio_predictions"] - predictions).abs().max().item()
        )
        assert errors["audio_predictions"] <= BATCH_TOL, (version, rank, errors)
        for i, single in enumerate(singles):
            for kind, want in zip(("video", "audio"), single):
                errors[kind] = max(errors[kind], (result[kind][i] - want[0]).abs().max().item())
                assert errors[kind] <= BATCH_TOL, (version, kind, rank, i, errors[kind])
    print(f"{version} ulysses={ulysses} ring={ring}: max |SP - one rank| {errors}")


# ---- over HTTP -----------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_openai_sdk_video_of_one_second_has_25_frames_and_its_soundtrack(tiny_cache, tmp_path):
    """``seconds`` maps onto LTX-2's 8k+1 frames at its 24 fps; the downloaded MP4 holds the audio; an
    image ``input_reference`` is the first frame."""
    import io

    import av
    import openai

    from tilecast.runtime.inproc import InProcessServer

    config = http_server_config("tiny/ltx-2", tmp_path)
    with InProcessServer(config) as server:
        sdk = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=120)
        video = sdk.videos.create_and_poll(
            prompt="rain on a tin roof", model="ltx-2", seconds="1", size="64x64", extra_body={"num_inference_steps": 2}
        )
        assert video.status == "completed" and video.size == "64x64", video
        mapping = video.model_extra["frames_from_seconds"]
        assert (mapping["fps"], mapping["num_frames"]) == (24, 25)
        content = sdk.videos.download_content(video.id).read()
        first_frame = sdk.videos.create_and_poll(  # an image input_reference: image-to-video
            prompt="rain on a tin roof",
            model="ltx-2",
            seconds="1",
            size="64x64",
            input_reference=("first.png", _png(3), "image/png"),
            extra_body={"num_inference_steps": 2},
        )
        assert first_frame.status == "completed", first_frame
        conditioned = sdk.videos.download_content(first_frame.id).read()
    assert conditioned != content
    with av.open(io.BytesIO(content)) as container:
        sound = container.streams.audio[0]
        assert sound.codec_context.name == "aac" and sound.sample_rate == 24000 and sound.channels == 2
        assert 0.9 < float(sound.duration * sound.time_base) < 1.1
        assert sum(1 for _ in container.decode(video=0)) == 25
