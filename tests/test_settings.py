"""Every setting is declared once (``ServeConfig``) and reaches the CLI, the ``--config`` file and
the config the ranks get from that declaration; booleans, unknown keys and wrong flags read well."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.harness import record_rank_starts
from tilecast.launcher import cli
from tilecast.runtime.config import ServeConfig
from tilecast.runtime.settings import SERVE_ONLY_SECTIONS, declared

FIELDS = declared(ServeConfig)
CONTEXT = {  # flags a sample value needs besides its own
    "tp_size": ["--num-gpus", "2"],
    "ulysses_degree": ["--num-gpus", "2"],
    "ring_degree": ["--num-gpus", "2"],
    "host": ["--allow-unauthenticated"],
    "model_path": ["--tp-size", "1"],
    "batching_max_size": ["--batching-mode", "dynamic"],
    "batching_config": ["--batching-mode", "dynamic"],
    "dit_offload_prefetch_size": ["--layerwise-offload-components", "transformer"],
    "dit_layerwise_resident_layers": ["--layerwise-offload-components", "transformer"],
}


@pytest.fixture
def captured(monkeypatch):
    """The ``ServeConfig`` a command would start ranks with (no rank starts, no topology check)."""
    monkeypatch.setattr(cli, "validate_topology", lambda config: None)
    return record_rank_starts(monkeypatch)


def _sample(item, tmp_path: Path):
    """A valid value other than the default, from the declaration (a few need a real file)."""
    adapter = tmp_path / "style.safetensors"
    adapter.touch()  # the settings check the file exists; loading it is tests/test_lora.py's
    special = {
        "lora_paths": (str(adapter),),
        "lora_dirs": (tmp_path,),
        "batching_config": tmp_path / "rules.json",
        "layerwise_offload_components": "vae",
        "cpu_offload_components": "vae",
        "allowed_video_dirs": (tmp_path,),
    }
    if item.name in special:
        return special[item.name]
    facts, default = item.setting, item.default
    if item.kind is bool:
        return not default
    if facts.choices:
        return next(c for c in facts.choices if c != default)
    if item.kind is int:
        return default + 1 if default is not None else int(facts.ge or 0) + 1
    if item.kind is float:
        return default * 2 if default is not None else float(facts.gt or facts.ge or 0) + 1
    if item.kind is Path:
        return tmp_path / f"{item.name}.out"
    return f"{default or 'value'}-x"


def _text(value) -> list[str]:
    return [str(value).lower()] if isinstance(value, bool) else [str(value)]


def _args(item, value) -> list[str]:
    if item.multiple:
        return [part for one in value for part in (item.flag, str(one))]
    return [item.flag, *_text(value)]


def _get(config, item):
    return functools.reduce(getattr, item.path, config)


def _invoke(*args, base=None):
    base = ("--model-path", "test/allreduce") if base is None else base
    return CliRunner().invoke(cli.app, ["serve", *base, *args])


@pytest.fixture
def rules(tmp_path):
    (tmp_path / "rules.json").write_text('{"schema_version": 1, "rules": []}')


def test_every_declared_field_is_a_flag_in_the_help():
    serve = CliRunner().invoke(cli.app, ["serve", "--help"], env={"COLUMNS": "80"}).output
    generate = CliRunner().invoke(cli.app, ["generate", "--help"], env={"COLUMNS": "80"}).output
    for item in FIELDS:
        assert item.flag in serve, item.flag
        assert (item.flag in generate) == (item.section not in SERVE_ONLY_SECTIONS), item.flag
    assert "…" not in serve  # nothing truncated at 80 columns
    assert max(len(line) for line in serve.splitlines()) <= 80


@pytest.mark.parametrize("item", [i for i in FIELDS if i.setting.choices != (i.default,)], ids=lambda i: i.name)
def test_every_field_reaches_the_config_from_a_flag_and_from_the_file(item, captured, tmp_path, rules):
    value = _sample(item, tmp_path)
    context = CONTEXT.get(item.name, [])
    result = _invoke(*context, *_args(item, value))
    assert result.exit_code == 0, result.output
    assert _get(captured[-1], item) == value
    assert _get(ServeConfig(), item) != value  # the sample proves something
    file = tmp_path / "serve.json"
    head, *rest = item.path
    plain = [str(v) for v in value] if isinstance(value, tuple) else str(value) if isinstance(value, Path) else value
    file.write_text(json.dumps({head: {rest[0]: plain}} if rest else {head: plain}))
    result = _invoke(*context, "--config", str(file), base=() if item.name == "model_path" else None)
    assert result.exit_code == 0, result.output
    assert _get(captured[-1], item) == value


def test_flags_override_the_config_file(captured, tmp_path):
    file = tmp_path / "serve.toml"
    file.write_text(
        'port = 4000\n[batching]\nbatching_mode = "dynamic"\nbatching_max_size = 4\n[vae]\nuse_parallel_tiling = true\n'
    )
    assert _invoke("--config", str(file), "--port", "5000", "--vae-config.use-parallel-tiling", "false").exit_code == 0
    config = captured[-1]
    assert (config.port, config.batching_mode, config.batching_max_size) == (5000, "dynamic", 4)
    assert config.vae.use_parallel_tiling is False


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--vae-config.use-parallel-tiling"], True),
        (["--vae-config.use-parallel-tiling", "true"], True),
        (["--vae-config.use-parallel-tiling", "false"], False),
        (["--vae-config.use-parallel-tiling=no"], False),
        (["--vae-config.use-parallel-tiling", "--port", "0"], True),
    ],
)
def test_booleans_work_bare_and_with_true_or_false(captured, args, expected):
    assert _invoke(*args).exit_code == 0
    assert captured[-1].vae.use_parallel_tiling is expected
    assert _invoke("--compile", "false").exit_code == 0 and captured[-1].compile is False
    assert _invoke("--compile").exit_code == 0 and captured[-1].compile is True


def test_a_bad_boolean_names_its_flag(captured):
    result = _invoke("--use-fsdp-inference", "maybe")
    assert result.exit_code == 2 and "--use-fsdp-inference takes true or false, got 'maybe'" in result.output


def test_an_unknown_config_key_names_the_nearest_one(captured, tmp_path):
    file = tmp_path / "serve.toml"
    file.write_text("batching_max_sise = 4\n")
    result = _invoke("--config", str(file))
    assert result.exit_code == 2
    assert "unknown setting 'batching_max_sise'; did you mean 'batching_max_size'?" in " ".join(result.output.split())
    file.write_text("[vae]\nfast_decod = false\n")
    assert "did you mean 'vae.fast_decode'?" in " ".join(_invoke("--config", str(file)).output.split())
    file.write_text("port = 'high'\n")
    assert "--port must be an integer, got 'high'" in " ".join(_invoke("--config", str(file)).output.split())
    file.write_text("port = 1\n")
    result = CliRunner().invoke(cli.app, ["generate", "--model-path", "test/allreduce", "--config", str(file)])
    assert result.exit_code == 2 and "not a setting of this command" in result.output


def test_a_wrong_flag_suggests_the_nearest_one():
    result = _invoke("--batching-max-sise", "2")
    assert result.exit_code == 2 and "--batching-max-size" in result.output


def test_the_api_key_comes_from_the_environment_and_is_never_logged(captured, monkeypatch):
    from tilecast.runtime.settings import describe

    monkeypatch.setenv("TILECAST_API_KEY", "s3cret")
    assert _invoke().exit_code == 0
    assert captured[-1].api_key == "s3cret"
    assert "s3cret" not in describe(captured[-1]) and "api_key = '<redacted>'" in describe(captured[-1])
    assert "s3cret" not in repr(captured[-1])
