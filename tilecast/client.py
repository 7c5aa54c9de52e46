"""Client library: ``from tilecast.client import Client, AsyncClient``.

Imports neither torch nor diffusers (msgspec and pyzmq only).
"""

from tilecast.scheduler.client import (  # noqa: F401
    AsyncClient,
    AuthenticationError,
    Client,
    JobFailedError,
    ReadyInfo,
    ServerDeadError,
    ServerError,
    TilecastError,
    read_ready_file,
)

__all__ = [
    "Client",
    "AsyncClient",
    "TilecastError",
    "ServerError",
    "JobFailedError",
    "ServerDeadError",
    "AuthenticationError",
    "ReadyInfo",
    "read_ready_file",
]
