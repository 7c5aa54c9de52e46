"""The `tilecast` command refuses bad set-ups before any rank starts, and routes models as documented."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from tilecast.launcher import cli
from tilecast.runtime.models.k6sr.pipeline import K6SRPipeline
from tilecast.runtime.models.k6sr.tiny import ensure_tiny_k6sr
from tilecast.runtime.registry import resolve_pipeline


@pytest.fixture
def no_ranks(monkeypatch):
    """Fail the test if the command gets as far as starting ranks."""

    def started(*_args, **_kwargs):
        raise AssertionError("ranks were started despite an invalid set-up")

    monkeypatch.setattr(cli, "_run_ranks", started)


def _invoke(*args: str):
    return CliRunner().invoke(cli.app, list(args))


def test_invalid_topology_lists_every_error_and_starts_nothing(no_ranks):
    result = _invoke(
        "serve", "--model-path", "tiny/k6sr", "--device", "cpu", "--num-gpus", "2", "--ulysses-degree", "5"
    )
    assert result.exit_code == 2
    assert "GPU count must equal TP times Ulysses times Ring" in result.output
    assert "TP times Ulysses must divide the 12 DiT heads" in result.output


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        ('{"schema_version": 1, "rules": [{"model_contains": "flux", "max_batchsize": 2}]}', "max_batch_size"),
        ('{"schema_version": 2, "rules": []}', "schema_version"),
        ('{"schema_version": 1, "rules": [{"model_contains": "flux"}]}', "max_batch_size"),
        ('{"schema_version": 1, "rules": [', "JSON"),
    ],
    ids=["unknown-key", "schema", "missing-cap", "bad-json"],
)
def test_bad_batching_rules_stop_start_up(no_ranks, tmp_path, rules, message):
    path = tmp_path / "rules.json"
    path.write_text(rules)
    result = _invoke(
        "serve",
        "--model-path",
        "tiny/flux",
        "--device",
        "cpu",
        "--batching-mode",
        "dynamic",
        "--batching-max-size",
        "4",
        "--batching-config",
        str(path),
    )
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_bad_values_name_their_flag(no_ranks):
    result = _invoke("serve", "--model-path", "tiny/k6sr", "--device", "cpu", "--batching-mode", "sometimes")
    assert result.exit_code == 2 and "--batching-mode" in result.output
    result = _invoke("serve", "--model-path", "tiny/k6sr", "--device", "tpu")
    assert result.exit_code == 2 and "--device" in result.output
    import torch

    if not torch.cuda.is_available():
        result = _invoke("serve", "--model-path", "tiny/k6sr")  # the default device is cuda
        assert result.exit_code == 2 and "--device cpu" in result.output
    result = _invoke("serve", "--model-path", "/no/such/model", "--device", "cpu")
    assert result.exit_code == 2 and "/no/such/model" in result.output


def test_model_id_keeps_sr_routing_for_a_renamed_checkpoint(tmp_path):
    renamed = tmp_path / "my-upscaler"
    shutil.copytree(ensure_tiny_k6sr(), renamed)
    index = json.loads((renamed / "model_index.json").read_text())
    index["_class_name"] = "DiffusionPipeline"  # what a re-exported or renamed checkpoint may carry
    (renamed / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="--model-id"):
        resolve_pipeline(str(renamed))
    assert resolve_pipeline(str(renamed), "Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers") is K6SRPipeline
    assert resolve_pipeline(str(ensure_tiny_k6sr())) is K6SRPipeline


NEW_FAMILY = """
from pathlib import Path

from tilecast.runtime.probe import AllReducePipeline


class EchoPipeline(AllReducePipeline):
    family = "echo"
    builtin_name = "tiny/echo"
    diffusers_class = "EchoDiffusionPipeline"
    model_id_hints = ("Echo-1",)

    @classmethod
    def ensure_builtin(cls, cache_dir=None):
        return Path(__file__).parent / "echo-checkpoint"
