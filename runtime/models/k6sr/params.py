"""Request fields of Kandinsky 6 video super-resolution, and their stand-alone checks.

The video arrives either as ``video_path`` (a file on the server, only under the operator's
``--allowed-video-dir`` roots) or as uploaded bytes in ``uploads["video"]`` (not a field here: the
client sends uploads as extra frames). Checks that need the model or the file live in
``K6SRPipeline.prepare``; the ones here depend on the request alone.
"""

from __future__ import annotations

import datetime
import logging
import re

import msgspec

from tilecast.runtime.models.k6sr.tiling import SUPPORTED_SCALES

logger = logging.getLogger(__name__)

TARGET_PRESETS: dict[str, tuple[int, int]] = {
    "hd": (1280, 720),
    "fullhd": (1920, 1080),
    "2k": (2560, 1440),
}
"""Named ``sr_target_resolution`` boxes, ``(width, height)``."""
RESIZE_MODES = ("fit", "exact")
"""``sr_target_resize_mode`` values: ``fit`` keeps the aspect ratio inside the box, ``exact`` fills it."""
_WXH = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


class SRParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One super-resolution request."""

    video_path: str | None = None
    """Server-side input video; must lie under an ``--allowed-video-dir``. Exclusive with an upload."""
    sr_resolution_scale: float = 2.25
    """Total spatial upscale: 2, 4 or 2.25 (a 1.125x bilinear pre-upscale, then the 2x model)."""
    sr_tiles_batch_size: int = 1
    """Tiles per DiT call. Changes the seeded noise, hence the output; 1 is the reference."""
    sr_tile_min_overlap: float = 0.2
    """Minimum overlap between neighbouring tiles, as a fraction of a tile, in [0, 1)."""
    sr_target_resolution: str | None = None
    """Optional output box: ``hd``, ``fullhd``, ``2k`` or ``WxH``. Only ever downscales."""
    sr_target_resize_mode: str = "fit"
    """``fit`` (keep aspect ratio inside the box) or ``exact`` (resize to the box)."""
    num_inference_steps: int = 2
    """DiT evaluations per tile (the distilled checkpoint uses 2)."""
    seed: int = 42
    """Noise seed; tile chunk starting at tile ``t`` uses ``seed + t``."""
    output_file_name: str | None = None
    """Output file name: 1-128 letters, digits, ``._-`` (``SAFE_FILE_NAME``, checked at submit);
    default ``<stem>_sr<scale>x_<YYYYMMDD-HHMMSS>.mp4`` (``default_output_name``). An existing file
    is never overwritten: a taken name gets ``-2``, ``-3``, ... before ``.mp4`` (``claim_output_path``)."""
    return_frames: bool = False
    """Also return the output frames as a uint8 ``frames`` tensor (F, H, W, 3)."""


def parse_target_resolution(value: str | None) -> tuple[int, int] | None:
    """``sr_target_resolution`` to ``(width, height)``; None when unset."""
    if value is None:
        return None
    key = value.strip().lower()
    if key in TARGET_PRESETS:
        return TARGET_PRESETS[key]
    match = _WXH.match(key)
    if not match:
        raise ValueError(
            f"sr_target_resolution {value!r} is not one of {', '.join(TARGET_PRESETS)} or WIDTHxHEIGHT (e.g. 1280x720)"
        )
    width, height = int(match.group(1)), int(match.group(2))
    if width < 2 or height < 2:
        raise ValueError(f"sr_target_resolution {value!r} must be at least 2x2")
    return width, height


def target_size(width: int, height: int, box: tuple[int, int] | None, mode: str) -> tuple[tuple[int, int], bool]:
    """Final ``(width, height)`` of an output of ``width`` x ``height`` for an optional target box.

    Never upscales: ``fit`` scales by ``min(box_w / width, box_h / height, 1)`` keeping the aspect
    ratio; ``exact`` resizes each axis to ``min(box, size)``. Sizes are rounded to even numbers
    (yuv420p). Also returns whether ``exact`` had to clamp an axis (box larger than the output).
    """
    if mode not in RESIZE_MODES:
        raise ValueError(f"sr_target_resize_mode {mode!r} must be one of {', '.join(RESIZE_MODES)}")
    if box is None:
        return (width, height), False
    box_w, box_h = box
    if mode == "fit":
        factor = min(box_w / width, box_h / height, 1.0)
        new_w, new_h = width * factor, height * factor
        clamped = False
    else:
        new_w, new_h = min(box_w, width), min(box_h, height)
        clamped = box_w > width or box_h > height
    even = lambda v: max(2, int(v) // 2 * 2)  # noqa: E731
    return (even(new_w), even(new_h)), clamped


SAFE_FILE_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
"""What ``output_file_name`` may be, for every model: 1-128 letters, digits, ``.``, ``_``, ``-``
(and not starting with ``.``). Checked at submit, so a bad name never costs a compute."""


def check_output_file_name(name: str | None) -> None:
    """``ValueError`` unless ``name`` is None or a safe plain file name (``SAFE_FILE_NAME``)."""
    if name is None:
        return
    if not isinstance(name, str) or not SAFE_FILE_NAME.match(name) or name.startswith("."):
        shown = name if not isinstance(name, str) or len(name) <= 40 else f"{name[:40]}... ({len(name)} characters)"
        raise ValueError(
            "output_file_name must be 1-128 letters, digits, '.', '_' or '-', not starting with '.' "
            f"(a plain file name: no path separators), got {shown!r}"
        )


def check_request(params: SRParams) -> None:
    """Checks that need nothing but the request; ``ValueError`` naming the bad value."""
    if params.sr_resolution_scale not in SUPPORTED_SCALES:
        raise ValueError(f"sr_resolution_scale must be 2, 2.25 or 4, got {params.sr_resolution_scale}")
    if params.sr_tiles_batch_size < 1:
        raise ValueError(f"sr_tiles_batch_size must be at least 1, got {params.sr_tiles_batch_size}")
    if not 0.0 <= params.sr_tile_min_overlap < 1.0:
        raise ValueError(f"sr_tile_min_overlap must be in [0, 1), got {params.sr_tile_min_overlap}")
    if params.num_inference_steps < 1:
        raise ValueError(f"num_inference_steps must be at least 1, got {params.num_inference_steps}")
    if not 0 <= params.seed < 2**63 - 2**20:
        raise ValueError(f"seed must be a non-negative 63-bit integer, got {params.seed}")
    target_size(16, 16, parse_target_resolution(params.sr_target_resolution), params.sr_target_resize_mode)
    check_output_file_name(params.output_file_name)


def format_scale(scale: float) -> str:
    """2.0 -> ``2``, 2.25 -> ``2.25``."""
    return f"{scale:g}"


def default_output_name(stem: str, params: SRParams, now: datetime.datetime | None = None) -> str:
    """The reference's name: ``<stem>_sr<scale>x_<YYYYMMDD-HHMMSS>.mp4``, the time local and ``now``
    by default, every space of ``stem`` an underscore (``my clip``, x2 -> ``my_clip_sr2x_20250102-030405.mp4``).

    Two jobs in the same second share it: serving writes each job into its own folder, and
    ``claim_output_path`` never lets a flat ``tilecast generate`` directory lose a file to it."""
    when = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    return f"{stem.replace(' ', '_')}_sr{format_scale(params.sr_resolution_scale)}x_{when}.mp4"
