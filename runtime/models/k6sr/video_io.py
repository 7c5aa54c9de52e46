"""Video and audio in and out of the SR pipeline, through PyAV.

Input rules (the reference deployment's, ``kandinsky6-sr.md`` section 6 "Limits"):

- **Frame rate.** A source near 24 fps (``|fps - 24| < NEAR_TARGET_FPS``, i.e. 1.5) keeps every
  frame and is written at ``round(fps)`` (Python's, half to even): 23.976 -> 24, 25 -> 25,
  22.6 -> 23, 24.5 -> 24. A faster source is subsampled to 24 fps: output frame ``k`` is the
  source frame closest to the timestamp ``k / 24`` s. A slower source keeps every frame and its
  native rate (frames are never duplicated).
- **Length.** The selected frames are floored to ``1 + 8k`` (``FRAME_STEP``): 121, 113, ..., 9, 1;
  at most ``MAX_FRAMES`` (121).
- **Audio.** The first audio stream is decoded, resampled to mono 44.1 kHz float and trimmed to
  the processed duration (frames / output fps), padded with silence if the source audio ends
  early. A source without audio gives an output *without an audio stream* ("silent output").

Output: H.264 (``libx264``, ``yuv420p``) plus AAC (mono 44.1 kHz) in MP4.

Shapes: ``frames_FHWC`` uint8 (frames, height, width, RGB); ``audio_S`` float32 mono samples.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import math
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import torch

from tilecast.scheduler.uploads import PinnedFile

logger = logging.getLogger(__name__)

TARGET_FPS = 24
"""Frame rate the model was trained on; faster sources are subsampled to it."""
NEAR_TARGET_FPS = 1.5
"""Sources closer than this (strictly) to ``TARGET_FPS`` keep all their frames, written at ``round(fps)``."""
MAX_FRAMES = 121
"""Most frames processed per request (``1 + 8 * 15``)."""
FRAME_STEP = 8
"""The reference's frame grid: the selected frames are floored to ``1 + FRAME_STEP * k``."""
AUDIO_RATE = 44100
"""Output audio sample rate (mono)."""

VideoSource = str | Path | bytes | PinnedFile
"""A local file path, the bytes of an uploaded file, or a server-side file opened at submit."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class VideoProbe:
    """What ``probe_video`` learned about a source, without decoding all of it."""

    width: int
    """Frame width in pixels."""
    height: int
    """Frame height in pixels."""
    fps: float
    """Average frame rate of the video stream."""
    has_audio: bool
    """Whether the container has an audio stream."""


@dataclasses.dataclass(kw_only=True)
class SourceClip:
    """The frames and audio the pipeline processes, after the input rules above."""

    frames_FHWC: torch.Tensor
    """uint8 RGB frames, ``1 + 8k`` of them (at most 121)."""
    fps: Fraction
    """Output frame rate: 24 (subsampled), ``round(source fps)`` near 24, or a slower source's own rate."""
    audio_S: np.ndarray | None
    """Mono float32 samples at 44.1 kHz covering ``num_frames / fps`` seconds; None without audio."""
    source_fps: float
    """Frame rate of the source stream."""
    source_num_frames: int
    """Source frames decoded (all of them, or up to one past the last frame selection could keep)."""


def require_encoders() -> None:
    """Check that PyAV's FFmpeg has the H.264 (``libx264``) and AAC encoders the output needs."""
    missing = []
    for name in ("libx264", "aac"):
        try:
            av.codec.Codec(name, "w")
        except (av.FFmpegError, ValueError):
            missing.append(name)
    if missing:
        raise RuntimeError(
            f"PyAV's FFmpeg lacks the {', '.join(missing)} encoder(s) needed for MP4 output; "
            "install the PyPI 'av' wheel, which bundles both"
        )