"""


def test_a_declared_pipeline_is_routed_from_its_declaration_alone(tmp_path, monkeypatch):
    """One line in PIPELINES plus the class's declaration: built-in name, checkpoint directories of
    its diffusers class, model-id hints and the pre-launch checkpoint all reach it; nothing else lists it."""
    from tilecast.runtime import registry

    (tmp_path / "echo_family.py").write_text(NEW_FAMILY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "PIPELINES", (*registry.PIPELINES, "echo_family:EchoPipeline"))
    registry.pipelines.cache_clear()
    try:
        echo = registry.resolve_pipeline("tiny/echo")
        assert echo.__name__ == "EchoPipeline"
        checkpoint = tmp_path / "some-checkpoint"
        checkpoint.mkdir()
        (checkpoint / "model_index.json").write_text(json.dumps({"_class_name": "EchoDiffusionPipeline"}))
        assert registry.resolve_pipeline(str(checkpoint)) is echo
        (checkpoint / "model_index.json").write_text(json.dumps({"_class_name": "DiffusionPipeline"}))
        assert registry.resolve_pipeline(str(checkpoint), "org/Echo-1-large") is echo
        assert registry.ensure_builtin_checkpoint("tiny/echo") == tmp_path / "echo-checkpoint"
        assert registry.ensure_builtin_checkpoint("random/flux") is None  # drawn at load, nothing on disk
        with pytest.raises(ValueError, match="tiny/echo"):
            registry.resolve_pipeline("tiny/no-such-model")
    finally:
        registry.pipelines.cache_clear()


def test_a_built_in_name_imports_no_model_code_past_its_own():
    """Every rank resolves ``--model-path`` and checks its checkpoint: for the probe that imports no
    model family, diffusers included (it took 4 s a process)."""
    code = (
        "import sys\n"
        "from tilecast.runtime.registry import ensure_builtin_checkpoint, resolve_pipeline\n"
        "assert resolve_pipeline('test/allreduce').builtin_name == 'test/allreduce'\n"
        "assert ensure_builtin_checkpoint('test/allreduce') is None\n"
        "loaded = [m for m in ('diffusers', 'tilecast.runtime.models.k6sr.pipeline') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-P", "-c", code], check=True, timeout=120)


LAUNCHER_IMPORTS = """
import sys
from tilecast.launcher import cli, torchrun


def launch(nproc, args, **_):
    heavy = ("torch", "diffusers", "transformers", "tilecast.runtime.models.k6sr.pipeline")
    print("loaded before torchrun:", [name for name in heavy if name in sys.modules])
    print("ranks:", nproc)
    return 0


torchrun.launch = launch
sys.argv = ["tilecast", *sys.argv[1:]]
cli.main()
"""


@pytest.mark.parametrize(
    "command",
    [
        ["generate", "--model-path", "tiny/k6sr", "--video-path", "clip.mp4", "--num-gpus", "2", "--ring-degree", "2"],
        ["serve", "--model-path", "tiny/flux", "--num-gpus", "2", "--ulysses-degree", "2", "--http-port", "0"],
    ],
)
def test_the_launcher_starts_torchrun_without_importing_torch_or_model_code(command, tmp_path):
    """A multi-rank launch validates the whole command line, then starts torchrun at once: torch,
    diffusers and the model's family are the ranks' imports (each rank makes or verifies a built-in
    checkpoint before it joins the process group). They had cost the launcher about 4 s of CPU per
    launch, and a second more to tear down at exit."""
    (tmp_path / "clip.mp4").write_bytes(b"not decoded by the launcher")
    done = subprocess.run(
        [sys.executable, "-P", "-c", LAUNCHER_IMPORTS, *command, "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "loaded before torchrun: []" in done.stdout, done.stdout
    assert "ranks: 2" in done.stdout


def test_the_command_ends_with_its_status_and_its_output_flushed():
    """``main`` ends the process with ``os._exit`` (no interpreter teardown): what the command
    printed reaches a pipe, and a refusal keeps its status."""
    version = subprocess.run(
        [sys.executable, "-P", "-m", "tilecast", "--version"], capture_output=True, text=True, timeout=120
    )
    assert version.returncode == 0 and version.stdout.startswith("tilecast "), version
    refused = subprocess.run(
        [sys.executable, "-P", "-m", "tilecast", "generate", "--model-path", "/no/such/model"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2, refused
    assert "/no/such/model" in refused.stdout + refused.stderr
    assert cli._exit_status(None) == 0 and cli._exit_status(3) == 3 and cli._exit_status(256 + 4) == 4
