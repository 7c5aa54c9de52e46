"""Dynamic batching on rank 0: which queued requests run together, and when.

The scheduler loop keeps a FIFO queue of ``QueuedRequest`` values and asks a ``Batcher`` what to
run next. The head of the queue (always the oldest request) gathers compatible requests from
anywhere in the queue; everything it does not take keeps its place. The batch is dispatched when

- it reaches its size limit, ``min(--batching-max-size, the pipeline's max_batch_size)``:
  stop reason ``max_size``;
- it reaches a lower cap from a matching rule of ``--batching-config``: ``config_cap:N``
  (a request whose rule cap is 1 never merges and is dispatched at once);
- the head has waited ``--batching-delay-ms``: ``delay``.

A batch that is not full is held until the head's delay runs out, even when no compatible
request is waiting at the moment: one may still arrive, and waiting is exactly what the delay
pays for. So there is no "queue exhausted" stop reason; a partial batch always says ``delay``.
With ``--batching-mode off`` or a size limit of 1 every request is dispatched alone, at once,
with ``max_size``.

Two requests are compatible when the model, the task, the output resolution and every field of
``Pipeline.batch_key`` are equal (rules then agree too: they match on model, task and
resolution only). An incompatible request the head looks at is counted under the first field
that differs: ``model``, ``task``, ``resolution`` or a key field name such as
``num_inference_steps``.

Only rank 0's clock (injected, ``time.monotonic`` by default) decides; other ranks follow the
broadcast plan. Pure Python, no torch: the loop calls this on every wake-up.

Cost: the head looks at the queue in order until its batch is full, so a head that finds no
company looks at every queued request. ``gather`` compares model, task and resolution inline and
keys through a ``key_token`` made once per request when it is queued (the key, encoded): requests
with equal tokens are indistinguishable to ``first_difference``, so it runs once per distinct key
instead of once per request, however deep in the key requests differ (``tilecast bench
scheduler`` measures a decision at 1,000 queued). ``gather_by_scan``, one ``first_difference``
per request, is the definition it equals (tests compare the two).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from typing import Callable, Sequence

import msgspec

from .batching_rules import BatchingRules, normalize_resolution

logger = logging.getLogger(__name__)

MODES = ("off", "dynamic")
"""Values of ``--batching-mode``."""
STOP_MAX_SIZE = "max_size"
"""The batch filled its size limit, ``min(--batching-max-size, family max)``."""
STOP_DELAY = "delay"
"""The head waited ``--batching-delay-ms``; the batch goes out partly filled."""
STOP_CONFIG_CAP = "config_cap"
"""Prefix of ``config_cap:N``: the batch reached a rule cap N below its size limit."""

_RULE_CACHE_SIZE = 1024


@dataclasses.dataclass(kw_only=True)
class BatchingConfig:
    """Dynamic batching settings as the batcher takes them: a view of ``ServeConfig``'s batching
    section (``ServeConfig.batching`` builds it; the flags and their help are declared there)."""

    mode: str = "off"
    """``--batching-mode``: ``"off"`` (every request alone) or ``"dynamic"``."""
    max_size: int = 1
    """``--batching-max-size``: the largest batch; 1 means no batching."""
    delay_ms: float = 5.0
    """``--batching-delay-ms``: how long the head of the queue may wait for company."""
    rules: BatchingRules | None = None
    """Parsed ``--batching-config`` (``BatchingRules.load``); rules only lower caps."""
    enable_metrics: bool = False
    """``--enable-batching-metrics``: log a line per dispatch and a stats line every ``stats_every``."""
    stats_every: int = 5
    """Dispatches per stats line; the line summarises exactly those dispatches."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"batching mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if isinstance(self.max_size, bool) or not isinstance(self.max_size, int) or self.max_size < 1:
            raise ValueError(f"batching max size must be an integer >= 1, got {self.max_size!r}")
        if (
            isinstance(self.delay_ms, bool)
            or not isinstance(self.delay_ms, (int, float))
            or not math.isfinite(self.delay_ms)
            or self.delay_ms < 0
        ):
            raise ValueError(f"batching delay must be a finite number of ms >= 0, got {self.delay_ms!r}")
        if self.rules is not None and not isinstance(self.rules, BatchingRules):
            raise ValueError(f"batching rules must be a BatchingRules value, got {type(self.rules).__name__}")
        if isinstance(self.stats_every, bool) or not isinstance(self.stats_every, int) or self.stats_every < 1:
            raise ValueError(f"batching stats interval must be an integer >= 1, got {self.stats_every!r}")

    @property
    def user_max(self) -> int:
        """The size limit the user asked for: ``max_size`` in dynamic mode, 1 when off."""
        return self.max_size if self.mode == "dynamic" else 1


