"""End to end: real MP4s with real audio through ``K6SRPipeline`` (prepare + run) on the tiny checkpoint.

Clips are kept to one or nine frames and one to four tiles so that the whole file runs in seconds.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import av
import pytest
import torch

from tests.harness import make_context
from tests.media import write_test_video
from tilecast.runtime.models.k6sr.params import SRParams
from tilecast.runtime.models.k6sr.pipeline import K6SRPipeline
from tilecast.runtime.models.k6sr.video_io import AUDIO_RATE, read_clip
from tilecast.runtime.pipeline import WorkItem

STAMP = r"\d{8}-\d{6}"
"""The ``YYYYMMDD-HHMMSS`` of a default output name."""


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module")
def pipe(tmp_path_factory, media_dir) -> K6SRPipeline:
    cache = tmp_path_factory.mktemp("cache")
    ctx = make_context(tmp_path_factory.mktemp("out"), cache_dir=str(cache), allowed_video_dirs=[str(media_dir)])
    pipeline = K6SRPipeline.load("tiny/k6sr", ctx)
    assert (cache / "models" / "tiny-k6sr-v1" / "model_index.json").is_file()
    return pipeline


def submit(pipe: K6SRPipeline, out_dir: Path, params: SRParams, uploads=None, progress=None, flat=False):
    """prepare (rank 0 at submit) then run, as the server does (``flat``: as ``tilecast generate`` does)."""
    uploads = uploads or {}
    params = pipe.prepare(params, uploads)
    ctx = make_context(out_dir)
    ctx.on_progress = progress
    ctx.flat_output = flat
    return pipe.run([WorkItem(job_id="job", params=params, uploads=uploads)], ctx)[0]


def describe_mp4(path: Path) -> dict:
    with av.open(str(path)) as container:
        video = container.streams.video[0]
        info = {"width": video.width, "height": video.height, "codec": video.codec_context.name, "audio": None}
        info["num_frames"] = sum(1 for _ in container.decode(video))
    with av.open(str(path)) as container:
        if container.streams.audio:
            stream = container.streams.audio[0]
            samples = sum(frame.samples for frame in container.decode(stream))
            info["audio"] = {
                "codec": stream.codec_context.name,
                "rate": stream.sample_rate,
                "channels": stream.layout.nb_channels,
                "samples": samples,
            }
    return info


@pytest.mark.parametrize(
    "scale, size, num_frames, expected",
    [(2, (64, 64), 9, (128, 128)), (4, (32, 32), 1, (128, 128)), (2.25, (80, 80), 1, (192, 192))],
)
def test_scales_give_sized_mp4_with_mono_44k_audio(pipe, media_dir, tmp_path, scale, size, num_frames, expected):
    src = write_test_video(media_dir / f"clip_{scale}.mp4", *size, num_frames, 24, audio=True, stereo=True)
    progress = []
    out = submit(
        pipe,
        tmp_path,
        SRParams(video_path=str(src), sr_resolution_scale=scale),
        progress=lambda done, total: progress.append((done, total)),
    )

    assert re.fullmatch(rf"clip_{scale}_sr{scale:g}x_{STAMP}\.mp4", out.files[0].name) and len(out.files) == 1
    assert out.files[0].mime == "video/mp4" and out.files[0].path.parent == tmp_path / "job"  # a folder per job
    mp4 = describe_mp4(out.files[0].path)
    assert (mp4["width"], mp4["height"]) == expected == (out.info["width"], out.info["height"])
    assert mp4["codec"] == "h264" and mp4["num_frames"] == num_frames == out.info["num_frames"]
    assert mp4["audio"]["codec"] == "aac" and mp4["audio"]["rate"] == AUDIO_RATE and mp4["audio"]["channels"] == 1
    # AAC works in 1024-sample frames: the decoded length is the clip's duration rounded up to one.
    duration_samples = num_frames / 24 * AUDIO_RATE
    assert duration_samples <= mp4["audio"]["samples"] <= duration_samples + 2 * 1024
    assert out.info["has_audio"] and out.info["fps"] == 24.0
    assert set(out.info["timings"]) >= {"input", "encode", "denoise", "decode", "output"}
    num_chunks = out.info["num_tiles"]
    assert progress[-1] == (2 * num_chunks, 2 * num_chunks) and len(progress) == 2 * num_chunks


def _decoded(path: Path) -> torch.Tensor:
    with av.open(str(path)) as container:
        return torch.stack([torch.from_numpy(f.to_ndarray(format="rgb24")) for f in container.decode(video=0)])


# (source fps, source frames, with audio) -> (written fps, frames kept). 1 + 8k frames, at most 121.
INPUT_RULE_CASES = {
    "23.976 near 24: every frame, written at 24": ((24000 / 1001, 30, True), (24, 25)),
    "25 near 24: every frame, written at 25, capped at 121": ((25.0, 130, False), (25, 121)),
    "26 faster: subsampled to 24": ((26.0, 40, True), (24, 33)),
    "30 faster: subsampled to 24": ((30.0, 150, True), (24, 113)),
    "12 slower: native rate, 14 -> 9 frames": ((12.0, 14, True), (12, 9)),
    "12 slower: native rate, 17 frames kept": ((12.0, 17, False), (12, 17)),
}


@pytest.mark.parametrize("case", list(INPUT_RULE_CASES))
def test_input_rules_on_generated_clips(media_dir, case):
    (fps, num_frames, audio), (written_fps, kept) = INPUT_RULE_CASES[case]
    src = write_test_video(media_dir / f"rule {fps:.3f} {num_frames}.mp4", 32, 32, num_frames, fps, audio=audio)
    clip = read_clip(src)
    assert abs(clip.source_fps - fps) < 1e-3
    assert clip.fps == written_fps and clip.frames_FHWC.shape == (kept, 32, 32, 3)
    source = _decoded(src)
    if written_fps == 24 and fps > 25.5:  # output frame k is the source frame nearest k / 24 s
        indices = [int(k * fps / 24 + 0.5) for k in range(kept)]
    else:
        indices = list(range(kept))
    assert torch.equal(clip.frames_FHWC, source[indices])
    if audio:  # trimmed to the processed duration: frames / written fps
        assert clip.audio_S.dtype.name == "float32" and clip.audio_S.shape == (round(kept / written_fps * AUDIO_RATE),)
        assert abs(clip.audio_S[-AUDIO_RATE // 100 :]).max() > 0.1  # the tone runs to the end: a trim, not padding
    else:
        assert clip.audio_S is None


def test_short_source_audio_is_padded_with_silence(media_dir):
    src = write_test_video(media_dir / "short_audio.mp4", 32, 32, 17, 24, audio=True, audio_seconds=0.25)
    clip = read_clip(src)
    assert clip.fps == 24 and clip.frames_FHWC.shape[0] == 17
    assert clip.audio_S.shape == (round(17 / 24 * AUDIO_RATE),)
    assert abs(clip.audio_S[: AUDIO_RATE // 5]).max() > 0.1  # the tone, then silence to the clip's end
    assert not clip.audio_S[round(0.3 * AUDIO_RATE) :].any()


def test_source_without_audio_gives_silent_output(pipe, media_dir, tmp_path):
    src = write_test_video(media_dir / "mute.mp4", 64, 64, 1, 24, audio=False)
    out = submit(pipe, tmp_path, SRParams(video_path=str(src), sr_resolution_scale=2))
    assert out.info["has_audio"] is False
    assert describe_mp4(out.files[0].path)["audio"] is None


def test_same_upload_twice_gives_identical_frames(pipe, media_dir, tmp_path):
    data = write_test_video(media_dir / "twice.mp4", 96, 64, 1, 24).read_bytes()
    params = SRParams(sr_resolution_scale=2, return_frames=True, seed=3)
    first = submit(pipe, tmp_path / "a", params, uploads={"video": data})
    second = submit(pipe, tmp_path / "b", params, uploads={"video": data})
    assert first.info["num_tiles"] == 2
    assert first.tensors["frames"].dtype == torch.uint8 and first.tensors["frames"].shape == (1, 128, 192, 3)
    assert torch.equal(first.tensors["frames"], second.tensors["frames"])
    assert first.tensors["frames"].float().std() > 5  # not a constant picture
    assert re.fullmatch(rf"upload_sr2x_{STAMP}\.mp4", first.files[0].name)


def test_default_name_replaces_spaces_and_a_flat_directory_keeps_every_file(pipe, media_dir, tmp_path):
    src = write_test_video(media_dir / "my holiday clip.mp4", 64, 64, 1, 24)
    params = SRParams(video_path=str(src), sr_resolution_scale=2)
    served = submit(pipe, tmp_path / "served", params)
    assert re.fullmatch(rf"my_holiday_clip_sr2x_{STAMP}\.mp4", served.files[0].name)
    assert served.files[0].path == tmp_path / "served" / "job" / served.files[0].name

    # tilecast generate writes into the directory itself: same name (same second, or a rerun of an
    # explicit name) -> the next free suffix, the earlier file untouched
    flat = tmp_path / "flat"
    flat.mkdir()
    name = served.files[0].name
    (flat / name).write_bytes(b"an earlier run")
    (flat / "mine.mp4").write_bytes(b"an earlier run")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("tilecast.runtime.models.k6sr.pipeline.default_output_name", lambda stem, params: name)
        again = submit(pipe, flat, params, flat=True)
    named = [
        submit(pipe, flat, SRParams(video_path=str(src), sr_resolution_scale=2, output_file_name="mine.mp4"), flat=True)
        for _ in range(2)
    ]
    stem = name.removesuffix(".mp4")
    assert again.files[0].path == flat / f"{stem}-2.mp4"
    assert [out.files[0].name for out in named] == ["mine-2.mp4", "mine-3.mp4"]
    assert (flat / name).read_bytes() == (flat / "mine.mp4").read_bytes() == b"an earlier run"
    for out in [again, *named]:
        assert describe_mp4(out.files[0].path)["num_frames"] == 1


@pytest.mark.parametrize(
    "target, mode, expected",
    [("96x96", "fit", (96, 64)), ("100x50", "exact", (100, 50)), ("hd", "fit", (192, 128))],
)
def test_target_resolution_only_downscales(pipe, media_dir, tmp_path, target, mode, expected):
    src = media_dir / "target.mp4"
    if not src.exists():
        write_test_video(src, 96, 64, 1, 24)
    params = SRParams(
        video_path=str(src),
        sr_resolution_scale=2,
        sr_target_resolution=target,
        sr_target_resize_mode=mode,
        output_file_name="custom.mp4",
    )
    out = submit(pipe, tmp_path, params)
    assert out.files[0].name == "custom.mp4" and out.files[0].path == tmp_path / "job" / "custom.mp4"
    mp4 = describe_mp4(out.files[0].path)
    assert (mp4["width"], mp4["height"]) == expected == (out.info["width"], out.info["height"])


# ----------------------------------------------------------------------------- bad input at prepare
def test_prepare_refuses_bad_input(pipe, media_dir, tmp_path):
    good = write_test_video(media_dir / "good.mp4", 64, 64, 1, 24)
    (media_dir / "notes.mp4").write_text("this is not a video")
    data = good.read_bytes()
    (media_dir / "truncated.mp4").write_bytes(data[: len(data) // 2])
    small = write_test_video(media_dir / "small.mp4", 48, 48, 1, 24)
    outside = write_test_video(tmp_path / "outside.mp4", 64, 64, 1, 24)
    os.symlink(outside, media_dir / "escape.mp4")

    cases = [
        (SRParams(video_path=str(media_dir / "notes.mp4")), {}, "not a readable video"),
        (SRParams(video_path=str(media_dir / "truncated.mp4")), {}, "truncated"),
        (SRParams(), {"video": data[: len(data) // 2]}, "uploaded video .* not a readable video"),
        (SRParams(video_path=str(small), sr_resolution_scale=2), {}, r"at least 64x64 .*got 48x48"),
        (SRParams(video_path=str(good), sr_resolution_scale=3.0), {}, "must be 2, 2.25 or 4, got 3.0"),
        (SRParams(video_path=str(good), sr_target_resolution="8k"), {}, "sr_target_resolution '8k'"),
        (SRParams(video_path=str(outside)), {}, "is not allowed"),
        (SRParams(video_path=str(media_dir / ".." / "x.mp4")), {}, "is not allowed"),
        (SRParams(video_path=str(media_dir / "escape.mp4")), {}, "is not allowed"),
        (SRParams(video_path=str(good)), {"video": data}, "not both"),
        (SRParams(), {}, "no input video"),
        (SRParams(video_path=str(good), output_file_name="a/b.mp4"), {}, "path separators"),
    ]
    for params, uploads, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            pipe.prepare(params, uploads)

    resolved = pipe.prepare(SRParams(video_path=str(good)), {})
    assert resolved.video_path == str(good.resolve())


def test_video_path_needs_an_allowed_dir(pipe, media_dir, tmp_path):
    good = write_test_video(media_dir / "good2.mp4", 64, 64, 1, 24)
    no_dirs = K6SRPipeline(pipe.parts, make_context(tmp_path))
    with pytest.raises(ValueError, match="--allowed-video-dir"):
        no_dirs.prepare(SRParams(video_path=str(good)), {})
    assert no_dirs.prepare(SRParams(), {"video": good.read_bytes()}).video_path is None


@pytest.mark.slow  # ~8 s on an idle 2-core CPU (113 frames through the tiny VAE decoder), 20 s+ under load
def test_30fps_150_frame_source_end_to_end(pipe, media_dir, tmp_path):
    src = write_test_video(media_dir / "fast_e2e.mp4", 32, 32, 150, 30, audio=True)
    out = submit(pipe, tmp_path, SRParams(video_path=str(src), sr_resolution_scale=4))
    mp4 = describe_mp4(out.files[0].path)
    assert mp4["num_frames"] == out.info["num_frames"] == 113 and out.info["fps"] == 24.0
    assert (mp4["width"], mp4["height"]) == (128, 128)
    assert 113 / 24 * AUDIO_RATE <= mp4["audio"]["samples"] <= 113 / 24 * AUDIO_RATE + 2 * 1024


def test_bfloat16_runs(tmp_path_factory, media_dir, tmp_path):
    ctx = make_context(
        tmp_path,
        cache_dir=str(tmp_path_factory.mktemp("cache16")),
        dtype="bfloat16",
        allowed_video_dirs=[str(media_dir)],
    )
    pipeline = K6SRPipeline.load("tiny/k6sr", ctx)
    assert pipeline.parts.dtype == torch.bfloat16
    src = write_test_video(media_dir / "bf16.mp4", 32, 32, 1, 24)
    out = submit(pipeline, tmp_path, SRParams(video_path=str(src), sr_resolution_scale=4, return_frames=True))
    assert out.tensors["frames"].shape == (1, 128, 128, 3) and out.tensors["frames"].float().std() > 5


def test_unknown_dtype_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--dtype must be one of float32, bfloat16, float16, got 'float64'"):
        K6SRPipeline.load("tiny/k6sr", make_context(tmp_path, dtype="float64", cache_dir=str(tmp_path)))
