"""Client library: ``from tilecast.client import Client, AsyncClient``.

Imports neither torch nor diffusers (msgspec and pyzmq only).
"""

from tilecast.scheduler.client import (  # noqa: F401
    AsyncClient,
    Client,
    JobFailedError,
    ServerDeadError,
    ServerError,
    TilecastError,
)

__all__ = ["Client", "AsyncClient", "TilecastError", "ServerError", "JobFailedError", "ServerDeadError"]
