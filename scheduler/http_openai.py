"""OpenAI's (and SGLang-Diffusion's) request fields and response shapes, as pure functions.

The routes in ``http_api`` read a body, hand it here to become scheduler fields, submit, and hand
the results back here to become the JSON a client expects. Nothing here talks to the scheduler.

Field rules (``../shared/reference/openai-api.md`` for the reference's list):

- ``size`` ``"WxH"`` sets ``width``/``height``; ``"auto"``/``""``/absent keeps the model's default.
- Images: ``response_format`` ``url`` (default, as the reference) or ``b64_json``; ``output_format``
  ``png``/``jpeg`` (``null``: the model's default); ``n`` 1..``max_images`` with seeds
  ``seed, seed+1, ...``. ``quality``, ``style``, ``background`` are accepted at their neutral values
  (``NEUTRAL_IMAGE_VALUES``) and any other value is a 400 naming the field; ``user`` is metadata.
- Videos: ``seconds`` becomes ``num_frames`` at the request's (or the model's) ``fps``, rounded to
  the nearest count the model accepts (``frames_for_seconds``); the video object states the
  mapping. ``seconds`` and an explicit ``num_frames`` together are a 400.
"""

from __future__ import annotations

import dataclasses
import math
import re
import secrets
import time
from typing import Any

MAX_WIRE_INT = 2**64 - 1
"""Largest integer the ZeroMQ wire carries (msgpack uint64)."""
IMAGE_RESPONSE_FORMATS = ("url", "b64_json")
"""``response_format`` values; the first is the default (the reference's)."""
NEUTRAL_IMAGE_VALUES: dict[str, tuple[Any, ...]] = {
    "quality": (None, "auto", "standard"),
    "style": (None, "vivid"),
    "background": (None, "auto", "opaque"),
}
"""OpenAI image fields tilecast cannot vary: the values that ask for what it does anyway (an opaque
image of the model's own quality and style). Any other value is refused, never ignored."""
_SIZE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")
STATUS_NAMES = {"running": "in_progress"}
"""Scheduler state -> OpenAI status (queued, in_progress, completed, failed, cancelled)."""
TASK_TYPES = {"t2i": "T2I", "t2v": "T2V", "i2v": "I2V", "i2i": "I2I", "sr": "SR"}
"""tilecast's ``Pipeline.task`` -> the reference's ``task_type``."""


class FieldError(ValueError):
    """A request field with a value tilecast refuses; ``param`` names the field."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def parse_size(value: Any) -> tuple[int, int] | None:
    """``"WxH"`` as ``(width, height)``; ``None`` for ``"auto"``, ``""`` or no value."""
    if value is None or value in ("auto", ""):
        return None
    match = _SIZE.match(value) if isinstance(value, str) else None
    if not match or int(match.group(1)) < 1 or int(match.group(2)) < 1:
        raise FieldError(f"size must be 'WIDTHxHEIGHT' (e.g. '1024x1024') or 'auto', got {value!r}", "size")
    return int(match.group(1)), int(match.group(2))


def apply_size(fields: dict[str, Any]) -> None:
    """Replace ``size`` in ``fields`` by ``width``/``height`` (both given: a 400)."""
    size = parse_size(fields.pop("size", None))
    if size is None:
        return
    for key in ("width", "height"):
        if key in fields:
            raise FieldError(f"give either size or {key}, not both", key)
    fields["width"], fields["height"] = size


def check_neutral(fields: dict[str, Any]) -> None:
    """Drop the fields of ``NEUTRAL_IMAGE_VALUES`` (and ``user``); a non-neutral value is a 400."""
    fields.pop("user", None)
    for name, neutral in NEUTRAL_IMAGE_VALUES.items():
        value = fields.pop(name, None)
        if value not in neutral:
            shown = ", ".join("null" if v is None else repr(v) for v in neutral)
            raise FieldError(f"{name}={value!r} cannot be honoured by tilecast; accepted: {shown}", name)


def frames_for_seconds(seconds: float, fps: int, rule: tuple[int, int] = (1, 0)) -> int:
    """``seconds`` of video at ``fps`` as a frame count of the form ``m*k + r`` (``rule = (m, r)``),
    the nearest one (ties round up), at least the smallest such count above zero."""
    multiple, remainder = rule
    wanted = seconds * fps
    k = max(0, math.floor((wanted - remainder) / multiple + 0.5))
    frames = multiple * k + remainder
    return frames if frames > 0 else multiple + remainder


def apply_seconds(fields: dict[str, Any], *, default_fps: int | None, rule: tuple[int, int]) -> dict | None:
    """Replace ``seconds`` in ``fields`` by ``num_frames``; returns the mapping for the job's record."""
    raw = fields.pop("seconds", None)
    if raw is None or raw == "":
        return None
    try:
        seconds = float(raw)
    except (TypeError, ValueError):
        raise FieldError(f"seconds must be a number, got {raw!r}", "seconds") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise FieldError(f"seconds must be a positive number, got {raw!r}", "seconds")
    if "num_frames" in fields:
        raise FieldError("give either seconds or num_frames, not both", "num_frames")
    if default_fps is None:
        raise FieldError("this model makes no video of a duration: seconds does not apply", "seconds")
    fps = fields.get("fps", default_fps)
    try:
        fps = int(fps)
    except (TypeError, ValueError):
        raise FieldError(f"fps must be an integer, got {fps!r}", "fps") from None
    if fps < 1:
        raise FieldError(f"fps must be >= 1, got {fps}", "fps")
    frames = frames_for_seconds(seconds, fps, rule)
    fields["num_frames"] = frames
    return {"seconds_requested": seconds, "fps": fps, "num_frames": frames, "seconds": round(frames / fps, 3)}


