"""Batching rules: per-model / per-resolution caps read from ``--batching-config``.

A rules file lowers the batch cap for the requests a rule matches, below
``--batching-max-size``::

    {
      "schema_version": 1,
      "rules": [
        {"model_contains": "Qwen-Image", "resolution": "1024x1024", "max_batch_size": 1},
        {"task": "t2v", "max_batch_size": 2}
      ]
    }

A rule matches a request when every criterion it names matches:

- ``model_contains``: a substring of the served model's name or path, compared
  case-insensitively (``"Qwen-Image"`` matches ``Qwen/Qwen-Image`` and ``tiny/qwen-image``).
- ``resolution``: ``"WIDTHxHEIGHT"``, equal to the request's output resolution. A request
  without a resolution never matches a rule that names one.
- ``task``: ``"t2i"``, ``"t2v"`` or ``"sr"``. Memory per batch item depends mostly on the task
  (a video latent is many frames), so one rule can cap, say, every T2V model at once.

A rule must name at least one criterion (a global cap is ``--batching-max-size``). When several
rules match, the smallest ``max_batch_size`` wins; rules never raise a cap.

Any problem in the file stops start-up with one ``ValueError`` listing every problem found.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import re
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
"""The only ``schema_version`` this module reads."""
TASKS = ("t2i", "t2v", "sr")
"""Task names a rule may name."""

_TOP_KEYS = ("schema_version", "rules")
_RULE_KEYS = ("model_contains", "resolution", "task", "max_batch_size")
_CRITERIA = ("model_contains", "resolution", "task")
_RESOLUTION_RE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


def parse_resolution(text: str) -> tuple[int, int]:
    """``"1024x768"`` -> ``(1024, 768)``; raise ``ValueError`` for anything else."""
    match = _RESOLUTION_RE.match(text) if isinstance(text, str) else None
    if match is None or int(match.group(1)) <= 0 or int(match.group(2)) <= 0:
        raise ValueError(f"resolution {text!r} is not WIDTHxHEIGHT with positive integers (e.g. '1024x1024')")
    return int(match.group(1)), int(match.group(2))


def normalize_resolution(text: str | None) -> str | None:
    """Canonical ``"WxH"`` form of a resolution string (``None`` stays ``None``)."""
    if text is None:
        return None
    width, height = parse_resolution(text)
    return f"{width}x{height}"


def _check_cap(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"max_batch_size must be a positive integer, got {value!r}")
    return value


def _check_model(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"model_contains must be a non-empty string, got {value!r}")
    return value


def _check_task(value: Any) -> str:
    if value not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {value!r}")
    return value


_CHECKS = {
    "max_batch_size": _check_cap,
    "model_contains": _check_model,
    "resolution": normalize_resolution,
    "task": _check_task,
}


@dataclasses.dataclass(kw_only=True, frozen=True)
class BatchingRule:
    """One rule: the requests it matches and the cap it puts on their batches."""

    max_batch_size: int
    """Largest batch a matching request may join (1: it never merges)."""
    model_contains: str | None = None
    """Case-insensitive substring of the model name/path; ``None``: any model."""
    resolution: str | None = None
    """``"WIDTHxHEIGHT"`` the request must have; ``None``: any resolution."""
    task: str | None = None
    """``"t2i"``, ``"t2v"`` or ``"sr"``; ``None``: any task."""

    def __post_init__(self) -> None:
        for key in _RULE_KEYS:
            value = getattr(self, key)
            if value is not None or key == "max_batch_size":
                object.__setattr__(self, key, _CHECKS[key](value))
        if self.model_contains is None and self.resolution is None and self.task is None:
            raise ValueError(
                "the rule names no criterion (model_contains, resolution or task); "
                "for a cap on every request use --batching-max-size"
            )

    def matches(self, *, model: str, task: str, resolution: str | None) -> bool:
        """Whether every criterion this rule names holds for the request.

        ``resolution`` is the request's canonical ``"WxH"`` (see ``normalize_resolution``)."""
        if self.model_contains is not None and self.model_contains.lower() not in model.lower():
            return False
        if self.task is not None and self.task != task:
            return False
        if self.resolution is not None and resolution != self.resolution:
            return False
        return True


