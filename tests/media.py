"""Test media: real H.264/AAC MP4s with a moving pattern and a tone (see ``tilecast.runtime.synthetic``)."""

from tilecast.runtime.synthetic import TONE_HZ, pattern_frames, write_test_video  # noqa: F401
