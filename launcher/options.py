"""The flags of ``serve`` and ``generate``, generated from the one declaration (``ServeConfig``).

``with_settings(command)`` gives a typer command an option for every declared field the command
takes (``generate`` leaves out the serve-only sections; flag names are SGLang's), with help,
metavar and environment variable from the declaration, and hands it the flags actually given.
``SettingsCommand`` lets a ``true|false`` flag stand bare and lists ``--help`` by section.
``settings_values`` lays those flags over the ``--config`` file; ``build_config`` turns the
result into the validated ``ServeConfig``, picking the parallel layout when no degree is given.

No torch at import: ``tilecast --help`` and ``serve --help`` stay fast.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer
from typer.core import TyperCommand

from tilecast.runtime.config import ServeConfig
from tilecast.runtime.settings import (
    SECTIONS,
    SERVE_ONLY_SECTIONS,
    Declared,
    declared,
    nest,
    read_settings_file,
)

CONFIG_FLAG = "--config"


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def parse_bool(value: str | bool, flag: str) -> bool:
    """A ``true|false`` flag's text (also 1/0, yes/no, on/off); ``ValueError`` names the flag."""
    if isinstance(value, bool):
        return value
    lowered = value.strip().lower()
    if lowered in _TRUE or lowered in _FALSE:
        return lowered in _TRUE
    raise ValueError(f"{flag} takes true or false, got {value!r}")


def command_fields(command: str) -> tuple[Declared, ...]:
    """The declared fields ``command`` (``serve`` or ``generate``) takes as flags."""
    return tuple(
        item for item in declared(ServeConfig) if command == "serve" or item.section not in SERVE_ONLY_SECTIONS
    )


def _param_name(item: Declared) -> str:
    return "setting__" + "__".join(item.path)


def _help(item: Declared) -> str:
    parts = [item.help]
    if item.setting.picked:
        parts.append("[default: picked from the GPU count and heads]")
    elif item.kind is bool:
        parts.append(f"[default: {str(item.default).lower()}]")
    elif item.default not in (None, ()):
        parts.append(f"[default: {item.default}]")
    return " ".join(parts)


def _parameter(item: Declared) -> inspect.Parameter:
    """The typer parameter of one declared field (default None: "not given")."""
    facts = item.setting
    extra: dict[str, Any] = {}
    kind: Any = item.kind
    if item.kind is bool:
        kind, extra = str, {"metavar": "[true|false]"}  # parse_bool in settings_values
    else:
        extra["metavar"] = "|".join(facts.choices) if facts.choices else (facts.metavar or item.kind.__name__.upper())
    if facts.envvar:
        extra |= {"envvar": facts.envvar, "show_envvar": True}
    annotation = Annotated[
        Optional[list[kind] if item.multiple else kind],
        typer.Option(item.flag, help=_help(item), show_default=False, **extra),
    ]
    return inspect.Parameter(_param_name(item), inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)


