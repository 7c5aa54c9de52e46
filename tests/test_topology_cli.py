"""`tilecast topology check|auto|plan`: exit codes, text and --json output."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from tests.harness import cli_flags
from tilecast.launcher.topology_cli import topology_app
from tilecast.runtime import picker

runner = CliRunner()


def invoke(*args, **options):
    """``tilecast topology`` with ``args`` (as text), then ``options`` as flags (``num_gpus=4``:
    ``--num-gpus 4``)."""
    return runner.invoke(topology_app, [*(str(a) for a in args), *cli_flags(**options)])


def invoke_json(*args: str) -> tuple[int, dict]:
    result = invoke(*args, "--json")
    return result.exit_code, json.loads(result.stdout)


# ---------------------------------------------------------------- check


def test_check_valid_manual_layout():
    result = invoke("check", "--num-gpus", 4, "--tp-size", 2, "--ulysses-degree", 2, "--ring-degree", 1)
    assert result.exit_code == 0, result.output
    assert "valid" in result.stdout
    assert "TP 2, Ulysses 2, Ring 1 (manual)" in result.stdout
    assert picker.WARN_TP_RING in result.stdout
    assert "Errors:" not in result.stdout


def test_check_lists_every_error_and_exits_1():
    result = invoke(
        "check", num_gpus=8, tp_size=1, ulysses_degree=3, ring_degree=2, hardware="rtx5090", attention_backend="fa"
    )
    assert result.exit_code == 1
    errors, recipes = result.stdout.split("Outside the deployment guide's recipes:")
    for message in (  # tilecast's rules
        "GPU count must equal TP times Ulysses times Ring, or a multiple of it",
        "TP times Ulysses must divide the 28 DiT heads: TP 1 x Ulysses 3 = 3.",
    ):
        assert message in errors
    for message in (  # the picker's, verbatim, beside them
        "GPU count must equal TP times Ulysses times Ring.",
        "TP times Ulysses must divide the 28 DiT heads.",
        "SDPA does not support Ring rotation.",
        "FA resolves to SDPA on this SM120 platform; select SDPA instead.",
    ):
        assert message in recipes.split("Warnings:")[0]
    assert "invalid (2 errors)" in result.stdout


def test_recipe_errors_alone_do_not_refuse():
    code, payload = invoke_json("check", "--num-gpus", 2, "--ring-degree", 2, "--attention-backend", "sdpa_cudnn")
    assert code == 0 and payload["valid"] is True and payload["errors"] == []
    assert payload["recipe_errors"] == [picker.ERR_SDPA_RING]
    assert picker.WARN_BACKEND_OVERRIDE in payload["warnings"]
    for backend in ("sdpa_flash", "sdpa_math", "fa", "torch_sdpa"):
        assert invoke("check", "--num-gpus", 2, "--ring-degree", 2, "--attention-backend", backend).exit_code == 0


def test_multi_node_world_size_validates():
    code, payload = invoke_json("check", "--num-gpus", 16, "--nnodes", 2, "--ulysses-degree", 4, "--ring-degree", 4)
    assert code == 0 and payload["errors"] == []
    assert payload["recipe_errors"] == [picker.ERR_NODES]
    code, payload = invoke_json("check", "--num-gpus", 16, "--ulysses-degree", 4, "--ring-degree", 4)
    assert code == 0 and payload["recipe_errors"] == [picker.ERR_GPU_RANGE]
    assert invoke("check", "--num-gpus", 16, "--nnodes", 3).exit_code == 2


def test_plan_for_two_nodes_is_a_torchrun_command():
    layout = dict(num_gpus=16, nnodes=2, ulysses_degree=4, ring_degree=4, attention_backend="sdpa_cudnn")
    result = invoke("plan", **layout, model_path="tiny/k6sr")
    assert result.exit_code == 0, result.output
    argv = shlex.split(result.stdout.strip())
    assert argv[:5] == ["torchrun", "--nnodes", "2", "--nproc-per-node", "8"]
    assert argv[argv.index("-m") : argv.index("-m") + 5] == ["-m", "tilecast", "serve", "--model-path", "tiny/k6sr"]
    assert argv[argv.index("--num-gpus") + 1] == "16"
    assert argv[argv.index("--attention-backend") + 1] == "sdpa_cudnn"


def test_check_json_matches_the_picker():
    code, payload = invoke_json("check", "--num-gpus", 8)
    assert code == 0
    assert payload["valid"] is True
    assert payload["topology"] == {"tp_size": 1, "ulysses_degree": 4, "ring_degree": 2}
    assert payload["summary"] == "TP 1, Ulysses 4, Ring 2"
    assert payload["selection"]["topology_mode"] == "auto"
    assert payload["attention"] == "fa"
    assert payload["warnings"] == [
        picker.WARN_SCOPE,
        picker.WARN_UNVERIFIED,
        picker.WARN_MANY_GPUS,
        picker.WARN_TILES,
        picker.WARN_TP_RING,
    ]
    assert payload["verification"] == {"serve": "unverified", "request": "unverified"}


def test_check_verified_recipe():
    code, payload = invoke_json(
        "check", "--num-gpus", 2, "--ulysses-degree", 2, "--hardware", "rtxpro6000", "--decode", "tiles"
    )
    assert code == 0
    assert payload["verification"]["serve"] == "verified"
    assert payload["attention"] == "torch_sdpa"


def test_check_json_errors_exit_1():
    code, payload = invoke_json("check", "--num-gpus", 1, "--placement", "fsdp")
    assert code == 1
    assert payload["valid"] is False
    (error,) = payload["errors"]
    assert error.startswith("FSDP requires multiple GPUs")
    assert payload["recipe_errors"] == ["FSDP requires multiple GPUs."]
    assert payload["verification"] == {"serve": "error", "request": "error"}


def test_check_heads_from_option_and_model_path(tmp_path):
    code, payload = invoke_json("check", "--num-gpus", 6, "--ulysses-degree", 6, "--num-heads", 12)
    assert (code, payload["errors"], payload["num_heads"]) == (0, [], 12)
    code, payload = invoke_json("check", "--num-gpus", 3, "--ulysses-degree", 3, "--model-path", "tiny/k6sr")
    assert (code, payload["num_heads"]) == (0, 12)
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({"model_dim": 1792, "axes_dims": [16, 24, 24]}))
    code, payload = invoke_json("check", "--num-gpus", 6, "--ulysses-degree", 6, "--model-path", tmp_path)
    assert code == 1
    assert payload["errors"] == ["TP times Ulysses must divide the 28 DiT heads: TP 1 x Ulysses 6 = 6."]
    assert payload["recipe_errors"] == ["TP times Ulysses must divide the 28 DiT heads."]


@pytest.mark.parametrize(
    "args",
    [
        ("--hardware", "a100"),
        ("--attention-backend", "flash"),
        ("--decode", "fast"),
        ("--placement", "disk"),
        ("--tile-batch", "3"),
        ("--offload-components", "text_encoder"),
        ("--prefetch", "9"),
        ("--num-heads", "12", "--model-path", "tiny/k6sr"),
        ("--model-path", "/nonexistent/model"),
    ],
)
def test_check_bad_values_are_usage_errors(args):
    result = invoke("check", "--num-gpus", 4, *args)
    assert result.exit_code == 2, result.output
    assert "Invalid value" in result.output or "Error" in result.output


def test_check_text_shows_notes_for_ignored_settings():
    result = invoke("check", "--num-gpus", 2, "--prefetch", 3)
    assert result.exit_code == 0
    assert "DiT prefetch 3 is ignored" in result.stdout


# ---------------------------------------------------------------- auto


@pytest.mark.parametrize(
    ("num_gpus", "layout", "code"),
    [
        (1, (1, 1, 1), 0),
        (2, (1, 2, 1), 0),
        (3, (1, 3, 1), 1),
        (4, (1, 4, 1), 0),
        (5, (1, 5, 1), 1),
        (6, (1, 6, 1), 1),
        (7, (1, 7, 1), 0),
        (8, (1, 4, 2), 0),
    ],
)
def test_auto_is_the_pickers_layout(num_gpus, layout, code):
    exit_code, payload = invoke_json("auto", "--num-gpus", num_gpus)
    assert exit_code == code
    assert (payload["tp_size"], payload["ulysses_degree"], payload["ring_degree"]) == layout
    if code:
        assert payload["errors"] == [
            f"TP times Ulysses must divide the 28 DiT heads: TP 1 x Ulysses {num_gpus} = {num_gpus}."
        ]
        assert payload["recipe_errors"] == ["TP times Ulysses must divide the 28 DiT heads."]
        assert payload["suggestion"]["ulysses_degree"] * payload["suggestion"]["ring_degree"] == num_gpus


def test_auto_text_and_other_heads():
    result = invoke("auto", "--num-gpus", 6)
    assert result.exit_code == 1
    assert "TP 1, Ulysses 6, Ring 1" in result.stdout
    assert "Suggested valid layout: TP 1, Ulysses 2, Ring 3" in result.stdout
    code, payload = invoke_json("auto", "--num-gpus", 6, "--model-path", "tiny/k6sr")
    assert code == 0 and payload["summary"] == "TP 1, Ulysses 6, Ring 1"


def test_auto_on_rtx_with_eight_gpus_needs_ring():
    # the guide has no Ring recipe on RTX; tilecast's ring runs on its SDPA kernels
    code, payload = invoke_json("auto", "--num-gpus", 8, "--hardware", "rtxpro6000")
    assert code == 0
    assert payload["errors"] == [] and payload["recipe_errors"] == ["SDPA does not support Ring rotation."]


# ---------------------------------------------------------------- plan


def test_plan_prints_the_serve_command():
    placement = dict(placement="offload", offload_components="transformer,vae", prefetch=2, decode="spatial")
    result = invoke("plan", num_gpus=2, hardware="rtxpro6000", model_path="tiny/k6sr", **placement)
    assert result.exit_code == 0, result.output
    argv = shlex.split(result.stdout.strip())
    assert argv == shlex.split(
        "tilecast serve --model-path tiny/k6sr --num-gpus 2 --tp-size 1 --ulysses-degree 2 --ring-degree 1"
        " --attention-backend torch_sdpa"
        " --vae-config.use-parallel-tiling false --vae-config.use-parallel-decode true"
        " --vae-config.parallel-decode-mode spatial_shard"
        " --layerwise-offload-components 'transformer vae' --dit-offload-prefetch-size 2"
    )
    assert picker.WARN_SPATIAL in result.stderr
    assert picker.WARN_SPATIAL not in result.stdout


def test_plan_json_and_invalid_plan():
    code, payload = invoke_json(
        "plan", "--num-gpus", 4, "--tp-size", 2, "--ulysses-degree", 2, "--model-path", "tiny/k6sr"
    )
    assert code == 0
    assert payload["command"].startswith("tilecast serve --model-path tiny/k6sr --num-gpus 4 --tp-size 2")
    assert payload["argv"] == shlex.split(payload["command"])
    result = invoke("plan", "--num-gpus", 4, "--ulysses-degree", 3)
    assert result.exit_code == 1
    assert result.stdout == ""
    assert "GPU count must equal TP times Ulysses times Ring, or a multiple of it" in result.stderr
    code, payload = invoke_json("plan", "--num-gpus", 4, "--ulysses-degree", 3)
    assert code == 1 and payload["command"] is None and len(payload["errors"]) == 2


# ---------------------------------------------------------------- a real process


def test_module_runs_as_a_subprocess():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tilecast.launcher.topology_cli",
            "check",
            "--num-gpus",
            "4",
            "--ulysses-degree",
            "3",
            "--ring-degree",
            "2",
            "--attention-backend",
            "torch_sdpa",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    payload = json.loads(proc.stdout)
    assert payload["errors"] == [
        "GPU count must equal TP times Ulysses times Ring, or a multiple of it (the data-parallel replicas): "
        "num_gpus=4, but TP 1 x Ulysses 3 x Ring 2 = 6.",
        "TP times Ulysses must divide the 28 DiT heads: TP 1 x Ulysses 3 = 3.",
    ]
    assert payload["recipe_errors"] == [
        "GPU count must equal TP times Ulysses times Ring.",
        "TP times Ulysses must divide the 28 DiT heads.",
        "SDPA does not support Ring rotation.",
    ]


def test_builtin_without_known_heads_skips_the_head_rule():
    code, payload = invoke_json("check", "--num-gpus", 3, "--ulysses-degree", 3, "--model-path", "test/allreduce")
    assert (code, payload["num_heads"], payload["errors"]) == (0, None, [])
    result = invoke("check", "--num-gpus", 3, "--ulysses-degree", 3, "--model-path", "test/allreduce")
    assert "unknown (rule skipped)" in result.stdout
