"""Runs the HTTP front end (``http_api``) under uvicorn in a thread of rank 0.

The listening socket is bound in the caller's thread, so a taken port fails ``start`` at once
with a clear error (and ``--http-port 0`` picks a free port, shown by ``url``). uvicorn runs its
own event loop in a daemon thread; it installs no signal handlers there (rank 0's
``SignalWatcher`` owns SIGINT/SIGTERM). ``stop`` asks it to exit, lets in-flight responses
finish for up to ``graceful_s``, and joins the thread.

The front end reaches the scheduler over its ZeroMQ endpoint like any client: no shared
state, no second queue.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import uvicorn

from tilecast.scheduler.http_api import ApiConfig, HttpApi, ModelInfo
from tilecast.scheduler.ready import connectable

logger = logging.getLogger(__name__)


class HttpFrontEnd:
    """The uvicorn server of one ``HttpApi`` in a background thread."""

    def __init__(self, api: HttpApi, *, host: str = "127.0.0.1", port: int = 30000, graceful_s: float = 2.0) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"--http-port must be in 0..65535, got {port}")
        self.api = api
        self.host, self.port = host, port
        self.graceful_s = graceful_s
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @classmethod
    def for_scheduler(
        cls,
        *,
        endpoint: str,
        pipeline=None,
        host: str,
        port: int,
        max_upload_mb: float,
        max_message_mb: float | None = None,
        api_key: str | None = None,
        serve_config=None,
        world_size: int = 1,
    ) -> "HttpFrontEnd":
        """The front end of the scheduler at ``endpoint`` serving ``pipeline`` (rank 0's copy);
        ``serve_config`` (the run's ``ServeConfig``) adds the model's aliases, precision and layout."""
        config = ApiConfig(
            endpoint=connectable(endpoint),
            max_upload_bytes=int(max_upload_mb * 2**20),
            max_message_bytes=int(max_message_mb * 2**20) if max_message_mb else None,
            model=ModelInfo.from_pipeline(pipeline, serve_config, world_size) if pipeline is not None else None,
            output_retention_s=getattr(serve_config, "output_retention_s", None),
            api_key=api_key,
        )
        return cls(HttpApi(config), host=host, port=port)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 15.0) -> "HttpFrontEnd":
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise OSError(exc.errno, f"--http-host/--http-port {self.host}:{self.port}: {exc.strerror}") from exc
        sock.listen(2048)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.api,
            log_config=None,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=self.graceful_s,
            server_header=False,
        )
        self._server = uvicorn.Server(config)

        def run() -> None:
            try:
                asyncio.run(self._server.serve(sockets=[sock]))
            except BaseException as exc:  # noqa: BLE001 - reported by start() / the log
                self._error = exc
                logger.exception("HTTP front end stopped with an error")
            finally:
                sock.close()

        self._thread = threading.Thread(target=run, name="tilecast-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the HTTP front end did not start on {self.url}: {self._error or 'timeout'}")
            time.sleep(0.02)
        logger.info("HTTP API (OpenAI-style) on %s -> scheduler %s", self.url, self.api.config.endpoint)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        if self._server is None or self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(1.0)
            if self._thread.is_alive():
                logger.warning("HTTP front end thread did not stop within %.1f s", timeout + 1.0)
