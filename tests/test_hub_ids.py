"""Hugging Face Hub ids as ``--model-path``, offline, against a cache laid out as huggingface_hub
lays it out (``models--OWNER--NAME/refs/main`` naming a snapshot under ``snapshots/``).

huggingface_hub reads ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE`` when it is imported, so each case runs
in a fresh process.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tilecast.runtime.models.families.flux import TINY_FLUX

pytestmark = pytest.mark.timeout(300)
REPO = "black-forest-labs/FLUX.1-dev"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path, checkpoint: Path) -> Path:
    """A huggingface_hub cache holding ``checkpoint`` as ``REPO`` at ``COMMIT``."""
    repo = root / ("models--" + REPO.replace("/", "--"))
    shutil.copytree(checkpoint, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return root


def run(code: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, env=env, timeout=240)


def test_a_hub_id_serves_from_the_offline_cache(tiny_cache, tmp_path):
    cache = hub_cache(tmp_path / "hub", TINY_FLUX.ensure(tiny_cache))
    code = f"""
from tilecast.client import Client
from tilecast.runtime.config import ServeConfig
from tilecast.runtime.hub import local_dir
from tilecast.runtime.inproc import InProcessServer
from tilecast.runtime.registry import resolve_pipeline
print("dir", local_dir({REPO!r}))
print("pipeline", resolve_pipeline({REPO!r}).__name__)
config = ServeConfig(model_path={REPO!r}, device="cpu", port=0, output_dir={str(tmp_path / "out")!r})
with InProcessServer(config) as server, Client(server.endpoint, timeout=120) as client:
    print("job", client.generate(prompt="a hub lighthouse", width=32, height=32, num_inference_steps=1, timeout=120).job.state)
"""
    done = run(code, cache)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"dir {cache / ('models--' + REPO.replace('/', '--')) / 'snapshots' / COMMIT}" in done.stdout
    assert "pipeline FluxT2IPipeline" in done.stdout and "job completed" in done.stdout


def test_a_hub_id_missing_from_the_offline_cache_is_a_clear_error(tmp_path):
    code = """
from tilecast.runtime.registry import resolve_pipeline
try:
    resolve_pipeline("someone/not-cached")
except ValueError as exc:
    print("error", exc)
"""
    done = run(code, tmp_path / "empty")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "error --model-path 'someone/not-cached': no snapshot in the Hugging Face cache" in done.stdout
    assert "HF_HUB_OFFLINE is set" in done.stdout
