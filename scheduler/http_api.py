"""The OpenAI-style HTTP front end: a Starlette app that is one more client of rank 0's scheduler.

It keeps no queue and makes no scheduling decision: every route turns into ``AsyncClient`` calls
on the scheduler's own ZeroMQ endpoint, so HTTP and ZeroMQ clients share one queue, one batcher
and one set of job ids. What it does own: parsing and limits (body size, content types), the
mapping of errors to status codes, the list of jobs created over HTTP, and the metrics it can
measure itself.

Routes::

    POST   /v1/videos                multipart (video_reference=@in.mp4 + fields) or JSON (video_path...)
    GET    /v1/videos                jobs created here, newest first (?limit=20&after=ID)
    GET    /v1/videos/{id}           status, progress (percent), error
    GET    /v1/videos/{id}/content   the MP4 once completed (404 unknown id, 409 not completed)
    DELETE /v1/videos/{id}           delete a job: cancel it if unfinished, remove its files (OpenAI's video.deleted)
    POST   /v1/images/generations    JSON: prompt, n, size "WxH", seed, response_format b64_json, extras
    POST   /v1/images/edits          multipart: image / image[] (input images), prompt, n, size, ... (image models)
    GET    /v1/images/{id}/content   the job's image once completed (?index=K: its K-th, for several layers)

An images request submits ``n`` jobs; ``data`` holds every image file of each, job by job and in each
job's order: one per job, or a Qwen-Image-Layered job's ``layers`` RGBA layers (``n`` x ``layers``
items).
    GET    /v1/models                the served model
    GET    /health                   200 {"status": "ok"} when serving; 503 when dead/stopping/silent
    GET    /metrics                  Prometheus text exposition

Form fields arrive as strings and are converted by the pipeline's ``params_type`` (msgspec,
``strict=False``); JSON fields must already have the right types (``strict=True``, as the
scheduler checks them). A bad value is a 400 whose ``error.param`` names the field. Errors use
OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Metrics and their sources: ``http_metrics``. Running it under uvicorn on rank 0: ``http_server``.

Hardening: with ``api_key`` every route but ``/health`` needs ``Authorization: Bearer <key>`` (401,
counted); JSON bodies are limited to ``MAX_JSON_BYTES`` (413 from Content-Length or while a chunked
body streams), multipart file parts spool to disk past ``UPLOAD_SPOOL_BYTES``; values the wire
cannot carry (integers past 64 bits, lone surrogates) are 400s naming the field; a client that
disconnects while ``/v1/images/generations`` waits gets its jobs cancelled (recorded as 499).

Uploads: the ``video_reference`` part must be ``video/*``; ``application/octet-stream`` (what
curl sends for ``-F f=@x.mp4`` without ``;type=``) and a part without a type are accepted too,
since the pipeline probes the bytes and refuses a non-video with a 400. Any other type is a 415.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import dataclasses
import hmac
import json
import logging
import re
import time
from pathlib import Path
from typing import Any, Callable

import msgspec
from starlette.applications import Starlette
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Match, Route

from tilecast.runtime.models.families.images import MAX_IMAGE_BYTES
from tilecast.scheduler import protocol as P
from tilecast.scheduler.client import AsyncClient, ServerDeadError, ServerError
from tilecast.scheduler.http_metrics import Exposition, FrontEndMetrics, front_end_metrics, scheduler_metrics
from tilecast.scheduler.http_openai import (
    MAX_WIRE_INT,
    STATUS_NAMES,
    FieldError,
    VideoRecord,
    apply_seconds,
    apply_size,
    image_request,
    image_response,
    model_card,
    sr_fields,
    video_object,
)

logger = logging.getLogger(__name__)

VIDEO_PART = "video_reference"
"""Multipart field that carries the uploaded video (sent to the scheduler as the ``video`` upload)."""
REFERENCE_PART = "input_reference"
"""OpenAI's reference file field: a video there is the super-resolution source, as the reference routes it."""
FILE_PARTS = (VIDEO_PART, REFERENCE_PART)
IMAGE_PARTS = ("image", "image[]", "mask")
"""Multipart file fields of ``/v1/images/edits`` (the ``openai`` SDK sends a list of images as ``image[]``)."""
MAX_EDIT_FILES = 17
"""Most file parts an edits request may carry (16 input images and a mask; a model takes fewer)."""
IMAGE_TASKS = ("t2i", "i2i")
"""Tasks ``/v1/images/generations`` serves (an ``i2i`` model that needs an input image refuses it itself)."""
_ACCEPTED_UPLOAD_TYPES = ("application/octet-stream",)
"""Non-``video/*`` part types accepted for ``video_reference`` (the pipeline still probes the bytes)."""
_SERVER_CODES = {
    "bad_request": 400,
    "forbidden": 403,
    "not_found": 404,
    "gone": 410,
    "overloaded": 503,
    "server_dead": 503,
    "stopping": 503,
}
_MSGSPEC_ERROR = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
OPEN_PATHS = frozenset({"/health"})
"""Routes served without the API key (liveness probes)."""
_ZMQ_OVERHEAD_BYTES = 64 * 1024
"""Headroom for the submit message's body next to an uploaded payload (ZMQ_MAXMSGSIZE check)."""
MAX_JSON_BYTES = 2**20
"""Largest JSON request body (1 MiB; a 20,000-character prompt is at most ~120 KB even \\u-escaped). A
larger one is a 413 from its Content-Length, or as soon as a chunked body passes it, never read
whole into memory. Files travel as multipart uploads, under ``--max-upload-mb``."""
UPLOAD_SPOOL_BYTES = 2**20
"""A multipart file part past this size is spooled to a temporary file on disk as it arrives
(starlette's ``SpooledTemporaryFile``), instead of growing in memory."""
MIN_WIRE_INT = -(2**63)
"""Integers outside ``MIN_WIRE_INT..MAX_WIRE_INT`` do not fit the wire (msgpack int64 / uint64): 400."""
POLL_AFTER_MS = 250
"""The poll interval a video object suggests (``openai-poll-after-ms``, read by the SDK's ``poll``)."""
HEALTH_GENERATE_TTL_S = 5.0
"""``GET /health_generate`` answers from its last generation for this long (probes come often)."""
HEALTH_GENERATE_TIMEOUT_S = 120.0
"""How long its one-step generation may take before the answer is 503."""
CLIENT_CLOSED_REQUEST = 499
"""Status recorded (nginx's convention) when the HTTP client went away before its answer."""


# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelInfo:
    """What the front end knows about the served pipeline (rank 0 has it loaded)."""

    name: str
    family: str = ""
    task: str = ""
    """``sr``, ``t2i``, ``t2v`` (empty: unknown, nothing is checked)."""
    params_type: type[msgspec.Struct] | None = None
    """Request fields; form strings are converted by it (None: fields go to the scheduler as sent)."""
    upload_fields: tuple[str, ...] = ()

    num_gpus: int = 1
    """Ranks serving the model (``world_size``)."""
    precision: str = ""
    """The compute dtype (``bfloat16``, ...)."""
    pipeline_name: str = ""
    """tilecast's pipeline class."""
    pipeline_class: str = ""
    """The diffusers pipeline class it serves (or tilecast's own, for K6 SR)."""
    aliases: tuple[str, ...] = ()
    """Names a request's ``model`` may use (the name first, then the family, the model path, ...)."""
    layout: dict[str, int] = dataclasses.field(default_factory=dict)
    """Parallel degrees (``ulysses_degree``, ``ring_degree``, ``tp_size``, ``dp_degree``)."""
    default_fps: int | None = None
    """The ``fps`` request default of a video model (None: no duration, ``seconds`` is refused)."""
    num_frames_rule: tuple[int, int] = (1, 0)
    """Frame counts ``m*k + r`` the model accepts, as ``(m, r)``."""
    health_request: Callable[[], tuple[dict[str, Any], dict[str, bytes]] | None] | None = dataclasses.field(
        default=None, repr=False
    )
    """``Pipeline.health_request``: what ``GET /health_generate`` submits, built on its first call
    (None: 501)."""

    def known_as(self, name: str) -> bool:
        """Whether ``name`` is one of the served model's names."""
        return name in self.aliases or name in (self.name, self.family)

    @classmethod
    def from_pipeline(cls, pipeline, config=None, world_size: int = 1) -> "ModelInfo":
        """What rank 0's loaded ``pipeline`` and the run's ``ServeConfig`` say about the model."""
        params_type = getattr(pipeline, "params_type", None)
        fields = {f.name: f for f in msgspec.structs.fields(params_type)} if params_type is not None else {}
        fps = fields.get("fps")
        names = [pipeline.model_name, getattr(pipeline, "family", "")]
        layout: dict[str, int] = {}
        if config is not None:
            names += [config.model_path, Path(str(config.model_path)).name]
            layout = {
                name: getattr(config, name)
                for name in ("ulysses_degree", "ring_degree", "tp_size", "dp_degree")
                if isinstance(getattr(config, name, None), int)
            }
        return cls(
            name=pipeline.model_name,
            family=getattr(pipeline, "family", ""),
            task=getattr(pipeline, "task", ""),
            params_type=params_type,
            upload_fields=tuple(pipeline.upload_fields),
            num_gpus=world_size,
            precision=config.resolved_dtype if config is not None else "",
            pipeline_name=type(pipeline).__name__,
            pipeline_class=getattr(pipeline, "diffusers_class", None) or type(pipeline).__name__,
            aliases=tuple(dict.fromkeys(name for name in names if name)),
            layout=layout,
            default_fps=fps.default if fps is not None and isinstance(fps.default, int) else None,
            num_frames_rule=tuple(getattr(pipeline, "num_frames_rule", (1, 0))),
            health_request=getattr(pipeline, "health_request", None),
        )