def _open(source: VideoSource):
    if isinstance(source, (bytes, bytearray, memoryview)):
        return av.open(io.BytesIO(bytes(source)), mode="r")
    if isinstance(source, PinnedFile):
        return av.open(source.path, mode="r")
    return av.open(str(source), mode="r")


def _describe(source: VideoSource) -> str:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"the uploaded video ({len(source)} bytes)"
    if isinstance(source, PinnedFile):
        return repr(source.name)
    return str(source)


def _stream_fps(stream) -> float:
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    if not rate:
        raise ValueError("the video stream has no frame rate")
    return float(rate)


def _stream_rate(stream) -> Fraction:
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    return Fraction(rate.numerator, rate.denominator)


def _video_stream(container, name: str):
    if not container.streams.video:
        raise ValueError(f"{name} has no video stream")
    return container.streams.video[0]


def probe_video(source: VideoSource) -> VideoProbe:
    """Open ``source``, check it holds a decodable video stream, and describe it.

    Decodes the first frame so that truncated or corrupt files are refused here, at submit time.
    Raises ``ValueError`` naming the source on any failure.
    """
    name = _describe(source)
    try:
        with _open(source) as container:
            stream = _video_stream(container, name)
            fps = _stream_fps(stream)
            has_audio = bool(container.streams.audio)
            first = next(container.decode(stream), None)
            if first is None:
                raise ValueError(f"{name}: the video stream has no decodable frames")
            return VideoProbe(width=first.width, height=first.height, fps=fps, has_audio=has_audio)
    except (av.FFmpegError, StopIteration, OSError) as exc:
        raise ValueError(f"{name} is not a readable video (not a video file, or truncated/corrupt): {exc}") from exc


def floor_frame_count(num_frames: int) -> int:
    """The most frames of the reference's grid that ``num_frames`` can give: ``1 + 8k``, at most 121."""
    if num_frames < 1:
        raise ValueError(f"need at least one frame, got {num_frames}")
    num_frames = min(num_frames, MAX_FRAMES)
    return 1 + FRAME_STEP * ((num_frames - 1) // FRAME_STEP)


def select_frames(num_source_frames: int, source_fps: float) -> tuple[list[int], Fraction | None]:
    """Pick which source frames to keep; return ``(indices, output_fps)``.

    ``output_fps`` is ``Fraction(24)`` when the source was subsampled, ``Fraction(round(fps))`` when
    it is near 24, and ``None`` when a slower source keeps its own rate (the stream's exact rate,
    which only the container knows). See the module docstring for the rules.
    """
    if num_source_frames < 1:
        raise ValueError(f"the video has no frames (num_source_frames={num_source_frames})")
    if source_fps <= 0:
        raise ValueError(f"source_fps must be positive, got {source_fps}")
    output_fps: Fraction | None
    if abs(source_fps - TARGET_FPS) < NEAR_TARGET_FPS:
        indices = list(range(min(num_source_frames, MAX_FRAMES)))
        output_fps = Fraction(round(source_fps))
    elif source_fps > TARGET_FPS:
        step = source_fps / TARGET_FPS
        indices = []
        for k in range(MAX_FRAMES):
            index = math.floor(k * step + 0.5)
            if index >= num_source_frames:
                break
            indices.append(index)
        output_fps = Fraction(TARGET_FPS)
    else:
        indices = list(range(min(num_source_frames, MAX_FRAMES)))
        output_fps = None
    return indices[: floor_frame_count(len(indices))], output_fps


def _decode_audio(container, duration_s: float) -> np.ndarray | None:
    if not container.streams.audio:
        return None
    stream = container.streams.audio[0]
    resampler = av.AudioResampler(format="flt", layout="mono", rate=AUDIO_RATE)
    chunks: list[np.ndarray] = []
    num_needed = int(round(duration_s * AUDIO_RATE))
    num_have = 0
    for frame in container.decode(stream):
        for out in resampler.resample(frame):
            chunk = out.to_ndarray().reshape(-1)
            chunks.append(chunk)
            num_have += chunk.shape[0]
        if num_have >= num_needed:
            break
    else:
        for out in resampler.resample(None):
            chunks.append(out.to_ndarray().reshape(-1))
    audio = np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)
    if audio.shape[0] < num_needed:
        audio = np.pad(audio, (0, num_needed - audio.shape[0]))
    return audio[:num_needed]


