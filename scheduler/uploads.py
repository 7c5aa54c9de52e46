"""What a queued job holds of its input files, and the bound on what queued jobs hold in memory.

A job's uploads are either bytes the client sent, or a ``PinnedFile``: a server-side file opened
once, when the request was accepted, and read through that descriptor when the job is
dispatched. Whatever happens to the path in between (a symlink swapped, the file renamed), the job
reads the file that was checked. ``UploadBudget`` caps the bytes that queued jobs keep in memory
(``--max-queued-upload-mb``); pinned files cost a descriptor, not memory, until dispatch.
"""

from __future__ import annotations

import os
from typing import Union


class PinnedFile:
    """An open, checked, read-only regular file (``os.open`` descriptor) standing in for an upload."""

    def __init__(self, fd: int, size: int, *, name: str = "") -> None:
        self.fd, self.size, self.name = fd, size, name

    @property
    def path(self) -> str:
        """A path that opens this very file (the descriptor's ``/proc`` link, not the name given)."""
        return f"/proc/self/fd/{self.fd}"

    def read_all(self) -> bytes:
        """The file's bytes (from offset 0, whatever other readers do)."""
        chunks, offset = [], 0
        while True:
            chunk = os.pread(self.fd, 1 << 24, offset)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            offset += len(chunk)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()


Upload = Union[bytes, PinnedFile]


def materialize(uploads: dict[str, Upload]) -> dict[str, bytes]:
    """Every upload as bytes (pinned files read now)."""
    return {name: value.read_all() if isinstance(value, PinnedFile) else value for name, value in uploads.items()}


def release(uploads: dict[str, Upload]) -> None:
    """Close the pinned files among ``uploads``."""
    for value in uploads.values():
        if isinstance(value, PinnedFile):
            value.close()


def held_bytes(uploads: dict[str, Upload]) -> int:
    """Bytes ``uploads`` keep in memory (pinned files: none)."""
    return sum(len(value) for value in uploads.values() if not isinstance(value, PinnedFile))


class UploadBudget:
    """The total of upload bytes held by queued jobs, against ``limit_bytes``."""

    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes < 1:
            raise ValueError(f"max_queued_upload_bytes must be >= 1, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self.held = 0
        self.refused = 0
        """Submits refused because the queue held too many upload bytes."""

    def admit(self, size: int) -> str | None:
        """Take ``size`` bytes, or return why not (the request is refused as overloaded)."""
        if size and self.held + size > self.limit_bytes:
            self.refused += 1
            return (
                f"queued uploads already hold {self.held / 2**20:.1f} MiB; this {size / 2**20:.1f} MiB upload would"
                f" pass the {self.limit_bytes / 2**20:g} MiB cap (--max-queued-upload-mb); retry later"
            )
        self.held += size
        return None

    def give_back(self, size: int) -> None:
        self.held -= size
        assert self.held >= 0, self.held