@dataclasses.dataclass(kw_only=True)
class ApiConfig:
    endpoint: str
    """The scheduler's ZeroMQ endpoint (``tcp://127.0.0.1:30010``)."""
    max_upload_bytes: int
    """Largest request body; a larger one gets 413 before it is read (Content-Length, then counted)."""
    max_message_bytes: int | None = None
    """The scheduler's ZMQ_MAXMSGSIZE; an upload that would not fit is refused with 413."""
    model: ModelInfo | None = None
    health_timeout_s: float = 2.0
    """``/health`` and ``/metrics`` give up on the scheduler after this long (503 / ``tilecast_up 0``)."""
    max_listed_jobs: int = 10_000
    """How many HTTP-created video job ids ``GET /v1/videos`` remembers."""
    max_images: int = 10
    """Largest ``n`` of an image request."""
    max_json_bytes: int = MAX_JSON_BYTES
    """Largest JSON request body (``MAX_JSON_BYTES``); uploads have ``max_upload_bytes``."""
    upload_spool_bytes: int = UPLOAD_SPOOL_BYTES
    """Multipart file parts past this size are spooled to disk while they arrive."""
    output_retention_s: float | None = None
    """``--output-retention-s``: a completed video's ``expires_at`` (None: kept until pushed out)."""
    api_key: str | None = dataclasses.field(default=None, repr=False)
    """Every route but ``/health`` needs ``Authorization: Bearer <api_key>`` (None: open); the
    front end also presents it to the scheduler (it is a ZeroMQ client like any other)."""

    def __post_init__(self) -> None:
        if self.max_upload_bytes < 1:
            raise ValueError(f"max_upload_bytes must be >= 1, got {self.max_upload_bytes}")
        if self.max_json_bytes < 1:
            raise ValueError(f"max_json_bytes must be >= 1, got {self.max_json_bytes}")
        if self.health_timeout_s <= 0:
            raise ValueError(f"health_timeout_s must be > 0, got {self.health_timeout_s}")


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------
class ApiError(Exception):
    """An HTTP error with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


class _BodyTooLarge(Exception):
    pass


class _ClientGone(Exception):
    """The HTTP client disconnected while its request was waiting for results."""


def check_wire_values(fields: dict[str, Any]) -> None:
    """400 naming the field for values the ZeroMQ wire cannot carry: integers past 64 bits and
    strings that are not valid Unicode (a lone UTF-16 surrogate such as JSON's ``"\\ud800"``)."""

    def bad(value: Any) -> str | None:
        if isinstance(value, bool):
            return None
        if isinstance(value, int):
            return None if MIN_WIRE_INT <= value <= MAX_WIRE_INT else f"the integer {value} does not fit in 64 bits"
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                return f"not valid Unicode: a lone surrogate {value[exc.start]!r} at character {exc.start}"
            return None
        if isinstance(value, dict):
            return next((why for item in value.items() for why in map(bad, item) if why), None)
        if isinstance(value, (list, tuple)):
            return next((why for why in map(bad, value) if why), None)
        return None

    for name, value in fields.items():
        why = bad(name) or bad(value)
        if why:
            shown = name.encode("utf-8", "backslashreplace").decode("ascii", "replace")
            raise ApiError(400, f"invalid value for {shown!r}: {why}", param=shown, code="invalid_value")


def _merge_extra_body(body: dict[str, Any]) -> dict[str, Any]:
    """SGLang's clients nest extra fields under ``extra_body`` in the JSON; they mean top-level fields."""
    extra = body.pop("extra_body", None)
    return {**body, **extra} if isinstance(extra, dict) else body


@contextlib.contextmanager
def _field_errors():
    """``http_openai.FieldError`` as a 400 naming the field."""
    try:
        yield
    except FieldError as exc:
        raise ApiError(400, str(exc), param=exc.param, code="invalid_value") from None


async def _disconnected(request: Request) -> None:
    """Returns once the client has disconnected (call after the body was read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _from_client_error(exc: Exception) -> ApiError:
    if isinstance(exc, ServerError):
        status = _SERVER_CODES.get(exc.code, 500)
        headers = {"Retry-After": "1"} if exc.code == "overloaded" else None
        return ApiError(status, exc.message, code=exc.code, headers=headers)
    if isinstance(exc, ServerDeadError):
        return ApiError(503, f"the scheduler is not answering: {exc}", code="server_dead")
    if isinstance(exc, TimeoutError):
        return ApiError(504, f"the scheduler did not answer in time: {exc}", code="timeout")
    raise TypeError(exc)


def field_error(exc: msgspec.ValidationError) -> ApiError:
    """A msgspec validation error as a 400 naming the field (``Expected `int`, got `str` - at `$.seed```)."""
    match = _MSGSPEC_ERROR.match(str(exc))
    message, path = match.group("msg"), match.group("path") or ""
    unknown = re.search(r"unknown field `([^`]*)`", message)
    field = unknown.group(1) if unknown else (re.split(r"[.\[]", path.lstrip("."))[0] or None)
    text = f"unknown field {field!r}" if unknown else f"invalid value for {field!r}: {message}" if field else message
    return ApiError(400, text, param=field, code="invalid_value")


def convert_fields(fields: dict[str, Any], params_type: type[msgspec.Struct] | None, *, from_strings: bool) -> dict:
    """Check ``fields`` against the pipeline's params (strings converted when ``from_strings``);
    return only the fields given, with their converted values."""
    if params_type is None:
        return fields
    try:
        params = msgspec.convert(fields, params_type, strict=not from_strings)
    except msgspec.ValidationError as exc:
        raise field_error(exc) from None
    return {name: getattr(params, name) for name in fields}


# ---------------------------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------------------------
def _content_kind(request: Request) -> str:
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media == "multipart/form-data":
        return "multipart"
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return "json"
    raise ApiError(
        415,
        f"unsupported Content-Type {media or '(none)'!r}: send multipart/form-data or application/json",
        code="unsupported_media_type",
    )


class HttpApi:
    """Routes and state of the front end; ``app`` is the ASGI application."""

    def __init__(self, config: ApiConfig) -> None:
        self.config = config
        self.model = config.model
        self.metrics = FrontEndMetrics()
        self.client: AsyncClient | None = None
        self.started_at = int(time.time())
        self._video_ids: collections.OrderedDict[str, VideoRecord] = collections.OrderedDict()
        """Video jobs created here, oldest first, with what the front end knows of each."""
        self._watchers: set[asyncio.Task] = set()
        self._health_generated: tuple[float, int, dict[str, Any]] | None = None
        """The last ``/health_generate`` answer: (monotonic time, status code, body)."""
        self._health_lock: asyncio.Lock | None = None
        self._health_fields: tuple[dict[str, Any], dict[str, bytes]] | None = None
        """``ModelInfo.health_request()``'s answer, once asked for."""
        routes = [
            Route("/v1/videos", self.create_video, methods=["POST"]),
            Route("/v1/videos", self.list_videos, methods=["GET"]),
            Route("/v1/videos/{video_id}", self.get_video, methods=["GET"]),
            Route("/v1/videos/{video_id}", self.delete_video, methods=["DELETE"]),
            Route("/v1/videos/{video_id}/content", self.video_content, methods=["GET"]),
            Route("/v1/images/generations", self.create_images, methods=["POST"]),
            Route("/v1/images/edits", self.edit_images, methods=["POST"]),
            Route("/v1/images/{image_id}/content", self.image_content, methods=["GET"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.get_model, methods=["GET"]),
            Route("/v1/model_info", self.model_info, methods=["GET"]),
            Route("/v1/set_lora", self.set_lora, methods=["POST"]),
            Route("/v1/merge_lora_weights", self.merge_lora, methods=["POST"]),
            Route("/v1/unmerge_lora_weights", self.unmerge_lora, methods=["POST"]),
            Route("/v1/list_loras", self.list_loras, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/health_generate", self.health_generate, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ]
        self._app = Starlette(
            routes=routes,
            lifespan=self._lifespan,
            exception_handlers={
                ApiError: self._on_api_error,
                HTTPException: self._on_http_exception,
                ServerError: self._on_client_error,
                ServerDeadError: self._on_client_error,
                TimeoutError: self._on_client_error,
                Exception: self._on_unexpected,
            },
        )
        self.routes = routes

    # ------------------------------------------------------------------ ASGI plumbing
    async def __call__(self, scope, receive, send) -> None:
        """Check the API key, then count every HTTP request by route template and status."""
        if scope["type"] != "http":
            return await self._app(scope, receive, send)
        started, status = time.perf_counter(), [500]

        async def send_counting(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self._authorized(scope):
                await self._app(scope, receive, send_counting)
            else:
                self.metrics.unauthorized += 1
                await self._unauthorized(scope)(scope, receive, send_counting)
        finally:
            self.metrics.http(scope["method"], self._route_of(scope), status[0], time.perf_counter() - started)

    def _authorized(self, scope) -> bool:
        """Whether the request may pass: no key configured, ``/health``, or the right Bearer token."""
        key = self.config.api_key
        if key is None or scope["path"] in OPEN_PATHS:
            return True
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())

    @staticmethod
    def _unauthorized(scope) -> Response:
        given = any(name == b"authorization" for name, _ in scope["headers"])
        message = (
            "Incorrect API key provided"
            if given
            else "Missing API key: send 'Authorization: Bearer <key>' (the server's --api-key)"
        )
        response = ApiError(401, message, code="invalid_api_key").response()
        response.headers["WWW-Authenticate"] = "Bearer"
        return response

    def _route_of(self, scope) -> str:
        for route in self.routes:
            match, _ = route.matches(scope)
            if match != Match.NONE:
                return route.path
        return "other"

    @contextlib.asynccontextmanager
    async def _lifespan(self, _app):
        self.client = AsyncClient(self.config.endpoint, timeout=30.0, api_key=self.config.api_key)
        try:
            yield
        finally:
            for task in list(self._watchers):
                task.cancel()
            await self.client.close()

    async def _on_api_error(self, _request: Request, exc: ApiError) -> Response:
        return exc.response()

    async def _on_http_exception(self, _request: Request, exc: HTTPException) -> Response:
        return ApiError(exc.status_code, str(exc.detail)).response()

    async def _on_client_error(self, _request: Request, exc: Exception) -> Response:
        return _from_client_error(exc).response()

    async def _on_unexpected(self, _request: Request, exc: Exception) -> Response:
        logger.exception("HTTP front end: unexpected error")
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal").response()

    # ------------------------------------------------------------------ body reading
    def _limited(self, request: Request, limit: int, too_large) -> Request:
        """413 (``too_large(size)``) at once on a Content-Length over ``limit``; otherwise a request
        whose body is counted as it streams and refused (``_BodyTooLarge``) once it passes ``limit``."""
        raw = request.headers.get("content-length")
        if raw is not None:
            try:
                declared = int(raw)
            except ValueError:
                raise ApiError(400, f"invalid Content-Length {raw!r}") from None
            if declared > limit:
                raise too_large(declared)
        received = 0

        async def receive():
            nonlocal received
            message = await request.receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _BodyTooLarge()
            return message

        return Request(request.scope, receive)

    def _too_large(self, size: int | None = None) -> ApiError:
        limit_mb = self.config.max_upload_bytes / 2**20
        what = f"{size} bytes" if size is not None else "the request body"
        return ApiError(
            413, f"{what} exceeds the upload limit of {limit_mb:g} MiB (--max-upload-mb)", code="payload_too_large"
        )

    def _json_too_large(self, size: int | None = None) -> ApiError:
        limit = self.config.max_json_bytes
        what = f"the {size}-byte JSON body" if size is not None else "the JSON body"
        return ApiError(
            413,
            f"{what} exceeds the {limit / 2**20:g} MiB ({limit} bytes) limit of JSON requests;"
            " send files as multipart/form-data uploads",
            code="payload_too_large",
        )

    async def _read_json(self, request: Request) -> dict[str, Any]:
        try:
            body = await self._limited(request, self.config.max_json_bytes, self._json_too_large).body()
        except _BodyTooLarge:
            raise self._json_too_large() from None

        def no_constant(name: str):
            raise ValueError(f"{name} is not a JSON number")

        try:
            data = json.loads(body, parse_constant=no_constant)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ApiError(400, f"malformed JSON body: {exc}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise ApiError(400, f"the JSON body must be an object, got {type(data).__name__}", code="invalid_json")
        return data

    async def _read_form(
        self, request: Request, file_parts: tuple[str, ...], *, max_files: int, hint: str
    ) -> tuple[dict[str, str], list[tuple[str, str, bytes]]]:
        """A multipart form's fields and its file parts as ``(part name, media type, bytes)`` in
        order. The body is counted as it arrives (413 past ``--max-upload-mb``) and a file part past
        ``upload_spool_bytes`` is spooled to disk; only a complete, accepted body is read into memory.
        A file under another name than ``file_parts`` is a 400 with ``hint``."""
        limited = self._limited(request, self.config.max_upload_bytes, self._too_large)
        parser = MultiPartParser(limited.headers, limited.stream(), max_files=max_files, max_fields=64)
        parser.spool_max_size = self.config.upload_spool_bytes
        try:
            form = await parser.parse()
        except _BodyTooLarge:
            raise self._too_large() from None
        except MultiPartException as exc:
            raise ApiError(400, f"malformed multipart body: {exc.message}", code="invalid_multipart") from None
        try:
            fields: dict[str, str] = {}
            files: list[tuple[str, str, bytes]] = []
            for name, value in form.multi_items():
                if isinstance(value, UploadFile):
                    if name not in file_parts:
                        raise ApiError(
                            400, f"unexpected file field {name!r} ({hint})", param=name, code="unknown_field"
                        )
                    media = (value.content_type or "").split(";", 1)[0].strip().lower()
                    files.append((name, media, await value.read()))
                elif name in file_parts:
                    raise ApiError(
                        400, f"{name} must be a file part (curl -F '{name}=@file')", param=name, code="invalid_value"
                    )
                elif name in fields:
                    raise ApiError(400, f"field {name!r} is given more than once", param=name, code="duplicate_field")
                else:
                    fields[name] = value
            return fields, files
        finally:
            await form.close()

    async def _read_multipart(self, request: Request) -> tuple[dict[str, str], tuple[str, str, bytes] | None]:
        """A video request's form fields and its one reference file, ``(part, media type, bytes)``
        (``video_reference`` or ``input_reference``)."""
        fields, files = await self._read_form(
            request, FILE_PARTS, max_files=len(FILE_PARTS) + 1, hint=f"upload the video as {VIDEO_PART!r}"
        )
        if len(files) > 1:
            name = files[1][0]
            raise ApiError(400, f"field {name!r} is given more than once", param=name, code="duplicate_field")
        return fields, (files[0] if files else None)

    def _reference(self, fields: dict[str, Any], reference: tuple[str, str, bytes]) -> None:
        """Put a video request's reference file into ``fields``: an image (``image/*``, or any
        ``input_reference`` of a model that takes images) is the model's input image, anything
        else the video upload (K6 SR's source). A type the model cannot take is a 400 / 415."""
        name, media, data = reference
        takes_image = self.model is not None and "image" in self.model.upload_fields
        if media.startswith("image/") or (takes_image and name == REFERENCE_PART and not media.startswith("video/")):
            if not takes_image:
                raise ApiError(
                    400,
                    f"{self._model_name() or 'this model'} takes no image reference: {name!r} must be a video",
                    param=name,
                    code="unsupported_input",
                )
            if len(data) > MAX_IMAGE_BYTES:
                raise ApiError(
                    413,
                    f"{name} is {len(data) / 2**20:.1f} MiB; at most {MAX_IMAGE_BYTES / 2**20:g} MiB per image",
                    param=name,
                    code="payload_too_large",
                )
            fields["image"] = [data]
            return
        if media and not media.startswith("video/") and media not in _ACCEPTED_UPLOAD_TYPES:
            raise ApiError(
                415,
                f"{name} has Content-Type {media!r}; expected video/* (e.g. video/mp4)",
                param=name,
                code="unsupported_media_type",
            )
        if self.model is not None and "video" not in self.model.upload_fields:
            raise ApiError(400, f"{self.model.name} takes no video upload", param=VIDEO_PART, code="unknown_field")
        self._check_upload_size(len(data))
        fields["video"] = data

    # ------------------------------------------------------------------ helpers
    def _check_model(self, fields: dict[str, Any]) -> str | None:
        """Pop ``model``: any alias of the served model (returned, to be echoed back), else a 400."""
        model = fields.pop("model", None)
        if model is None or self.model is None:
            return model
        if not self.model.known_as(model):
            raise ApiError(
                400,
                f"this server serves {self.model.name!r} (also known as {', '.join(map(repr, self.model.aliases))}),"
                f" not {model!r}",
                param="model",
                code="model_not_found",
            )
        return model

    def _check_upload_size(self, size: int, part: str = VIDEO_PART) -> None:
        limit = self.config.max_message_bytes
        if limit is not None and size + _ZMQ_OVERHEAD_BYTES > limit:
            raise ApiError(
                413,
                f"the {size}-byte {'video' if part == VIDEO_PART else part} does not fit the scheduler's message limit "
                f"({limit / 2**20:g} MiB, --max-message-mb)",
                param=part,
                code="payload_too_large",
            )

    def _model_name(self) -> str | None:
        return self.model.name if self.model is not None else None

    async def _submit(self, fields: dict[str, Any]) -> str:
        check_wire_values(fields)
        try:
            return await self.client.submit(**fields)
        except ServerError as exc:
            error = _from_client_error(exc)
            if exc.code == "bad_request" and self.model is not None and self.model.params_type is not None:
                names = (*self.model.params_type.__struct_fields__, *self.model.upload_fields)
                error.param = next((f for f in names if exc.message.startswith(f)), None)
            raise error from None

    async def _status(self, job_id: str) -> P.JobInfo:
        try:
            return await self.client.status(job_id)
        except ServerError as exc:
            if exc.code == "not_found":
                raise ApiError(404, f"no video job {job_id!r}", param="video_id", code="not_found") from None
            raise

    @staticmethod
    async def _unless_disconnected(request: Request, awaitable):
        """``awaitable``'s result; ``_ClientGone`` (``awaitable`` cancelled) if the client disconnects first."""
        work, gone = asyncio.ensure_future(awaitable), asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
        if not work.cancelled() and work.done():
            return work.result()
        raise _ClientGone()

    def _remember(self, job_id: str, record: VideoRecord) -> None:
        self._video_ids[job_id] = record
        while len(self._video_ids) > self.config.max_listed_jobs:
            self._video_ids.popitem(last=False)

    def _follow(self, job_id: str) -> None:
        """Wait for the job in the background and record its latencies and stage timings."""

        async def follow() -> None:
            try:
                result = await self.client.result(job_id, wait=True, as_paths=True)
            except (ServerError, ServerDeadError, TimeoutError) as exc:
                logger.debug("not following %s any more: %s", job_id, exc)
                return
            self.metrics.job(result.job, result.info)
            record = self._video_ids.get(job_id)
            if record is not None:
                record.result = {
                    "inference_time_s": result.info.get("inference_time_s"),
                    "peak_memory_mb": result.info.get("peak_memory_mb"),
                    "num_outputs": sum(1 for f in result.files if f.mime.startswith("video/")),
                }

        task = asyncio.get_running_loop().create_task(follow())
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    # ------------------------------------------------------------------ videos
    def _video(self, info: P.JobInfo, request: Request) -> dict[str, Any]:
        record = self._video_ids.get(info.job_id)
        return video_object(
            info,
            model=(record.model if record is not None and record.model else self._model_name()),
            record=record,
            content_url=self._url(request, f"/v1/videos/{info.job_id}/content"),
            retention_s=self.config.output_retention_s,
        )

    @staticmethod
    def _url(request: Request, path: str) -> str:
        return str(request.base_url).rstrip("/") + path

    def _video_response(self, body: dict[str, Any]) -> JSONResponse:
        """A video object, with the poll interval the official SDK's ``poll`` reads."""
        return JSONResponse(body, headers={"openai-poll-after-ms": str(POLL_AFTER_MS)})

    async def create_video(self, request: Request) -> Response:
        kind = _content_kind(request)
        try:
            if kind == "multipart":
                fields, reference = await self._read_multipart(request)
            else:
                fields, reference = await self._read_json(request), None
        except ClientDisconnect:
            return Response(status_code=400)
        if kind == "json":
            fields = _merge_extra_body(fields)
        if "video" in fields:
            raise ApiError(
                400,
                f"'video' is not a field: upload the file as {VIDEO_PART!r} (multipart) "
                "or name a server-side file with video_path",
                param="video",
                code="unknown_field",
            )
        record = VideoRecord(model=self._check_model(fields))
        with _field_errors():
            if self.model is not None and self.model.task == "sr":
                sr_fields(fields, record)
            else:
                apply_size(fields)
                model = self.model
                record.frames = apply_seconds(
                    fields,
                    default_fps=model.default_fps if model is not None else None,
                    rule=model.num_frames_rule if model is not None else (1, 0),
                )
        fields = convert_fields(
            fields, self.model.params_type if self.model else None, from_strings=kind == "multipart"
        )
        record.width, record.height = fields.get("width"), fields.get("height")
        if reference is not None:
            self._reference(fields, reference)
        job_id = await self._submit(fields)
        self._remember(job_id, record)
        self._follow(job_id)
        return self._video_response(self._video(await self._status(job_id), request))

    async def list_videos(self, request: Request) -> Response:
        raw = request.query_params.get("limit", "20")
        try:
            limit = int(raw)
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            raise ApiError(400, f"limit must be an integer in 1..100, got {raw!r}", param="limit", code="invalid_value")
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise ApiError(400, f"order must be 'asc' or 'desc', got {order!r}", param="order", code="invalid_value")
        ids = list(self._video_ids) if order == "asc" else list(reversed(self._video_ids))
        after = request.query_params.get("after")
        if after is not None:  # an id not created here (or forgotten) gives an empty page, as the reference
            ids = ids[ids.index(after) + 1 :] if after in self._video_ids else []
        page, has_more = ids[:limit], len(ids) > limit

        async def status_or_none(job_id: str) -> P.JobInfo | None:
            try:
                return await self.client.status(job_id)
            except ServerError as exc:
                if exc.code == "not_found":  # the scheduler forgot it (finished-job bound)
                    return None
                raise

        infos = await asyncio.gather(*(status_or_none(job_id) for job_id in page))
        data = [self._video(info, request) for info in infos if info is not None]
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
                "has_more": has_more,
            }
        )

    async def get_video(self, request: Request) -> Response:
        return self._video_response(self._video(await self._status(request.path_params["video_id"]), request))

    async def delete_video(self, request: Request) -> Response:
        """OpenAI's DELETE: cancel the job if it has not finished, delete its files, forget it."""
        job_id = request.path_params["video_id"]
        try:
            await self.client.delete(job_id)
        except ServerError as exc:
            if exc.code == "not_found":
                raise ApiError(404, f"no video job {job_id!r}", param="video_id", code="not_found") from None
            raise
        self._video_ids.pop(job_id, None)
        return JSONResponse({"id": job_id, "object": "video.deleted", "deleted": True})

    async def video_content(self, request: Request) -> Response:
        variant = request.query_params.get("variant", "video")
        if variant != "video":
            raise ApiError(
                400, f"variant {variant!r} is not available: tilecast stores the video only", param="variant"
            )
        return await self._content(request.path_params["video_id"], "video")

    async def image_content(self, request: Request) -> Response:
        index = request.query_params.get("index", "0")
        if not index.isdigit():
            raise ApiError(
                400, f"index must be a non-negative integer, got {index!r}", param="index", code="invalid_value"
            )
        return await self._content(request.path_params["image_id"], "image", int(index))

    async def _content(self, job_id: str, kind: str, index: int = 0) -> Response:
        """The job's ``index``-th ``kind/*`` file (default its first); 404 for an unknown id, before the
        job has completed, and for an index past its files."""
        try:
            result = await self.client.result(job_id, wait=False, as_paths=True)
        except ServerError as exc:
            if exc.code == "not_found":
                raise ApiError(404, f"no {kind} job {job_id!r}", param=f"{kind}_id", code="not_found") from None
            raise
        job = result.job
        if job.state != "completed":
            status = STATUS_NAMES.get(job.state, job.state)
            detail = f": {job.error}" if job.error else ""
            still = "still in progress" if job.state in ("queued", "running") else "it did not complete"
            raise ApiError(
                404,
                f"job {job_id} is {status}{detail}; {still}: its content exists once it has completed",
                param=f"{kind}_id",
                code=f"job_{job.state}",
            )
        files = [f for f in result.files if f.mime.startswith(f"{kind}/")] or result.files[:1]
        if not files:
            raise ApiError(500, f"job {job_id} completed without an output file", code="no_output")
        if index >= len(files):
            raise ApiError(
                404, f"job {job_id} has {len(files)} {kind} file(s); index {index} is past them",
                param="index", code="not_found",
            )  # fmt: skip
        item = files[index]
        if item.path is not None and Path(item.path).is_file():
            return FileResponse(
                item.path, media_type=item.mime or "application/octet-stream", filename=Path(item.name).name
            )
        fetched = await self.client.result(job_id, wait=False)  # front end on another host: fetch the bytes
        data = next((f.data for f in fetched.files if f.name == item.name), None)
        if data is None:
            raise ApiError(410, f"the output of job {job_id} is no longer available", code="gone")
        return Response(
            data,
            media_type=item.mime or "application/octet-stream",
            headers={"content-disposition": f'attachment; filename="{Path(item.name).name}"'},
        )

    # ------------------------------------------------------------------ images
    async def create_images(self, request: Request) -> Response:
        if _content_kind(request) != "json":
            raise ApiError(415, "POST /v1/images/generations takes application/json", code="unsupported_media_type")
        try:
            body = await self._read_json(request)
        except ClientDisconnect:
            return Response(status_code=400)
        if self.model is not None and self.model.task and self.model.task not in IMAGE_TASKS:
            raise ApiError(
                400,
                f"{self.model.name} is a {self.model.task!r} model; /v1/images/generations needs a text-to-image model",
                code="wrong_task",
            )
        return await self._images(request, _merge_extra_body(body), images=[], from_strings=False)

    async def edit_images(self, request: Request) -> Response:
        """OpenAI's image edits: multipart ``image`` / ``image[]`` (one or more files), optional
        ``mask``, ``prompt``, ``n``, ``size``, ``response_format`` and any request field of the model."""
        if _content_kind(request) != "multipart":
            raise ApiError(
                415,
                "POST /v1/images/edits takes multipart/form-data (image=@in.png or image[]=@a.png ..., prompt=...)",
                code="unsupported_media_type",
            )
        try:
            fields, files = await self._read_form(
                request,
                IMAGE_PARTS,
                max_files=MAX_EDIT_FILES,
                hint="upload input images as 'image' or 'image[]' and a mask as 'mask'",
            )
        except ClientDisconnect:
            return Response(status_code=400)
        if self.model is not None and "image" not in self.model.upload_fields:
            raise ApiError(
                400,
                f"{self.model.name} takes no input image; /v1/images/edits needs an image-editing model"
                " (use /v1/images/generations)",
                param="image",
                code="wrong_task",
            )
        if any(name == "mask" for name, _, _ in files):
            raise ApiError(
                400,
                f"mask: {self._model_name() or 'this model'} edits follow the prompt over the whole image and take no mask",
                param="mask",
                code="unsupported_input",
            )
        images = [(media, data) for _, media, data in files]
        if not images:
            raise ApiError(400, "image is required: upload it as the file part 'image'", param="image", code="missing")
        for index, (media, data) in enumerate(images):
            label = "image" if len(images) == 1 else f"image {index + 1} of {len(images)}"
            if media and not media.startswith("image/") and media not in _ACCEPTED_UPLOAD_TYPES:
                raise ApiError(
                    415,
                    f"{label} has Content-Type {media!r}; expected image/*",
                    param="image",
                    code="unsupported_media_type",
                )
            if len(data) > MAX_IMAGE_BYTES:
                raise ApiError(
                    413,
                    f"{label} is {len(data) / 2**20:.1f} MiB; at most {MAX_IMAGE_BYTES / 2**20:g} MiB per image",
                    param="image",
                    code="payload_too_large",
                )
        self._check_upload_size(sum(len(data) for _, data in images), part="image")
        for name in ("n", "seed"):  # OpenAI's own fields arrive as form strings too
            if isinstance(fields.get(name), str) and fields[name].strip().isdigit():
                fields[name] = int(fields[name])
        return await self._images(request, fields, images=[data for _, data in images], from_strings=True)

    async def _images(self, request: Request, body: dict[str, Any], *, images: list[bytes], from_strings: bool):
        """Submit an images request's ``n`` jobs (each with ``images`` as its input images), wait for
        all of them and answer in OpenAI's shape; a client that leaves gets its jobs cancelled."""
        self._check_model(body)
        with _field_errors():
            wanted = image_request(body, max_images=self.config.max_images)
        requests = [
            convert_fields(fields, self.model.params_type if self.model else None, from_strings=from_strings)
            | ({"image": images} if images else {})
            for fields in wanted.submissions
        ]
        job_ids: list[str] = []
        try:
            submitted = await asyncio.gather(*(self._submit(fields) for fields in requests), return_exceptions=True)
            job_ids = [job_id for job_id in submitted if isinstance(job_id, str)]
            errors = [exc for exc in submitted if isinstance(exc, BaseException)]
            if errors:
                raise errors[0]
            as_paths = wanted.response_format == "url"
            results = await self._unless_disconnected(
                request,
                asyncio.gather(*(self.client.result(job_id, wait=True, as_paths=as_paths) for job_id in job_ids)),
            )
        except BaseException as exc:
            await asyncio.gather(*(self.client.cancel(job_id) for job_id in job_ids), return_exceptions=True)
            if isinstance(exc, _ClientGone):
                self.metrics.disconnected += 1
                logger.info("HTTP client left before its %d image(s): cancelled %s", len(job_ids), ", ".join(job_ids))
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            raise
        images = []
        for result in results:
            self.metrics.job(result.job, result.info)
            if result.job.state != "completed":
                dead = (result.job.error or "").startswith("server dead")
                raise ApiError(
                    503 if dead else 500,
                    f"image job {result.job.job_id} {result.job.state}: {result.job.error}",
                    code=f"job_{result.job.state}",
                )
            files = [f for f in result.files if f.mime.startswith("image/")] or result.files[:1]
            if not files or (not as_paths and any(f.data is None for f in files)):
                raise ApiError(500, f"image job {result.job.job_id} returned no image file", code="no_output")
            for index, item in enumerate(files):  # several: a layered model's layers, in order
                image: dict[str, Any] = {"id": result.job.job_id}
                if as_paths:
                    query = f"?index={index}" if len(files) > 1 else ""
                    image["url"] = self._url(request, f"/v1/images/{result.job.job_id}/content{query}")
                else:
                    image["b64_json"] = base64.b64encode(item.data).decode("ascii")
                images.append(image)
        return JSONResponse(image_response(wanted.prompt, images, [result.info for result in results]))

    # ------------------------------------------------------------------ service
    async def _model(self) -> ModelInfo:
        if self.model is not None:
            return self.model
        name = (await self.client.health(timeout=self.config.health_timeout_s)).model
        return ModelInfo(name=name, aliases=(name,))

    async def list_models(self, _request: Request) -> Response:
        card = model_card(await self._model(), created=self.started_at)
        return JSONResponse({"object": "list", "data": [card]})

    async def get_model(self, request: Request) -> Response:
        model, wanted = await self._model(), request.path_params["model_id"]
        if not model.known_as(wanted):
            raise ApiError(
                404, f"the model {wanted!r} is not served here (this server serves {model.name!r})",
                param="model", code="model_not_found",
            )  # fmt: skip
        return JSONResponse(model_card(model, created=self.started_at) | {"id": wanted})

    async def model_info(self, _request: Request) -> Response:
        model = await self._model()
        card = model_card(model, created=self.started_at)
        return JSONResponse(
            card | {"model_path": card["id"], "layout": dict(model.layout), "precision": model.precision}
        )

    # ------------------------------------------------------------------ LoRA (SGLang's routes)
    async def _lora_body(self, request: Request, allowed: tuple[str, ...]) -> dict[str, Any]:
        length = request.headers.get("content-length")
        chunked = "chunked" in request.headers.get("transfer-encoding", "")
        body = await self._read_json(request) if chunked or (length is not None and length != "0") else {}
        target = body.pop("target", "all")
        if target not in ("all", "transformer"):
            raise ApiError(
                400, f"target {target!r} cannot be honoured: tilecast applies adapters to the transformer",
                param="target", code="invalid_value",
            )  # fmt: skip
        unknown = sorted(set(body) - set(allowed))
        if unknown:
            raise ApiError(400, f"unknown field {unknown[0]!r}", param=unknown[0], code="unknown_field")
        return body

    async def _lora(self, op: str, **fields) -> Response:
        try:
            listing = await self.client.lora(op, **fields)
        except ServerError as exc:
            raise _from_client_error(exc) from None
        return JSONResponse({"status": "ok", **listing})

    async def set_lora(self, request: Request) -> Response:
        body = await self._lora_body(request, ("lora_nickname", "lora_path", "strength"))
        nickname = body.get("lora_nickname")
        if not isinstance(nickname, str):
            raise ApiError(400, "lora_nickname must be a string", param="lora_nickname", code="invalid_value")
        return await self._lora("set", nickname=nickname, path=body.get("lora_path"), strength=body.get("strength"))

    async def merge_lora(self, request: Request) -> Response:
        body = await self._lora_body(request, ("strength",))
        return await self._lora("merge", strength=body.get("strength"))

    async def unmerge_lora(self, request: Request) -> Response:
        await self._lora_body(request, ())
        return await self._lora("unmerge")

    async def list_loras(self, _request: Request) -> Response:
        return await self._lora("list")

    async def health(self, _request: Request) -> Response:
        try:
            reply = await self.client.health(timeout=self.config.health_timeout_s)
        except (ServerDeadError, TimeoutError, ServerError) as exc:
            return JSONResponse(
                {"status": "unavailable", "detail": f"the scheduler did not answer: {exc}"}, status_code=503
            )
        body = {
            "model": reply.model,
            "world_size": reply.world_size,
            "queue_depth": reply.queue_depth,
            "running": reply.running,
        }
        if reply.status == "serving":
            return JSONResponse({"status": "ok", **body})
        return JSONResponse({"status": reply.status, "detail": reply.detail, **body}, status_code=503)

    async def health_generate(self, _request: Request) -> Response:
        """A real one-step generation through the queue (``Pipeline.health_request``): 200 with its
        time when it completes, 503 when it fails or times out; concurrent probes share one run, and
        an answer is reused for ``HEALTH_GENERATE_TTL_S``."""
        if self._health_lock is None:
            self._health_lock = asyncio.Lock()
        async with self._health_lock:
            cached = self._health_generated
            if cached is None or time.monotonic() - cached[0] >= HEALTH_GENERATE_TTL_S:
                self._health_generated = (time.monotonic(), *await self._generate_for_health())
            _, status, body = self._health_generated
        return JSONResponse(body, status_code=status)

    async def _generate_for_health(self) -> tuple[int, dict[str, Any]]:
        if self._health_fields is None and self.model is not None and self.model.health_request is not None:
            self._health_fields = await asyncio.to_thread(self.model.health_request)  # K6 SR encodes a clip
        request = self._health_fields
        if request is None:
            return 501, {"status": "unsupported", "detail": "this model has no health generation request"}
        fields, uploads = request
        # uploads ``image.0``, ``image.1``, ... (an image-to-video model's example frame) go as the
        # client's ``image`` list, which names them so again; other uploads (K6 SR's ``video``) by name
        frames = sorted((name for name in uploads if name.startswith("image.")), key=lambda n: int(n.split(".")[1]))
        named = {name: data for name, data in uploads.items() if name not in frames}
        began = time.monotonic()
        job_id = None
        try:
            job_id = await self._submit(
                {**fields, **named, **({"image": [uploads[n] for n in frames]} if frames else {})}
            )
            result = await asyncio.wait_for(
                self.client.result(job_id, wait=True, as_paths=True), HEALTH_GENERATE_TIMEOUT_S
            )
        except (ApiError, ServerError, ServerDeadError, asyncio.TimeoutError, TimeoutError) as exc:
            if job_id is not None:
                with contextlib.suppress(Exception):
                    await self.client.cancel(job_id)
            return 503, {"status": "unhealthy", "detail": f"the health generation did not complete: {exc}"}
        body = {
            "status": "ok" if result.job.state == "completed" else "unhealthy",
            "job_id": job_id,
            "state": result.job.state,
            "elapsed_s": round(time.monotonic() - began, 3),
            "inference_time_s": result.info.get("inference_time_s"),
        }
        if result.job.state != "completed":
            body["detail"] = result.job.error
        with contextlib.suppress(Exception):  # a probe leaves no stored output behind
            await self.client.delete(job_id)
        return (200 if result.job.state == "completed" else 503), body

    async def prometheus(self, _request: Request) -> Response:
        out = Exposition()
        stats = None
        try:
            stats = await asyncio.wait_for(self.client.stats(), self.config.health_timeout_s)
        except (asyncio.TimeoutError, ServerDeadError, ServerError) as exc:
            logger.warning("/metrics: no stats from the scheduler (%s)", exc)
        up = 1 if stats is not None and stats.get("status") == "serving" else 0
        out.simple("tilecast_up", "gauge", "1 when the scheduler answered and is serving.", up)
        if stats is not None:
            scheduler_metrics(out, stats)
        front_end_metrics(out, self.metrics)
        return PlainTextResponse(out.text(), media_type=Exposition.CONTENT_TYPE)


def create_app(config: ApiConfig) -> HttpApi:
    """The ASGI app (call it, or hand it to uvicorn)."""
    return HttpApi(config)