@dataclasses.dataclass(kw_only=True)
class QueuedRequest:
    """What the batcher needs to know about a queued request."""

    job_id: str
    """The job's id."""
    model: str
    """Name or path of the model the request runs on."""
    task: str
    """``"t2i"``, ``"t2v"`` or ``"sr"``."""
    key: dict[str, object]
    """``Pipeline.batch_key(params)``: ordered fields that must be equal to share a batch."""
    resolution: str | None
    """Output resolution ``"WxH"`` when the request has one (rules match on it); normalised."""
    enqueued_at: float
    """Rank 0 clock (seconds) when the request entered the queue."""
    family_max: int = 1
    """``Pipeline.max_batch_size`` of the request's pipeline."""
    key_token: object = dataclasses.field(init=False, repr=False, compare=False)
    """``key_token(key)``, made once here: the key must not change while the request is queued (the
    scheduler builds this view once per job)."""

    def __post_init__(self) -> None:
        self.resolution = normalize_resolution(self.resolution)
        if isinstance(self.family_max, bool) or not isinstance(self.family_max, int) or self.family_max < 1:
            raise ValueError(f"family_max must be an integer >= 1, got {self.family_max!r}")
        self.key_token = key_token(self.key)


@dataclasses.dataclass(kw_only=True)
class Dispatch:
    """A batch the loop should run now."""

    job_ids: list[str]
    """The head first, then the gathered requests in queue order."""
    cap: int
    """Effective cap the batch was gathered under: ``min(size_limit, matching rule caps)``."""
    size_limit: int
    """``min(--batching-max-size, family max)`` (1 when batching is off): the ``N`` in ``size=n/N``."""
    stop_reason: str
    """``max_size``, ``config_cap:N`` or ``delay``."""
    queue_wait_ms: float
    """How long the head waited, on rank 0's clock."""
    rejects: dict[str, int] = dataclasses.field(default_factory=dict)
    """Incompatible requests the head looked at, by first differing field."""

    @property
    def size(self) -> int:
        return len(self.job_ids)

    @property
    def full(self) -> bool:
        """Whether the batch filled its size limit (a rule-capped batch is not full)."""
        return self.size >= self.size_limit


def first_difference(head: QueuedRequest, other: QueuedRequest) -> str | None:
    """Name of the first field that keeps ``other`` out of ``head``'s batch; ``None``: compatible."""
    if other.model != head.model:
        return "model"
    if other.task != head.task:
        return "task"
    if other.resolution != head.resolution:
        return "resolution"
    other_key = other.key
    for field, value in head.key.items():
        if field not in other_key or other_key[field] != value:
            return field
    if len(other_key) != len(head.key):
        return next(field for field in other_key if field not in head.key)
    return None


def _plain(value: object) -> bool:
    """Whether ``value`` is built only of exact ``str``, ``int``, ``bool``, ``None``, non-NaN
    ``float``, ``list`` and ``str``-keyed ``dict``: then two values with the same msgpack encoding
    compare alike against anything (a NaN, or a tuple encoded like a list, would not)."""
    kind = type(value)
    if kind is float:
        return value == value  # not NaN
    if kind is str or kind is int or kind is bool or value is None:
        return True
    if kind is list:
        return all(_plain(item) for item in value)
    if kind is dict:
        return all(type(name) is str and _plain(item) for name, item in value.items())
    return False


def key_token(key: dict[str, object]) -> object:
    """A token equal for two batch keys only if ``first_difference`` cannot tell them apart: the key's
    msgpack encoding (bytes: hashed once, compared fast) when it holds plain values only (``_plain``),
    otherwise a token of its own."""
    if _plain(key):
        try:
            return msgspec.msgpack.encode(key)
        except (OverflowError, UnicodeEncodeError):  # an int over 64 bits, a lone surrogate
            pass
    return object()


_UNSEEN = object()


def gather(head: QueuedRequest, queue: Sequence[QueuedRequest], cap: int) -> tuple[list[str], dict[str, int]]:
    """The batch ``head`` (``queue[0]``) gathers under ``cap``: its job id, then the compatible
    requests' in queue order, stopping at ``cap``; and the incompatible requests it looked at, by
    first differing field. Equal to ``gather_by_scan``: model, task and resolution are compared
    inline, as ``first_difference`` compares them, and among requests equal to the head in those
    ``first_difference`` runs once per distinct ``key_token``."""
    job_ids = [head.job_id]
    rejects: dict[str, int] = {}
    if cap <= 1:
        return job_ids, rejects
    model, task, resolution = head.model, head.task, head.resolution
    verdicts: dict[object, str | None] = {}
    seen = verdicts.get
    for request in itertools.islice(queue, 1, None):
        if request.model != model:
            reason = "model"
        elif request.task != task:
            reason = "task"
        elif request.resolution != resolution:
            reason = "resolution"
        else:
            token = request.key_token
            reason = seen(token, _UNSEEN)
            if reason is _UNSEEN:
                reason = verdicts[token] = first_difference(head, request)
            if reason is None:
                job_ids.append(request.job_id)
                if len(job_ids) >= cap:
                    break
                continue
        rejects[reason] = rejects.get(reason, 0) + 1
    return job_ids, rejects


