"""Every message that crosses a socket or a rank boundary, and how it is framed.

A ZeroMQ message is ``[type byte, msgpack body, *payload frames]``. The type byte picks the
one Struct the body decodes to (one typed decoder per type); bulky payloads (uploaded videos,
output files, tensors) travel as extra frames, never inside the body. No pickle anywhere.

This module imports msgspec only; torch is imported lazily by the tensor helpers, so
``tilecast.client`` stays light.
"""

from __future__ import annotations

from typing import Any

import msgspec

PROTOCOL_VERSION = 1


class WireError(ValueError):
    """A message that cannot be decoded (unknown type byte, truncated or mistyped body)."""


# ---------------------------------------------------------------------------------------------
# Client -> server
# ---------------------------------------------------------------------------------------------
class _Msg(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, forbid_unknown_fields=True):
    pass


class SubmitRequest(_Msg):
    req_id: int
    params: dict[str, Any]
    """Request fields as on the CLI (``prompt``, ``width``, ``video_path``, ``sr_resolution_scale``...)."""
    uploads: list[str] = []
    """Names of the uploaded payloads, one extra frame each, in order (``["video"]``)."""
    model: str | None = None
    """Optional model check: refused when the server serves another model."""


class StatusRequest(_Msg):
    req_id: int
    job_id: str


class ResultRequest(_Msg):
    req_id: int
    job_id: str
    wait: bool = True
    """Hold the reply until the job is terminal (otherwise reply with its current state)."""
    as_paths: bool = False
    """Return server-side file paths instead of the file bytes."""


class CancelRequest(_Msg):
    req_id: int
    job_id: str


class DeleteRequest(_Msg):
    """Forget a job: cancel it if queued or running, delete its output files (OpenAI's DELETE)."""

    req_id: int
    job_id: str


class HealthRequest(_Msg):
    req_id: int


class StatsRequest(_Msg):
    req_id: int


class ShutdownRequest(_Msg):
    req_id: int


class LoraRequest(_Msg):
    """LoRA adapters (``scheduler/lora.py``): ``op`` is ``set``, ``merge``, ``unmerge`` or ``list``."""

    req_id: int
    op: str
    nickname: str | None = None
    path: str | None = None
    """A server-side ``.safetensors`` file under ``--lora-dir`` (``set`` only)."""
    strength: float | None = None


# ---------------------------------------------------------------------------------------------
# Server -> client
# ---------------------------------------------------------------------------------------------
class JobInfo(_Msg):
    """A job's state as seen by rank 0."""

    req_id: int
    job_id: str
    state: str
    """queued | running | completed | failed | cancelled"""
    error: str | None = None
    progress: float = 0.0
    """Fraction of the job's work units done, 0..1."""
    queue_position: int | None = None
    created_at: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None


class OutputMeta(_Msg):
    """One output of a job; its data is the matching extra frame unless ``path`` is set."""

    name: str
    kind: str
    """``file`` or ``tensor``."""
    mime: str = ""
    size: int = 0
    path: str | None = None
    """Server-side path (when the caller asked for paths)."""
    dtype: str | None = None
    shape: list[int] = []


class ResultReply(_Msg):
    req_id: int
    job: JobInfo
    outputs: list[OutputMeta] = []
    info: dict[str, Any] = {}


class HealthReply(_Msg):
    req_id: int
    status: str
    """serving | dead | stopping"""
    world_size: int
    model: str
    queue_depth: int = 0
    running: int = 0
    detail: str = ""
    max_message_bytes: int = 0
    """Largest message the server accepts (0: not said); the client checks uploads against it."""


class StatsReply(_Msg):
    req_id: int
    stats: dict[str, Any]


class LoraReply(_Msg):
    req_id: int
    loras: dict[str, Any]
    """``LoraRegistry.listing()`` after the operation."""


class ErrorReply(_Msg):
    req_id: int
    code: str
    """bad_request | overloaded | not_found | gone | forbidden | server_dead | stopping | internal"""
    message: str


# ---------------------------------------------------------------------------------------------
# Rank 0 -> every rank
# ---------------------------------------------------------------------------------------------
class PlanItem(_Msg):
    job_id: str
    params: dict[str, Any]
    uploads: dict[str, bytes] = {}


class Plan(_Msg):
    """One unit of work rank 0 broadcasts; every rank executes it in ``seq`` order."""

    seq: int
    kind: str
    """run | idle | stop"""
    items: list[PlanItem] = []


# ---------------------------------------------------------------------------------------------
# Rank 0 <-> the leaders of the other data-parallel replica groups (runtime/replica_link.py)
# ---------------------------------------------------------------------------------------------
class ReplicaHello(_Msg):
    """A group leader's first message: which group it leads."""

    group: int
    rank: int


class ReplicaCancel(_Msg):
    """Rank 0 -> a leader: every job of running plan ``seq`` was cancelled (stop at a cancel point)."""

    seq: int


class ReplicaProgress(_Msg):
    seq: int
    fraction: float