def sr_fields(fields: dict[str, Any], record: "VideoRecord") -> None:
    """OpenAI's video fields for super-resolution: ``prompt`` is accepted and noted as unread,
    ``size`` becomes ``sr_target_resolution`` (the result is scaled down to fit it), and ``seconds``
    is refused (the source video sets the duration)."""
    if fields.pop("prompt", None) is not None:
        record.notes.append("super-resolution does not read the prompt")
    if fields.get("seconds") not in (None, ""):
        raise FieldError("seconds does not apply to super-resolution: the source video sets the duration", "seconds")
    fields.pop("seconds", None)
    size = parse_size(fields.pop("size", None))
    if size is not None:
        if fields.get("sr_target_resolution") is not None:
            raise FieldError("give either size or sr_target_resolution, not both", "sr_target_resolution")
        fields["sr_target_resolution"] = f"{size[0]}x{size[1]}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageRequest:
    """``POST /v1/images/generations`` as scheduler submissions."""

    prompt: str
    response_format: str
    submissions: list[dict[str, Any]]
    """One scheduler request per image (``n`` of them, consecutive seeds)."""


def image_request(body: dict[str, Any], *, max_images: int) -> ImageRequest:
    """Check and map an image request's OpenAI fields (``body`` is consumed)."""
    check_neutral(body)
    prompt = body.pop("prompt", None)
    if not isinstance(prompt, str) or not prompt:
        raise FieldError("prompt must be a non-empty string", "prompt")
    n = body.pop("n", 1)
    n = 1 if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= max_images:
        raise FieldError(f"n must be an integer in 1..{max_images}, got {n!r}", "n")
    response_format = body.pop("response_format", None) or IMAGE_RESPONSE_FORMATS[0]
    if response_format not in IMAGE_RESPONSE_FORMATS:
        raise FieldError(
            f"response_format must be one of {', '.join(IMAGE_RESPONSE_FORMATS)}, got {response_format!r}",
            "response_format",
        )
    if body.get("output_format", "") is None:
        body.pop("output_format")  # null: the model's default format
    apply_size(body)
    seed = body.pop("seed", None)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_WIRE_INT):
        raise FieldError(f"seed must be an integer in 0..2**64-1, got {seed!r}", "seed")
    if seed is not None and seed + n - 1 > MAX_WIRE_INT:
        raise FieldError(f"seed {seed} with n={n}: the images use seeds {seed}..{seed + n - 1}, past 2**64-1", "seed")
    if "video" in body:
        raise FieldError("'video' is not a field of an image request", "video")
    base_seed = seed if seed is not None else secrets.randbelow(2**31)
    submissions = [{**body, "prompt": prompt, "seed": base_seed + index} for index in range(n)]
    return ImageRequest(prompt=prompt, response_format=response_format, submissions=submissions)


