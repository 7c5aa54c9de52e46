"""Server-side input files a request may name: opened once, under the operator's allowed roots.

A request's path (``video_path``) is checked and opened in one go at submit time; the job then
reads that descriptor (``scheduler.uploads.PinnedFile``) when it runs, so swapping a symlink or
renaming a file between submit and run changes nothing. Errors never tell a client more than it
already knows: a path that is outside the allowed roots (after following symlinks), or that leads
there, is only "not allowed" (no resolved path, no hint whether it exists); names are echoed as the
client wrote them.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from tilecast.scheduler.uploads import PinnedFile


def _under(path: str, roots: list[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip(os.sep) + os.sep) for root in roots)


def open_allowed(given: str, allowed_dirs: list[str] | tuple[str, ...], *, field: str) -> PinnedFile:
    """Open ``given`` read-only if it is a regular file under one of ``allowed_dirs``.

    ``ValueError`` names ``field`` and the path as given. The check is made on the opened
    descriptor itself (its ``/proc/self/fd`` target and ``fstat``), so no path component can be
    swapped between the check and the use.
    """
    if not allowed_dirs:
        raise ValueError(
            f"{field} is disabled on this server: the operator allowed no directories "
            "(--allowed-video-dir), so upload the file instead"
        )
    not_allowed = ValueError(
        f"{field} {given!r} is not allowed: it must name a file under the server's "
        "allowed directories (--allowed-video-dir)"
    )
    if "\x00" in given or ".." in Path(given).parts:
        raise not_allowed
    roots = [os.path.realpath(d) for d in allowed_dirs]
    real = os.path.realpath(given)
    if not _under(real, roots):
        raise not_allowed
    try:
        # O_NONBLOCK: opening a FIFO must not block the scheduler; O_NOFOLLOW: a last component
        # swapped for a symlink after realpath fails here.
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ValueError(f"{field} {given!r} does not exist") from None
    except OSError:
        raise not_allowed from None
    try:
        info = os.fstat(fd)
        opened = os.readlink(f"/proc/self/fd/{fd}") if os.path.isdir("/proc/self/fd") else real
        if not _under(opened, roots):
            raise not_allowed
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{field} {given!r} is not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return PinnedFile(fd, info.st_size, name=Path(given).name)