@dataclasses.dataclass(kw_only=True, frozen=True)
class BatchingRules:
    """The parsed rules file."""

    rules: tuple[BatchingRule, ...] = ()
    """Rules in file order (order does not matter: the smallest matching cap wins)."""
    source: str = "<inline>"
    """Where the rules came from, for messages."""

    def __post_init__(self) -> None:
        if not all(isinstance(rule, BatchingRule) for rule in self.rules):
            raise ValueError(f"rules must be BatchingRule values, got {self.rules!r}")
        object.__setattr__(self, "rules", tuple(self.rules))

    def cap_for(self, *, model: str, task: str, resolution: str | None) -> int | None:
        """Smallest ``max_batch_size`` among the matching rules; ``None`` when no rule matches."""
        caps = [
            rule.max_batch_size for rule in self.rules if rule.matches(model=model, task=task, resolution=resolution)
        ]
        return min(caps) if caps else None

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "<inline>") -> "BatchingRules":
        """Build from decoded JSON; raise one ``ValueError`` listing every problem."""
        problems: list[str] = []
        rules: list[BatchingRule] = []
        if not isinstance(data, dict):
            problems.append(f"the top level must be a JSON object, got {type(data).__name__}")
        else:
            problems += _unknown_keys(data, _TOP_KEYS, where="at the top level")
            if "schema_version" not in data:
                problems.append(f"missing 'schema_version' (expected {SCHEMA_VERSION})")
            elif type(data["schema_version"]) is not int or data["schema_version"] != SCHEMA_VERSION:
                problems.append(f"unsupported schema_version {data['schema_version']!r} (expected {SCHEMA_VERSION})")
            raw_rules = data.get("rules")
            if "rules" not in data:
                problems.append("missing 'rules' (a list of rule objects)")
            elif not isinstance(raw_rules, list):
                problems.append(f"'rules' must be a list, got {type(raw_rules).__name__}")
            else:
                for index, raw in enumerate(raw_rules):
                    rule = _parse_rule(raw, index, problems)
                    if rule is not None:
                        rules.append(rule)
        if problems:
            raise _error(source, problems)
        return cls(rules=tuple(rules), source=source)

    @classmethod
    def from_json(cls, text: str, *, source: str = "<inline>") -> "BatchingRules":
        """Parse JSON text; bad JSON is reported with its line and column."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise _error(source, [f"invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"]) from None
        return cls.from_dict(data, source=source)

    @classmethod
    def load(cls, path: str | Path) -> "BatchingRules":
        """Read a rules file (``--batching-config``)."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ValueError(f"batching config file not found: {str(path)!r}") from None
        except IsADirectoryError:
            raise ValueError(f"batching config {str(path)!r} is a directory, not a JSON file") from None
        except UnicodeDecodeError as exc:
            raise _error(str(path), [f"not UTF-8 text ({exc.reason} at byte {exc.start})"]) from None
        rules = cls.from_json(text, source=str(path))
        logger.info("Loaded %d batching rule(s) from %s", len(rules.rules), path)
        return rules


def _parse_rule(raw: Any, index: int, problems: list[str]) -> BatchingRule | None:
    """One rule object -> ``BatchingRule``; append its problems instead of raising."""
    if not isinstance(raw, dict):
        problems.append(f"rule {index} must be a JSON object, got {type(raw).__name__}")
        return None
    before = len(problems)
    problems += _unknown_keys(raw, _RULE_KEYS, where=f"in rule {index}")
    if "max_batch_size" not in raw:
        problems.append(f"rule {index} is missing 'max_batch_size'")
    for key in _RULE_KEYS:
        if key in raw:
            try:
                _CHECKS[key](raw[key])
            except ValueError as exc:
                problems.append(f"rule {index}: {exc}")
    if len(problems) > before:
        return None
    try:
        return BatchingRule(**{key: raw[key] for key in _RULE_KEYS if key in raw})
    except ValueError as exc:  # a whole-rule problem (e.g. no criterion)
        problems.append(f"rule {index}: {exc}")
        return None


def _unknown_keys(obj: dict, valid: tuple[str, ...], *, where: str) -> list[str]:
    problems = []
    for key in obj:
        if key in valid:
            continue
        close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else f" (valid keys: {', '.join(valid)})"
        problems.append(f"unknown key {key!r} {where}{hint}")
    return problems


def _error(source: str, problems: list[str]) -> ValueError:
    if len(problems) == 1:
        return ValueError(f"batching config {source}: {problems[0]}")
    listed = "\n".join(f"  - {problem}" for problem in problems)
    return ValueError(f"batching config {source} has {len(problems)} problems:\n{listed}")
