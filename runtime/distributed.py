"""Process groups for one tilecast run, and the plan broadcast over a CPU group (the world's, or
one replica group's: ``broadcast_plan_in``, ``group_ok``).

Under torchrun every rank calls ``init_ranks``: gloo on CPU; on CUDA, NCCL for device tensors
plus a gloo group for plans and small CPU collectives. Outside torchrun (one rank, no
``RANK`` in the environment) no process group is created and broadcasts are no-ops.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import logging
import os
import signal

import torch
import torch.distributed as dist

from tilecast.runtime.torchrun_env import under_torchrun
from tilecast.scheduler import protocol as P

logger = logging.getLogger(__name__)


def _parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` (Linux ``/proc``), None when unknown."""
    try:
        stat = open(f"/proc/{pid}/stat", "rb").read()
        return int(stat[stat.rindex(b")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (the torchrun agent) dies.

    The agent may already be gone by the time this runs (the launcher was killed while the rank
    started): under ``tilecast serve``'s launcher (``TILECAST_LAUNCHER_PID``) the parent must be a
    child of that launcher, else this rank exits at once instead of serving as an orphan.
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: torchrun's own teardown still applies
        return
    launcher = os.environ.get("TILECAST_LAUNCHER_PID")
    if launcher and launcher.isdigit() and _parent_of(os.getppid()) != int(launcher):
        logger.error("tilecast: the launcher (pid %s) or torchrun is gone; this rank exits", launcher)
        os._exit(1)


@dataclasses.dataclass(kw_only=True)
class Ranks:
    """This process's place in the run."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    cpu_group: object | None
    """gloo group over all ranks (None with one rank and no torchrun)."""
    device_group: object | None
    """Group for device tensors: NCCL on CUDA, the gloo group on CPU."""

    @property
    def distributed(self) -> bool:
        return self.cpu_group is not None


def init_ranks(device: str, *, timeout_s: float) -> Ranks:
    """Create the process groups for ``device`` (``cpu`` or ``cuda``). A rank has called
    ``die_with_parent`` before (``rank.start_rank``, first thing)."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but CUDA is not available on this machine")
    if not under_torchrun():
        dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        return Ranks(rank=0, world_size=1, local_rank=0, device=dev, cpu_group=None, device_group=None)

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = datetime.timedelta(seconds=timeout_s)
    if device == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", timeout=timeout, device_id=dev)
        cpu_group = dist.new_group(backend="gloo", timeout=timeout)
        device_group = dist.group.WORLD
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
        cpu_group = device_group = dist.group.WORLD
    logger.debug("rank %d/%d up on %s", rank, world_size, dev)
    return Ranks(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=dev,
        cpu_group=cpu_group,
        device_group=device_group,
    )


def shutdown_ranks(ranks: Ranks) -> None:
    """Tear the groups down together: a barrier first, so no rank closes its connections while a
    peer's last gloo transfer is in flight (which can abort the peer at exit)."""
    if ranks.distributed and dist.is_initialized():
        try:
            dist.barrier(group=ranks.cpu_group)
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


def broadcast_bytes(data: bytes | None, ranks: Ranks) -> bytes:
    """Rank 0's ``data`` on every rank (length first, then the bytes)."""
    if not ranks.distributed:
        assert data is not None
        return data
    return broadcast_bytes_in(data, group=ranks.cpu_group, src=0, is_src=ranks.rank == 0)


def broadcast_bytes_in(data: bytes | None, *, group, src: int, is_src: bool) -> bytes:
    """Global rank ``src``'s ``data`` on every rank of ``group`` (a CPU group; None: one rank)."""
    if group is None:
        assert data is not None
        return data
    length = torch.tensor([len(data) if is_src else 0], dtype=torch.int64)
    dist.broadcast(length, src=src, group=group)
    if is_src:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    else:
        buf = torch.empty(int(length.item()), dtype=torch.uint8)
    if buf.numel():
        dist.broadcast(buf, src=src, group=group)
    return data if is_src else buf.numpy().tobytes()


def broadcast_plan(plan: P.Plan | None, ranks: Ranks) -> P.Plan:
    """Rank 0 passes the plan; every rank returns it."""
    data = broadcast_bytes(P.encode_plan(plan) if ranks.rank == 0 else None, ranks)
    return plan if ranks.rank == 0 else P.decode_plan(data)


def broadcast_plan_in(plan: P.Plan | None, *, group, src: int, is_src: bool) -> P.Plan:
    """The plan of global rank ``src`` (a replica group's leader) on every rank of ``group``."""
    data = broadcast_bytes_in(P.encode_plan(plan) if is_src else None, group=group, src=src, is_src=is_src)
    return plan if is_src else P.decode_plan(data)


def broadcast_flag(flag: bool, group) -> bool:
    """Rank 0's ``flag`` on every rank of ``group`` (a CPU group)."""
    tensor = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.broadcast(tensor, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return bool(tensor.item())


def all_ranks_ok(ok: bool, ranks: Ranks) -> bool:
    """True when ``ok`` holds on every rank (so all ranks agree a unit of work failed)."""
    return group_ok(ok, ranks.cpu_group if ranks.distributed else None)


def group_ok(ok: bool, group) -> bool:
    """True when ``ok`` holds on every rank of ``group`` (a CPU group; None: this rank alone)."""
    if group is None:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
