"""How tilecast's settings are declared once, and the readers of that one declaration.

``ServeConfig`` (``runtime/config.py``) is the declaration: a kw-only frozen dataclass whose
fields carry a docstring each and, through ``setting(...)``, the facts the readers need (help
section, flag name, choices, bounds, environment variable). From it, with nothing written twice:

- the ``serve``/``generate`` flags, their help and defaults (``launcher/options.py``);
- the checks every field gets in ``__post_init__`` (``check_declared``: type, choices, bounds;
  the message names the flag);
- the ``--config`` file (``read_settings_file``: TOML or JSON, keys are field names, sections
  allowed, unknown keys refused with the nearest real one);
- the start-up log of the effective settings (``describe``; secrets redacted);
- which settings a pipeline must honour or refuse (``pipeline=True``; ``config.check_honoured``).

Pure Python, no torch: the CLI reads this before deciding whether to start ranks.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import json
import math
import re
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

SECTIONS = {
    "model": "Model and device",
    "parallel": "Parallelism",
    "vae": "VAE decode (--vae-config.*)",
    "placement": "Weight placement",
    "performance": "Performance",
    "server": "Scheduler",
    "batching": "Dynamic batching",
    "http": "HTTP API",
    "security": "Security",
    "outputs": "Outputs",
    "watchdog": "Watchdog",
}
"""Help sections (and ``--config`` file tables) in the order ``--help`` lists them."""
SERVE_ONLY_SECTIONS = frozenset({"server", "batching", "http", "security", "outputs"})
"""Sections that only ``tilecast serve`` takes; ``generate`` takes the others."""

_META = "tilecast.setting"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setting:
    """What the readers of the declaration need to know about one field besides its type,
    default and docstring."""

    section: str
    """Key of ``SECTIONS``: the help section and the ``--config`` table the field belongs to."""
    flag: str | None = None
    """The command-line flag (default: ``--`` and the field name with dashes; a nested section's
    fields get the section's flag, a dot, and their own name)."""
    choices: tuple[str, ...] = ()
    """The accepted values (checked; listed in the help)."""
    ge: float | None = None
    """Smallest accepted value."""
    gt: float | None = None
    """The value must be larger than this."""
    le: float | None = None
    """Largest accepted value."""
    envvar: str | None = None
    """Environment variable that gives the value when the flag does not."""
    picked: bool = False
    """Left out on the command line, the launcher picks the value (the parallel degrees)."""
    secret: bool = False
    """Never logged nor shown (``describe`` writes ``<redacted>``)."""
    metavar: str | None = None
    """The value's name in ``--help``."""
    pipeline: bool = False
    """A pipeline reads it (``RankContext.settings``): a pipeline that does not name it in its
    ``honoured_settings`` refuses it at load when it is set away from its default
    (``config.check_honoured``)."""


def setting(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING, **facts) -> Any:
    """A declared field: ``dataclasses.field`` carrying a ``Setting`` made of ``facts``."""
    facts_ = Setting(**facts)
    return dataclasses.field(
        default=default, default_factory=default_factory, repr=not facts_.secret, metadata={_META: facts_}
    )


@dataclasses.dataclass(frozen=True)
class Declared:
    """One leaf field of the declaration, as its readers see it."""

    path: tuple[str, ...]
    """Attribute path from the top: ``("port",)``, ``("vae", "use_parallel_tiling")``."""
    flag: str
    """The command-line flag."""
    kind: type
    """The value's base type: ``bool``, ``int``, ``float``, ``str`` or ``Path``."""
    optional: bool
    """``None`` is a valid value."""
    multiple: bool
    """A tuple of values (the flag repeats)."""
    default: Any
    """The declared default."""
    help: str
    """The field's docstring as one line of plain text."""
    setting: Setting

    @property
    def name(self) -> str:
        """Dotted path, as written in the config file and the start-up log."""
        return ".".join(self.path)

    @property
    def section(self) -> str:
        return self.setting.section


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of ``cls`` (read from its source), whitespace collapsed."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _plain(text: str) -> str:
    return re.sub(r"``([^`]*)``", r"\1", text)


def _base(hint: Any) -> tuple[Any, bool, bool]:
    """(base type, optional, multiple) of a field's type hint."""
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional, hint = len(args) < len(typing.get_args(hint)), args[0]
    if typing.get_origin(hint) is tuple:
        return typing.get_args(hint)[0], optional, True
    return hint, optional, False


@functools.lru_cache(maxsize=None)
def declared(cls: type, _prefix: tuple[str, ...] = (), _flag: str | None = None) -> tuple[Declared, ...]:
    """Every leaf field of the declaration ``cls``, nested sections (a field whose type is itself
    a declared dataclass, such as ``vae``) expanded, in declaration order."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    out: list[Declared] = []
    for field in dataclasses.fields(cls):
        facts: Setting | None = field.metadata.get(_META)
        if facts is None:
            raise TypeError(f"{cls.__name__}.{field.name} is not declared with setting(...)")
        flag = facts.flag or ((_flag + "." if _flag else "--") + field.name.replace("_", "-"))
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            out += declared(hint, (*_prefix, field.name), flag)
            continue
        kind, optional, multiple = _base(hint)
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        out.append(
            Declared(
                path=(*_prefix, field.name),
                flag=flag,
                kind=kind,
                optional=optional,
                multiple=multiple,
                default=default,
                help=_plain(docs.get(field.name, "")),
                setting=facts,
            )
        )
    if not _prefix:  # name fields in the help by their flags
        flags = {item.path[-1]: item.flag for item in out}
        out = [
            dataclasses.replace(
                item, help=re.sub(r"\b([a-z]+(?:_[a-z]+)+)\b", lambda m: flags.get(m.group(1), m.group(1)), item.help)
            )
            for item in out
        ]
    return tuple(out)


def _value_error(item: Declared, value: Any, wanted: str) -> ValueError:
    return ValueError(f"{item.flag} must be {wanted}, got {value!r}")


def coerce_declared(obj: Any) -> None:
    """Turn text into ``Path`` and lists into tuples where the declaration says so (a config
    file or a test may give them plainly); call first in ``__post_init__``."""
    for item in declared(type(obj)):
        if len(item.path) != 1:
            continue
        value = getattr(obj, item.path[0])
        if item.multiple and isinstance(value, (list, tuple)):
            value = tuple(Path(v) if item.kind is Path and isinstance(v, str) else v for v in value)
        elif item.kind is Path and isinstance(value, str):
            value = Path(value)
        object.__setattr__(obj, item.path[0], value)


def check_declared(obj: Any) -> None:
    """The checks the declaration of ``type(obj)`` implies, top-level fields only (a nested
    section checks its own): type, choices and bounds. ``ValueError`` names the flag."""
    for item in declared(type(obj)):
        if len(item.path) != 1:
            continue
        value = getattr(obj, item.path[0])
        if value is None and item.optional:
            continue
        check_value(item, value)


def check_value(item: Declared, value: Any) -> None:
    """Raise ``ValueError`` naming ``item.flag`` when ``value`` is not what the declaration allows."""
    facts = item.setting
    values = value if item.multiple else (value,)
    if item.multiple and not isinstance(value, tuple):
        raise _value_error(item, value, "a list")
    for one in values:
        if item.kind is bool and not isinstance(one, bool):
            raise ValueError(f"{item.flag} takes true or false, got {one!r}")
        if item.kind is int and (isinstance(one, bool) or not isinstance(one, int)):
            raise _value_error(item, one, "an integer")
        if item.kind is float and (
            isinstance(one, bool) or not isinstance(one, (int, float)) or not math.isfinite(one)
        ):
            raise _value_error(item, one, "a finite number")
        if item.kind is str and not isinstance(one, str):
            raise _value_error(item, one, "text")
        if item.kind is Path and not isinstance(one, Path):
            raise _value_error(item, one, "a path")
        if facts.choices and one not in facts.choices:
            raise _value_error(item, one, f"one of {', '.join(facts.choices)}")
        if facts.ge is not None and facts.le is not None and not facts.ge <= one <= facts.le:
            raise _value_error(item, one, f"in {facts.ge:g}..{facts.le:g}")
        if facts.ge is not None and one < facts.ge:
            raise _value_error(item, one, f">= {facts.ge:g}")
        if facts.gt is not None and not one > facts.gt:
            raise _value_error(item, one, f"> {facts.gt:g}")
        if facts.le is not None and one > facts.le:
            raise _value_error(item, one, f"<= {facts.le:g}")


def nearest(name: str, names: list[str]) -> str | None:
    """The closest of ``names`` to a mistyped ``name`` (None when nothing is close)."""
    found = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return found[0] if found else None


def read_settings_file(path: Path, cls: type, *, allowed: set[str] | None = None) -> dict[str, Any]:
    """The settings a ``--config`` file gives, as keyword arguments of ``cls``.

    TOML (``.toml``) or JSON (``.json``). Keys are the field names; a table named after a section
    (``[batching]``, ``[http]``, ...) may hold that section's fields, and the nested section
    ``[vae]`` holds ``VaeConfig``'s fields. ``allowed`` (dotted names) narrows what the command
    takes. ``ValueError`` names the file and an unknown key with the nearest real one."""
    path = Path(path)
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"--config {path}: cannot read it ({exc.strerror or exc})") from exc
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        elif path.suffix == ".toml":
            import tomllib

            data = tomllib.loads(text.decode())
        else:
            raise ValueError(f"--config {path}: write it as .toml or .json")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"--config {path}: not valid JSON ({exc})") from exc
    except Exception as exc:  # tomllib.TOMLDecodeError; tomllib is imported lazily
        if type(exc).__name__ != "TOMLDecodeError":
            raise
        raise ValueError(f"--config {path}: not valid TOML ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: the top level must be a table of settings")
    items = {item.name: item for item in declared(cls)}
    nested = {item.path[0] for item in items.values() if len(item.path) > 1}
    flat: dict[str, Any] = {}

    def take(name: str, value: Any, where: str) -> None:
        if name not in items:
            hint = nearest(name, list(items))
            raise ValueError(
                f"--config {path}: unknown setting {where!r}" + (f"; did you mean {hint!r}?" if hint else "")
            )
        if allowed is not None and name not in allowed:
            raise ValueError(f"--config {path}: {where!r} ({items[name].flag}) is not a setting of this command")
        if name in flat:
            raise ValueError(f"--config {path}: {name!r} is given twice")
        flat[name] = value

    for key, value in data.items():
        if key in nested and isinstance(value, dict):
            for sub, sub_value in value.items():
                take(f"{key}.{sub}", sub_value, f"{key}.{sub}")
        elif key in SECTIONS and key not in items and isinstance(value, dict):
            for sub, sub_value in value.items():
                if sub in items and items[sub].section != key:
                    raise ValueError(f"--config {path}: {sub!r} belongs in [{items[sub].section}], not [{key}]")
                take(sub, sub_value, f"{key}.{sub}")
        else:
            take(key, value, key)
    return nest(flat)


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """Dotted names to keyword arguments: ``{"vae.fast_decode": False}`` → ``{"vae": {"fast_decode": False}}``."""
    out: dict[str, Any] = {}
    for name, value in flat.items():
        head, _, rest = name.partition(".")
        if rest:
            out.setdefault(head, {})[rest] = value
        else:
            out[head] = value
    return out


def describe(obj: Any) -> str:
    """The effective settings, one ``name = value`` per line (secrets as ``<redacted>``)."""
    lines = []
    for item in declared(type(obj)):
        value = functools.reduce(getattr, item.path, obj)
        if item.setting.secret and value is not None:
            value = "<redacted>"
        elif isinstance(value, tuple):
            value = [str(v) for v in value]
        elif isinstance(value, Path):
            value = str(value)
        lines.append(f"  {item.name} = {value!r}")
    return "\n".join(lines)
