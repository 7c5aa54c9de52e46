"""Synthetic test media: a moving colour pattern with a sine tone, written as a real H.264/AAC MP4.

Used by the demo and the tests (nothing is downloaded).
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import numpy as np

TONE_HZ = 440.0


def pattern_frames(width: int, height: int, num_frames: int) -> np.ndarray:
    """A moving colour pattern: ``(num_frames, height, width, 3)`` uint8."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    frames = []
    for index in range(num_frames):
        phase = index * 0.35
        red = 127.5 + 127.5 * np.sin(x / 7.0 + phase)
        green = 127.5 + 127.5 * np.sin(y / 5.0 - phase * 0.7)
        blue = 127.5 + 127.5 * np.sin((x + y) / 11.0 + phase * 1.3)
        frames.append(np.stack([red, green, blue], axis=-1))
    return np.clip(np.round(np.stack(frames)), 0, 255).astype(np.uint8)


def write_test_video(
    path: Path,
    width: int,
    height: int,
    num_frames: int,
    fps: float,
    audio: bool = True,
    audio_rate: int = 48000,
    stereo: bool = True,
    audio_seconds: float | None = None,
) -> Path:
    """Write a moving colour pattern (+ a 440 Hz sine, ``audio_seconds`` long, by default the
    clip's duration) as H.264/AAC MP4."""
    path = Path(path)
    rate = Fraction(fps).limit_denominator(1001)
    frames = pattern_frames(width, height, num_frames)
    with av.open(str(path), mode="w", format="mp4") as container:
        video = container.add_stream("libx264", rate=rate)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        audio_stream = None
        if audio:
            audio_stream = container.add_stream("aac", rate=audio_rate)
            audio_stream.layout = "stereo" if stereo else "mono"
        for frame_rgb in frames:
            container.mux(video.encode(av.VideoFrame.from_ndarray(frame_rgb, format="rgb24")))
        container.mux(video.encode(None))
        if audio_stream is not None:
            seconds = num_frames / float(rate) if audio_seconds is None else audio_seconds
            num_samples = int(round(seconds * audio_rate))
            t = np.arange(num_samples, dtype=np.float32) / audio_rate
            tone = (0.3 * np.sin(2 * np.pi * TONE_HZ * t)).astype(np.float32)
            channels = 2 if stereo else 1
            planar = np.repeat(tone[None, :], channels, axis=0)
            frame_size = audio_stream.codec_context.frame_size or 1024
            for start in range(0, num_samples, frame_size):
                chunk = np.ascontiguousarray(planar[:, start : start + frame_size])
                frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout="stereo" if stereo else "mono")
                frame.sample_rate = audio_rate
                frame.pts = start
                container.mux(audio_stream.encode(frame))
            container.mux(audio_stream.encode(None))
    return path
