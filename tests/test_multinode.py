"""`tilecast generate` on two torchrun "nodes" of two gloo ranks each matches one rank.

Two real ``torchrun --nnodes 2 --nproc-per-node 2`` agents on this machine form one world of 4
(``WORLD_SIZE=4``, ``LOCAL_WORLD_SIZE=2``): the topology is validated against the world size,
not the ranks of one node. Rendezvous: this test holds the c10d rendezvous store itself (a
``TCPStore`` server bound to port 0, so the OS picks the port and nobody can take it first), and
both agents join it as clients (``--rdzv-conf is_host=false``); the agent that becomes node 0
hosts the workers' store on a port the OS picks (torch's shared-store mode). Every process is
started with a parent-death signal and its own session, and killed by session in ``finally``.

Tolerance as in ``test_generate_topologies.py``: at most 1 level on at most 0.1% of the uint8 values.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.harness import k6sr_generate_args, saved_frames
from tilecast.launcher.torchrun import torchrun_command, with_parent_death_signal
from tilecast.runtime.synthetic import write_test_video

TIMEOUT_S = 240


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TILECAST_LAUNCHER_PID",
        "TILECAST_RUN_DIR",
    ):
        env.pop(key, None)
    return env


def _stop(procs: list[subprocess.Popen]) -> None:
    """Kill what this test started: each agent's session (the agent and its ranks)."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return write_test_video(tmp_path_factory.mktemp("in") / "clip.mp4", 192, 64, 9, 24.0)


@pytest.fixture(scope="module")
def single_rank(clip, tmp_path_factory):
    out = tmp_path_factory.mktemp("r1")
    done = subprocess.run(
        [sys.executable, "-m", "tilecast", *k6sr_generate_args(clip, out)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=out,
        env=_env(),
    )  # also builds the tiny checkpoint, which ranks under torchrun only verify
    assert done.returncode == 0, done.stdout + done.stderr
    return saved_frames(out)


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_generate_on_two_nodes_matches_one_rank(clip, single_rank, tmp_path):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    out = tmp_path / "out"
    topology = ["--num-gpus", "4", "--ulysses-degree", "2", "--ring-degree", "2"]
    # Both agents join the store this test holds (see the module doc).
    rendezvous = (
        "--nnodes",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{store.port}",
        "--rdzv-id",
        "multinode",
        "--rdzv-conf",
        "is_host=false",
    )
    torchrun = torchrun_command(2, [*k6sr_generate_args(clip, out), *topology], rendezvous=rendezvous)
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        for node in range(2):
            log = open(tmp_path / f"node{node}.log", "w+")
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    with_parent_death_signal(torchrun),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=_env(),
                    cwd=tmp_path,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + TIMEOUT_S
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(5)  # one node failed: give the other a moment to report, then stop
                break
            time.sleep(0.5)
        codes = [p.poll() for p in procs]
    finally:
        _stop(procs)
        del store
    text = "".join(f"--- node {i} ---\n" + (log.seek(0) or log.read()) for i, log in enumerate(logs))
    for log in logs:
        log.close()
    assert codes == [0, 0], text
    assert "picker covers" not in text and "topology error" not in text

    path, frames = saved_frames(out)
    ref_path, ref = single_rank
    assert all(re.fullmatch(r"clip_sr2x_\d{8}-\d{6}\.mp4", p.name) for p in (path, ref_path)), (path, ref_path)
    assert frames.shape == ref.shape == (9, 128, 384, 3)
    diff = np.abs(frames - ref)
    print(f"two nodes x two ranks: max diff {diff.max()}, differing values {(diff > 0).mean():.2e}")
    assert diff.max() <= 1 and (diff > 0).mean() <= 1e-3
