"""Start N local ranks of this very command through torchrun, and leave nothing behind.

``tilecast serve --num-gpus 2 ...`` re-runs itself as ``python -m torch.distributed.run
--standalone --nproc-per-node 2 -m tilecast serve ...``; under torchrun (``RANK`` set) the same
command runs as one rank. SIGINT/SIGTERM go to torchrun, which stops the ranks; any rank still
alive afterwards (found through the pid files ranks write into ``TILECAST_RUN_DIR``) is killed.

- **Rendezvous**: ``--standalone`` makes the torchrun agent host the c10d store on a port the OS
  picks (``localhost:0``) and share that same listening store with its workers
  (``TORCHELASTIC_USE_AGENT_STORE``; ``MASTER_PORT`` is the store's bound port), so there is no
  port picked here that someone else could take before torchrun binds it.
- **Orphans**: torchrun starts through a small exec wrapper that asks Linux to send it SIGTERM
  when this launcher dies (``PR_SET_PDEATHSIG``, which survives ``exec``) and exits at once if the
  launcher is already gone; each rank in turn dies with the torchrun agent
  (``runtime/distributed.die_with_parent``, told the launcher's pid by ``TILECAST_LAUNCHER_PID``).
  A ``kill -9`` of the launcher so takes everything under it down within seconds.
- **Inherited signal masks**: a blocked signal stays blocked through ``fork`` and ``exec``, so a
  parent that started ``tilecast serve`` with SIGTERM blocked (a Python program inside a
  ``SignalWatcher``-style thread, some supervisors) made the launcher deaf to SIGTERM and torchrun
  deaf to its parent-death signal: it outlived the launcher with every rank. The launcher and the
  torchrun wrapper unblock SIGINT/SIGTERM before relying on them.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)


_DIE_WITH_LAUNCHER = (
    "import ctypes, os, signal, sys\n"
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})  # kept through exec\n"
    "launcher = int(sys.argv[1])\n"
    "ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != launcher:  # the launcher died before prctl took effect\n"
    "    sys.exit(1)\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n"
)
"""Run as ``python -c _DIE_WITH_LAUNCHER <launcher pid> <argv...>``: exec ``python <argv...>`` with a
parent-death signal set (no ``preexec_fn``: the launcher already has threads, numpy's BLAS pool)."""


STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
"""The signals that stop a launcher and the torchrun under it."""


STANDALONE = ("--standalone", "--nnodes", "1")
"""torchrun's rendezvous for this launcher: one node hosting its own store (see the module doc)."""


def torchrun_command(nproc: int, args: list[str], *, rendezvous: tuple[str, ...] = STANDALONE) -> list[str]:
    """``python`` arguments that run ``tilecast <args>`` on ``nproc`` ranks of this node through torchrun,
    which joins the other nodes (if any) through ``rendezvous``; a failed rank is never restarted."""
    return [
        "-m",
        "torch.distributed.run",
        *rendezvous,
        "--nproc-per-node",
        str(nproc),
        "--local-addr",
        "127.0.0.1",
        "--max-restarts",
        "0",
        "-m",
        "tilecast",
        *args,
    ]


def with_parent_death_signal(argv: list[str]) -> list[str]:
    """``python <argv>`` that gets SIGTERM when this process dies (Linux; plain elsewhere)."""
    if not sys.platform.startswith("linux"):
        return [sys.executable, *argv]
    return [sys.executable, "-c", _DIE_WITH_LAUNCHER, str(os.getpid()), *argv]


def terminate(proc: subprocess.Popen, timeout: float) -> bool:
    """SIGTERM ``proc`` if it still runs and wait up to ``timeout`` seconds for it to exit; False if it
    is still running then (the caller decides how to kill it)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
    return True


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
        env["TILECAST_LAUNCHER_PID"] = str(os.getpid())
        command = with_parent_death_signal(torchrun_command(nproc, args))
        logger.debug("launching %s", " ".join(command))
        child = subprocess.Popen(command, env=env, start_new_session=True)
        stop_requested: list[float] = []  # monotonic time of each stop signal

        def forward(signum, _frame) -> None:
            stop_requested.append(time.monotonic())
            try:
                child.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

        previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # the parent may have blocked them
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