def read_clip(source: VideoSource) -> SourceClip:
    """Decode ``source`` under the input rules: selected RGB frames, output fps, mono 44.1 kHz audio."""
    name = _describe(source)
    try:
        with _open(source) as container:
            stream = _video_stream(container, name)
            source_fps = _stream_fps(stream)
            # The frames a long enough source would keep; the real selection is a prefix of it. Only
            # those are converted to RGB, and decoding stops one frame past the last of them (so
            # the source length is known exactly when it ends earlier).
            candidates = set(select_frames(10**9, source_fps)[0])
            last = max(candidates)
            kept: dict[int, np.ndarray] = {}
            num_decoded = 0
            for index, frame in enumerate(container.decode(stream)):
                if index > last:
                    break
                if index in candidates:
                    kept[index] = frame.to_ndarray(format="rgb24")
                num_decoded = index + 1
            indices, output_fps = select_frames(num_decoded, source_fps)
            fps = output_fps if output_fps is not None else _stream_rate(stream)
            frames_FHWC = torch.from_numpy(np.stack([kept[i] for i in indices]))
            duration_s = len(indices) / float(fps)
        # Reopen for audio: demuxing the video stream above may have consumed audio packets.
        with _open(source) as container:
            audio_S = _decode_audio(container, duration_s)
    except (av.FFmpegError, OSError) as exc:
        raise ValueError(f"{name} could not be decoded: {exc}") from exc
    logger.debug(
        "read %s: %d of %d frames at %.3f fps -> %s fps, audio=%s",
        name,
        len(indices),
        num_decoded,
        source_fps,
        fps,
        audio_S is not None,
    )
    return SourceClip(
        frames_FHWC=frames_FHWC,
        fps=fps,
        audio_S=audio_S,
        source_fps=source_fps,
        source_num_frames=num_decoded,
    )


def write_mp4(
    path: Path,
    frames_FHWC: torch.Tensor,
    fps: Fraction,
    audio_S: np.ndarray | None,
    *,
    crf: int = 18,
) -> None:
    """Encode uint8 RGB frames (+ optional mono 44.1 kHz audio) as H.264/AAC MP4 at ``path``."""
    num_frames, height, width, channels = frames_FHWC.shape
    if channels != 3 or frames_FHWC.dtype != torch.uint8:
        raise ValueError(f"expected uint8 RGB frames, got {frames_FHWC.dtype} with {channels} channels")
    if height % 2 or width % 2:
        raise ValueError(f"yuv420p needs even frame sizes, got {width}x{height}")
    frames = frames_FHWC.cpu().numpy()
    with av.open(str(path), mode="w", format="mp4") as container:
        video = container.add_stream("libx264", rate=fps)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        video.options = {"crf": str(crf), "preset": "medium"}
        audio = None
        if audio_S is not None:
            audio = container.add_stream("aac", rate=AUDIO_RATE)
            audio.layout = "mono"
        for index in range(num_frames):
            frame = av.VideoFrame.from_ndarray(frames[index], format="rgb24")
            container.mux(video.encode(frame))
        container.mux(video.encode(None))
        if audio is not None:
            frame_size = audio.codec_context.frame_size or 1024
            samples = np.ascontiguousarray(audio_S, dtype=np.float32)
            for start in range(0, samples.shape[0], frame_size):
                chunk = samples[start : start + frame_size]
                frame = av.AudioFrame.from_ndarray(chunk[None, :], format="fltp", layout="mono")
                frame.sample_rate = AUDIO_RATE
                frame.pts = start
                container.mux(audio.encode(frame))
            container.mux(audio.encode(None))
