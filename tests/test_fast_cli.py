"""``tilecast --help``, ``--version``, ``serve --help`` and ``topology check`` import no torch.

Each command runs in a fresh interpreter under ``-X importtime``, whose report (stderr) names
every module imported; torch alone costs about a second, so none of these may pull it in.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.metadata import version

import pytest

from tests.harness import ServerProcess

COMMANDS = {
    "help": ["--help"],
    "version": ["--version"],
    "serve-help": ["serve", "--help"],
    "topology-check": ["topology", "check", "--num-gpus", "2", "--ulysses-degree", "2", "--model-path", "tiny/k6sr"],
}


def imported_modules(args: list[str]) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run ``python -P -X importtime -m tilecast ARGS``; the result and the modules it imported."""
    done = subprocess.run(
        [sys.executable, "-P", "-X", "importtime", "-m", "tilecast", *args], capture_output=True, text=True, timeout=120
    )
    modules = {match.group(1) for match in re.finditer(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S+)", done.stderr, re.M)}
    return done, modules


@pytest.mark.parametrize("name", list(COMMANDS))
def test_command_imports_no_torch(name):
    done, modules = imported_modules(COMMANDS[name])
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert modules, "no -X importtime report"
    assert "typer" in modules  # the report is read correctly
    heavy = sorted(m for m in modules if m == "torch" or m.startswith("torch."))
    assert not heavy, f"tilecast {' '.join(COMMANDS[name])} imported {heavy[:5]}"


def test_version_prints_the_package_version():
    done = subprocess.run(
        [sys.executable, "-P", "-m", "tilecast", "--version"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == f"tilecast {version('tilecast')}"


@pytest.mark.timeout(120)
def test_serving_without_http_needs_no_http_packages(tmp_path):
    """uvicorn and starlette are needed for --http-port only: a server without it comes up when
    neither can be imported (a GPU image may not carry them)."""
    blocked = tmp_path / "blocked"
    for name in ("uvicorn", "starlette"):
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text(f"raise ImportError('{name} is blocked by this test')\n")
    path = os.pathsep.join(filter(None, [str(blocked), os.environ.get("PYTHONPATH")]))
    server = ServerProcess(
        "--model-path", "test/allreduce", "--device", "cpu", "--output-dir", str(tmp_path / "out"),
        env={"PYTHONPATH": path},
    )  # fmt: skip
    try:
        with server.client(timeout=60.0) as client:
            assert client.generate(timeout=60.0).job.state == "completed"
    finally:
        server.stop()
    assert "blocked by this test" not in server.log()
