"""A one-rank server inside the calling process: the scheduler, router and compute loop run as
threads. The same ``Client`` talks to it over a real socket; tests run against both this and a
torchrun server, and a notebook can serve without spawning processes.
"""

from __future__ import annotations

import threading

from tilecast.runtime.config import ServeConfig
from tilecast.runtime.rank import start_rank
from tilecast.runtime.server import RankZero
from tilecast.runtime.torchrun_env import under_torchrun


class InProcessServer:
    def __init__(self, config: ServeConfig) -> None:
        if config.num_gpus != 1 or under_torchrun():
            raise ValueError("InProcessServer runs exactly one rank outside torchrun; use `tilecast serve` for more")
        self.rt = start_rank(config)
        self.zero = RankZero(self.rt, exit_process=False)
        self._thread = threading.Thread(target=self._compute, name="tilecast-compute", daemon=True)
        self.error: BaseException | None = None

    @property
    def endpoint(self) -> str:
        return self.zero.sockets.bound_endpoint

    @property
    def http_url(self) -> str | None:
        """Base URL of the HTTP front end (``http_port`` set), else None."""
        return self.zero.http.url if self.zero.http is not None else None

    def _compute(self) -> None:
        try:
            self.zero.compute()
        except BaseException as exc:  # noqa: BLE001 - surfaced through .error and the failed jobs
            self.error = exc
            self.zero.fail(f"compute loop failed: {exc}")

    def start(self) -> "InProcessServer":
        self.zero.start()
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.zero.scheduler.inbox.put(("shutdown", "in-process server stopped"))
        self._thread.join(timeout)
        self.zero.scheduler.halt()
        self.zero.watchdog.stop()
        self.zero.stop_http()
        self.zero.sockets.stop()
        self.rt.pipeline.close()

    def __enter__(self) -> "InProcessServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
