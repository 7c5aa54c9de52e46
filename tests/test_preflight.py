"""`serve`/`generate` refuse only on tilecast's one rule set; the deployment guide's recipes are warnings."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from tests.harness import record_rank_starts
from tilecast.launcher import cli, preflight
from tilecast.runtime import picker
from tilecast.runtime.config import ServeConfig


@pytest.fixture
def started(monkeypatch):
    """Record the config the command would start ranks with, instead of starting them."""
    return record_rank_starts(monkeypatch)


def _invoke(*args: str):
    return CliRunner().invoke(cli.app, ["serve", "--model-path", "tiny/k6sr", "--device", "cpu", *args])


@pytest.mark.parametrize("backend", ["sdpa_cudnn", "sdpa_flash", "sdpa_math", "fa", "torch_sdpa"])
def test_ring_with_an_explicit_backend_passes(started, backend):
    result = _invoke("--num-gpus", "2", "--ring-degree", "2", "--attention-backend", backend)
    assert result.exit_code == 0, result.output
    assert started and started[0].ring_degree == 2


def test_sixteen_ranks_over_two_nodes_pass_under_torchrun(started, monkeypatch):
    for key, value in dict(
        RANK="0", WORLD_SIZE="16", LOCAL_WORLD_SIZE="8", MASTER_ADDR="127.0.0.1", MASTER_PORT="1"
    ).items():
        monkeypatch.setenv(key, value)
    result = _invoke("--num-gpus", "16", "--ulysses-degree", "4", "--ring-degree", "4")
    assert result.exit_code == 0, result.output
    assert "picker covers" not in result.output
    assert preflight.node_layout() == (2, 8)


def test_rule_set_errors_still_refuse_with_every_error(started):
    result = _invoke("--num-gpus", "2", "--ulysses-degree", "5", "--attention-backend", "flash")
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "TP times Ulysses must divide the 12 DiT heads: TP 1 x Ulysses 5 = 5." in text
    assert "unknown attention backend 'flash'" in text
    assert not started


def test_recipe_findings_are_warnings_for_known_hardware():
    config = ServeConfig(device="cpu", num_gpus=2, ring_degree=2, attention_backend="sdpa_cudnn")
    assert preflight.topology_errors(config) == []
    warnings = preflight.recipe_warnings(config, "h200")
    assert warnings[0] == picker.RECIPE_PREFIX + picker.ERR_SDPA_RING
    assert picker.WARN_SCOPE in warnings
    assert preflight.recipe_warnings(config, None) == []  # CPU or a GPU the guide does not list


def test_recipe_warnings_are_printed_not_refused(started, monkeypatch):
    monkeypatch.setattr(preflight, "recipe_warnings", lambda config, hardware, nodes=1: ["a recipe warning"])
    result = _invoke("--num-gpus", "2", "--ring-degree", "2")
    assert result.exit_code == 0, result.output
    assert "topology warning: a recipe warning" in result.output