def with_settings(command: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a typer command (taking ``ctx: typer.Context``) a flag for every declared field
    ``command`` takes; it receives the flags actually given (command line or environment) as
    one dict of dotted names, its parameter ``settings``."""
    fields = command_fields(command)

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        own = [p for p in inspect.signature(function, eval_str=True).parameters.values() if p.name != "settings"]

        @functools.wraps(function)
        def run(**kwargs):
            ctx = kwargs["ctx"]
            given = {}
            for item in fields:
                value = kwargs.pop(_param_name(item))
                if ctx.get_parameter_source(_param_name(item)).name in ("COMMANDLINE", "ENVIRONMENT"):
                    given[item.name] = tuple(value) if item.multiple else value
            return function(settings=given, **kwargs)

        parameters = [*own, *(_parameter(item) for item in fields)]
        run.__signature__ = inspect.Signature(parameters)
        run.__annotations__ = {p.name: p.annotation for p in parameters}
        del run.__wrapped__  # typer must see the generated signature
        return run

    return decorate


class SettingsCommand(TyperCommand):
    """``serve``/``generate``: a ``true|false`` flag given bare means true, and ``--help``
    lists the flags by section in plain text (long flag names are never truncated)."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        switches = {item.flag for item in declared(ServeConfig) if item.kind is bool}
        expanded: list[str] = []
        for index, arg in enumerate(args):
            expanded.append(arg)
            if arg == "--":
                expanded += args[index + 1 :]
                break
            following = args[index + 1] if index + 1 < len(args) else None
            if arg in switches and (following is None or following.startswith("-")):
                expanded.append("true")
        return super().parse_args(ctx, expanded)

    def format_help(self, ctx, formatter) -> None:
        self.format_usage(ctx, formatter)
        self.format_help_text(ctx, formatter)
        self.format_options(ctx, formatter)

    def format_options(self, ctx, formatter) -> None:
        sections = {_param_name(item): SECTIONS[item.section] for item in declared(ServeConfig)}
        groups: dict[str, list] = {"Options": []}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                groups.setdefault(sections.get(param.name, "Options"), []).append(record)
        for title in ("Options", *SECTIONS.values()):
            if groups.get(title):
                with formatter.section(title):
                    formatter.write_dl(groups[title], col_max=34)


def settings_values(given: dict[str, Any], config_file: Path | None, command: str) -> dict[str, Any]:
    """Keyword arguments of ``ServeConfig``: the ``--config`` file's, overridden by the flags
    ``given`` (``with_settings``)."""
    allowed = {item.name for item in command_fields(command)}
    values = read_settings_file(config_file, ServeConfig, allowed=allowed) if config_file else {}
    kinds = {item.name: item for item in command_fields(command)}
    given = {
        name: parse_bool(value, kinds[name].flag) if kinds[name].kind is bool else value
        for name, value in given.items()
    }
    for name, value in nest(given).items():
        if isinstance(value, dict):
            values[name] = {**values.get(name, {}), **value}
        else:
            values[name] = value
    return values


def model_num_heads(model_path: str) -> int | None:
    """The DiT's attention heads (None for a built-in without a DiT, such as the test pipelines)."""
    from tilecast.runtime.topology import num_heads_from_checkpoint

    if model_path.startswith("test/"):  # the test pipelines (runtime/probe.py)
        return None
    return num_heads_from_checkpoint(model_path)


def build_config(values: dict[str, Any]) -> ServeConfig:
    """The validated ``ServeConfig`` of ``values``; ``ValueError`` names the bad value.

    With none of the three degrees given, the layout is picked: the largest Ulysses degree that
    divides both the GPU count (of one replica group with ``dp_degree``) and the model's heads, the
    rest in Ring. With ``--tile-parallel`` the picked layout is one rank per data-parallel unit (all
    degrees 1): tile-parallel needs at least two units, and sharding the DiT over every rank leaves one."""
    values = dict(values)
    degrees = ("tp_size", "ulysses_degree", "ring_degree")
    if not any(name in values for name in degrees) and values.get("tile_parallel") is True:
        values |= {name: 1 for name in degrees}
    elif not any(name in values for name in degrees):
        from tilecast.runtime.picker import suggest_topology

        num_gpus = values.get("num_gpus", 1)
        dp_degree = values.get("dp_degree")
        if isinstance(num_gpus, int) and isinstance(dp_degree, int) and dp_degree >= 1:
            num_gpus //= dp_degree  # the layout of one data-parallel replica group
        num_heads = model_num_heads(values.get("model_path", "tiny/k6sr"))
        layout = (
            suggest_topology(num_gpus, num_heads=num_heads or 0)
            if isinstance(num_gpus, int) and num_gpus >= 1
            else None
        )
        if layout is not None:
            values |= {"tp_size": 1, "ulysses_degree": layout.ulysses_degree, "ring_degree": layout.ring_degree}
    return ServeConfig(**values)


def shared_options(template: Callable[..., None]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator giving typer commands the options declared by ``template``'s signature, before
    their own; a decorated command takes them as one dict, its parameter ``shared``.
    (``tilecast topology check|plan`` share their selection flags this way.)"""
    shared = list(inspect.signature(template, eval_str=True).parameters.values())
    names = [p.name for p in shared]

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        own = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.name != "shared"]

        @functools.wraps(command)
        def run(**kwargs):
            return command(shared={name: kwargs.pop(name) for name in names}, **kwargs)

        parameters = [*shared, *own]
        run.__signature__ = inspect.Signature(parameters)
        run.__annotations__ = {p.name: p.annotation for p in parameters}
        del run.__wrapped__  # typer must see the combined signature, not the command's own
        return run

    return decorate