def gather_by_scan(head: QueuedRequest, queue: Sequence[QueuedRequest], cap: int) -> tuple[list[str], dict[str, int]]:
    """What ``gather`` returns, by definition: ``first_difference`` against each request looked at."""
    job_ids = [head.job_id]
    rejects: dict[str, int] = {}
    if cap > 1:
        for request in itertools.islice(queue, 1, None):
            reason = first_difference(head, request)
            if reason is not None:
                rejects[reason] = rejects.get(reason, 0) + 1
                continue
            job_ids.append(request.job_id)
            if len(job_ids) >= cap:
                break
    return job_ids, rejects


class Batcher:
    """Picks the next batch from the queue. Stateless between calls apart from a rule-cap cache."""

    gather_members = staticmethod(gather)
    """How the head gathers its batch (``gather``; ``gather_by_scan`` gives the same batches, slower)."""

    def __init__(self, config: BatchingConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._delay_s = config.delay_ms / 1000.0
        self._rule_caps: dict[tuple[str, str, str | None], int | None] = {}
        # A size or rules file with --batching-mode off is refused by ServeConfig, never ignored here.
        if config.mode == "dynamic" and config.max_size == 1:
            logger.warning("--batching-mode dynamic with --batching-max-size 1 runs every request alone")

    def limits(self, request: QueuedRequest) -> tuple[int, int | None]:
        """``(size_limit, rule_cap)`` for a batch headed by ``request``; ``rule_cap`` is ``None`` without a matching rule."""
        size_limit = min(self.config.user_max, request.family_max)
        rules = self.config.rules
        if rules is None or size_limit == 1:
            return size_limit, None
        cache_key = (request.model, request.task, request.resolution)
        if cache_key not in self._rule_caps:
            if len(self._rule_caps) >= _RULE_CACHE_SIZE:  # clients choose resolutions: stay bounded
                self._rule_caps.clear()
            self._rule_caps[cache_key] = rules.cap_for(
                model=request.model, task=request.task, resolution=request.resolution
            )
        return size_limit, self._rule_caps[cache_key]

    def cap_for(self, request: QueuedRequest) -> int:
        """Largest batch a request can be part of."""
        size_limit, rule_cap = self.limits(request)
        return size_limit if rule_cap is None else min(size_limit, rule_cap)

    def select(self, queue: Sequence[QueuedRequest]) -> Dispatch | None:
        """The batch to run now, or ``None``: wait (the head's delay has not run out and the batch is
        not full). Never ``None`` for a non-empty queue whose head cannot merge (mode off, size
        limit 1, rule cap 1) or whose batch is full. The caller removes ``job_ids`` from its queue."""
        if not queue:
            return None
        now = self._clock()
        head = queue[0]
        size_limit, rule_cap, job_ids, rejects = self._gather(queue)
        cap = size_limit if rule_cap is None else min(size_limit, rule_cap)
        if len(job_ids) >= cap:
            if rule_cap is not None and rule_cap < size_limit:
                stop_reason = f"{STOP_CONFIG_CAP}:{rule_cap}"
            else:
                stop_reason = STOP_MAX_SIZE
        elif now >= self._deadline(head):
            stop_reason = STOP_DELAY
        else:
            return None
        return Dispatch(
            job_ids=job_ids,
            cap=cap,
            size_limit=size_limit,
            stop_reason=stop_reason,
            queue_wait_ms=max(0.0, (now - head.enqueued_at) * 1000.0),
            rejects=rejects,
        )

    def next_deadline(self, queue: Sequence[QueuedRequest]) -> float | None:
        """Clock time at which ``select`` dispatches even if nothing new arrives; ``None`` for an empty
        queue. It is ``head.enqueued_at + delay`` for a batch still filling, and ``head.enqueued_at``
        (already past) when the batch is due now, so ``max(0, deadline - clock())`` is the sleep."""
        if not queue:
            return None
        head = queue[0]
        size_limit, rule_cap, job_ids, _ = self._gather(queue)
        cap = size_limit if rule_cap is None else min(size_limit, rule_cap)
        if len(job_ids) >= cap:
            return head.enqueued_at
        return self._deadline(head)

    def _deadline(self, head: QueuedRequest) -> float:
        # One expression for both select and next_deadline, so sleeping until the deadline
        # always makes select dispatch (no float mismatch, no busy loop).
        return head.enqueued_at + self._delay_s

    def _gather(self, queue: Sequence[QueuedRequest]) -> tuple[int, int | None, list[str], dict[str, int]]:
        head = queue[0]
        size_limit, rule_cap = self.limits(head)
        cap = size_limit if rule_cap is None else min(size_limit, rule_cap)
        job_ids, rejects = self.gather_members(head, queue, cap)
        return size_limit, rule_cap, job_ids, rejects