def image_response(prompt: str, images: list[dict[str, Any]], infos: list[dict[str, Any]]) -> dict[str, Any]:
    """The images response: ``id``, ``created``, ``data`` (each with ``revised_prompt``), ``usage``
    and tilecast's ``inference_time_s`` (the longest of the batches) and ``peak_memory_mb``."""
    times = [info["inference_time_s"] for info in infos if info.get("inference_time_s") is not None]
    memory = [info["peak_memory_mb"] for info in infos if info.get("peak_memory_mb") is not None]
    return {
        "id": images[0]["id"] if images else None,
        "created": int(time.time()),
        "data": [{k: v for k, v in image.items() if k != "id"} | {"revised_prompt": prompt} for image in images],
        "usage": {  # tilecast meters no tokens: OpenAI's shape, with zeros
            "input_tokens": 0,
            "output_tokens": 0,
            "total_tokens": 0,
            "input_tokens_details": {"text_tokens": 0, "image_tokens": 0},
        },
        "inference_time_s": max(times) if times else None,
        "peak_memory_mb": max(memory) if memory else None,
    }


@dataclasses.dataclass(kw_only=True)
class VideoRecord:
    """What the front end remembers of a video job it created."""

    model: str | None = None
    """The ``model`` the request named (echoed back)."""
    width: int | None = None
    height: int | None = None
    frames: dict[str, Any] | None = None
    """``apply_seconds``'s mapping, when the request gave ``seconds``."""
    notes: list[str] = dataclasses.field(default_factory=list)
    """Facts for the job's info (e.g. a prompt the model does not read)."""
    result: dict[str, Any] | None = None
    """The finished job's result facts (``inference_time_s``, ``peak_memory_mb``, ``num_outputs``)."""


def video_object(
    info, *, model: str | None, record: VideoRecord | None, content_url: str | None, retention_s: float | None
) -> dict[str, Any]:
    """OpenAI's video object for a scheduler job (``info``: ``protocol.JobInfo``)."""
    record = record or VideoRecord()
    error = None
    if info.state in ("failed", "cancelled"):
        error = {"code": info.state, "message": info.error or info.state}
    completed = info.state == "completed"
    finished = int(info.finished_at) if info.finished_at is not None else None
    frames = record.frames or {}
    result = record.result or {}
    return {
        "id": info.job_id,
        "object": "video",
        "model": model,
        "status": STATUS_NAMES.get(info.state, info.state),
        "progress": int(math.floor(max(0.0, min(1.0, info.progress)) * 100 + 1e-9)),
        "created_at": int(info.created_at),
        "started_at": int(info.started_at) if info.started_at is not None else None,
        "completed_at": finished if completed else None,
        "expires_at": finished + int(retention_s) if completed and retention_s is not None else None,
        "queue_position": info.queue_position,
        "size": f"{record.width}x{record.height}" if record.width and record.height else None,
        "seconds": str(frames["seconds"]) if frames else None,
        "quality": "standard",
        "url": content_url if completed else None,
        "remixed_from_video_id": None,
        "error": error,
        "frames_from_seconds": frames or None,
        "notes": record.notes,
        "inference_time_s": result.get("inference_time_s"),
        "peak_memory_mb": result.get("peak_memory_mb"),
        "num_outputs": result.get("num_outputs", 0 if not completed else 1),
    }


def model_card(model, *, created: int) -> dict[str, Any]:
    """A ``GET /v1/models`` entry for ``ModelInfo`` ``model``, with the reference's extra keys."""
    return {
        "id": model.name,
        "object": "model",
        "created": created,
        "owned_by": "tilecast",
        "family": model.family,
        "task": model.task,
        "task_type": TASK_TYPES.get(model.task, model.task.upper()),
        "num_gpus": model.num_gpus,
        "dit_precision": model.precision,
        "vae_precision": model.precision,
        "pipeline_name": model.pipeline_name,
        "pipeline_class": model.pipeline_class,
        "aliases": list(model.aliases),
    }
