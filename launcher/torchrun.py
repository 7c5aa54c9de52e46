"""Start N local ranks of this very command through torchrun, and leave nothing behind.

``tilecast serve --num-gpus 2 ...`` re-runs itself as ``python -m torch.distributed.run
--nproc-per-node 2 -m tilecast serve ...``; under torchrun (``RANK`` set) the same command runs
as one rank. SIGINT/SIGTERM go to torchrun, which stops the ranks; any rank still alive
afterwards (found through the pid files ranks write into ``TILECAST_RUN_DIR``) is killed.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def torchrun_command(nproc: int, args: list[str], *, master_port: int) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1",
        "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1",
        "--master-port", str(master_port),
        "--max-restarts", "0",
        "-m", "tilecast", *args,
    ]


def _alive_tilecast(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"tilecast" in cmdline


def reap_ranks(run_dir: Path) -> list[int]:
    """Kill every rank of this run that is still alive; returns the pids killed."""
    killed = []
    for pid_file in run_dir.glob("rank*.pid"):
        try:
            pid = int(pid_file.read_text())
        except (OSError, ValueError):
            continue
        if _alive_tilecast(pid):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    return killed


def launch(nproc: int, args: list[str], *, grace_s: float = 30.0) -> int:
    """Run ``tilecast <args>`` on ``nproc`` local ranks; returns the exit code to use."""
    env = dict(os.environ)
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    env.setdefault("PYTHONUNBUFFERED", "1")
    with tempfile.TemporaryDirectory(prefix="tilecast-run-") as run_dir:
        env["TILECAST_RUN_DIR"] = run_dir
        command = torchrun_command(nproc, args, master_port=free_port())
        logger.debug("launching %s", " ".join(command))
        child = subprocess.Popen(command, env=env, start_new_session=True)
        stop_requested: list[float] = []  # monotonic time of each stop signal

        def forward(signum, _frame) -> None:
            stop_requested.append(time.monotonic())
            try:
                child.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            while True:
                try:
                    code = child.wait(timeout=0.5)
                    break
                except subprocess.TimeoutExpired:
                    if stop_requested and time.monotonic() - stop_requested[0] > grace_s:
                        child.kill()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            killed = reap_ranks(Path(run_dir))
            if killed:
                logger.warning("killed %d rank process(es) left behind: %s", len(killed), killed)
    if stop_requested:
        return 0
    return code