class ReplicaOutput(_Msg):
    """One item's ``Output`` from a group leader: file paths on the shared filesystem, tensors as frames."""

    files: list[OutputMeta] = []
    tensors: list[OutputMeta] = []
    """One extra frame each, in order (after the frames of the earlier outputs)."""
    info: dict[str, Any] = {}


class ReplicaDone(_Msg):
    """A leader -> rank 0: plan ``seq`` ended ``ok`` (``outputs``), ``cancelled`` or ``failed`` (``error``)."""

    seq: int
    status: str
    error: str | None = None
    outputs: list[ReplicaOutput] = []


# ---------------------------------------------------------------------------------------------
# Framing
# ---------------------------------------------------------------------------------------------
REQUEST_TYPES: dict[bytes, type[msgspec.Struct]] = {
    b"S": SubmitRequest,
    b"Q": StatusRequest,
    b"R": ResultRequest,
    b"C": CancelRequest,
    b"D": DeleteRequest,
    b"H": HealthRequest,
    b"T": StatsRequest,
    b"X": ShutdownRequest,
    b"L": LoraRequest,
}
REPLY_TYPES: dict[bytes, type[msgspec.Struct]] = {
    b"j": JobInfo,
    b"r": ResultReply,
    b"h": HealthReply,
    b"t": StatsReply,
    b"l": LoraReply,
    b"e": ErrorReply,
}
REPLICA_TYPES: dict[bytes, type[msgspec.Struct]] = {
    b"p": Plan,
    b"k": ReplicaCancel,
    b"i": ReplicaHello,
    b"g": ReplicaProgress,
    b"d": ReplicaDone,
}
"""Between rank 0 and the replica group leaders only (never accepted from clients)."""
_ALL_TYPES = {**REQUEST_TYPES, **REPLY_TYPES, **REPLICA_TYPES}
_TYPE_BYTE = {cls: tag for tag, cls in _ALL_TYPES.items()}
_DECODERS = {tag: msgspec.msgpack.Decoder(cls) for tag, cls in _ALL_TYPES.items()}
_ENCODER = msgspec.msgpack.Encoder()
_PLAN_DECODER = msgspec.msgpack.Decoder(Plan)


def encode(msg: msgspec.Struct, *payloads: bytes | memoryview) -> list[bytes | memoryview]:
    """Frames for ``msg`` followed by its payload frames."""
    return [_TYPE_BYTE[type(msg)], _ENCODER.encode(msg), *payloads]


def decode(frames: list[bytes | memoryview], allowed: dict[bytes, type] | None = None) -> tuple[msgspec.Struct, list]:
    """Decode ``[type, body, *payloads]``; ``WireError`` naming what is wrong otherwise."""
    if len(frames) < 2:
        raise WireError(f"expected at least 2 frames (type, body), got {len(frames)}")
    tag = bytes(frames[0])
    if allowed is not None and tag not in allowed:
        raise WireError(f"unknown message type byte {tag!r}")
    decoder = _DECODERS.get(tag)
    if decoder is None:
        raise WireError(f"unknown message type byte {tag!r}")
    try:
        msg = decoder.decode(frames[1])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        name = _ALL_TYPES[tag].__name__
        raise WireError(f"malformed {name}: {exc}") from exc
    return msg, list(frames[2:])


def peek_req_id(frames: list) -> int:
    """Best-effort request id of an undecodable message (0 when unknown), for the error reply."""
    try:
        raw = msgspec.msgpack.decode(frames[1])
        if isinstance(raw, list) and raw and isinstance(raw[0], int):
            return raw[0]
    except Exception:  # noqa: BLE001 - garbage is expected here
        pass
    return 0


def encode_plan(plan: Plan) -> bytes:
    return _ENCODER.encode(plan)


def decode_plan(data: bytes | memoryview) -> Plan:
    return _PLAN_DECODER.decode(data)


# ---------------------------------------------------------------------------------------------
# Tensors as frames (torch imported lazily)
# ---------------------------------------------------------------------------------------------
def tensor_to_frame(name: str, tensor) -> tuple[OutputMeta, memoryview]:
    """Metadata plus a zero-copy view of a contiguous CPU copy of ``tensor``."""
    import torch

    t = tensor.detach().to("cpu").contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    if t.numel() == 0:
        data = memoryview(b"")
    else:
        data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
    meta = OutputMeta(name=name, kind="tensor", size=data.nbytes, dtype=dtype, shape=list(t.shape))
    return meta, data


def frame_to_tensor(meta: OutputMeta, data: bytes | memoryview):
    """Rebuild the tensor described by ``meta`` from its frame (a copy, so the frame may be freed)."""
    import torch

    if meta.dtype is None:
        raise WireError(f"output {meta.name!r} is not a tensor")
    dtype = getattr(torch, meta.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise WireError(f"output {meta.name!r} has unknown dtype {meta.dtype!r}")
    shape = tuple(meta.shape)
    expected = dtype.itemsize
    for dim in shape:
        expected *= dim
    if len(data) != expected:
        raise WireError(f"output {meta.name!r}: {len(data)} bytes for shape {shape} {meta.dtype}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)
