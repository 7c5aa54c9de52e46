"""``tilecast bench batching``: singleton serving against dynamic batching on the same traffic, per topology.

Two real ``tilecast serve`` subprocesses run one after the other on the same model and topology:
first with ``--batching-max-size 1`` (every request alone), then with ``--batching-mode dynamic``.
The topology is ``--num-gpus N`` with ``--dp-degree D`` (data-parallel replica groups serving
different batches at once) and ``--ulysses-degree U`` when given; with more than one rank, the same
two servers first run on one rank too (``baseline``), so one run reports throughput and p50/p95 per
topology and the ratio of the requested topology to one rank.
Against each, ``num_clients`` threads (closed loop: a client sends its next request when the last
one returns) each send ``requests_per_client`` compatible requests with distinct prompts and seeds.
Each server is warmed up first, not counted: ``WARMUP_SEQUENTIAL`` requests one at a time, then
one concurrent wave of ``num_clients`` (the first calls of a process and of each batch shape are
far slower than steady state, which would otherwise penalise whichever server goes first).

Reported per server (per topology): throughput (completed requests per second of wall time), p50/p95 latency
(nearest rank), failures and the server's own batching counters over the measured requests; plus the dynamic/singleton
throughput ratio and latency ratios. Printed as one table (``report.print_table``); returned as a dict.

With ``peer="diffusers"`` the same traffic first runs on diffusers' own pipeline in this process
(``peer``: one request at a time, and offline with the whole batch), and the
throughput ratios against it are added (keys ``peer_one_at_a_time``, ``peer_offline_batch`` and
``PEER_RATIOS``). ``dtype`` reaches the servers as ``--dtype`` and the peer as its dtype.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from tilecast.client import Client, read_ready_file
from tilecast.launcher.bench.report import print_table, ratio
from tilecast.launcher.torchrun import terminate
from tilecast.scheduler.batching_metrics import percentile_nearest_rank

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 300.0
"""How long a server may take to load its model."""
REQUEST_TIMEOUT_S = 600.0
"""How long one request may take before the bench gives up on it."""
WARMUP_SEQUENTIAL = 3
"""Requests sent one at a time before measuring (then one concurrent wave of ``num_clients``)."""
PEERS = ("diffusers",)
"""What ``peer`` may name (``tilecast.launcher.bench.peer``)."""


def bench_request(client: int, request: int) -> dict[str, Any]:
    """Prompt and seed of a measured request: distinct for every client and request (peer included)."""
    return {"prompt": f"bench client {client} request {request}", "seed": client * 1000 + request}


class _Server:
    """One ``tilecast serve`` subprocess in a session of its own; ``stop`` leaves nothing behind."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.endpoint: str | None = None
        """The bound endpoint, from the server's ready file (``wait_ready``)."""
        self.log_path = log_path
        self.ready_file = log_path.with_suffix(".ready.json")
        command = [
            sys.executable,
            "-m",
            "tilecast",
            "serve",
            *args,
            "--port",
            "0",
            "--ready-file",
            str(self.ready_file),
        ]
        logger.info("starting %s", " ".join(command))
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )

    def wait_ready(self) -> None:
        try:
            self.endpoint = read_ready_file(self.ready_file, READY_TIMEOUT_S, server=self.proc).endpoint
            with Client(self.endpoint) as client:
                client.wait_ready(READY_TIMEOUT_S)
        except Exception as exc:
            tail = self.log_path.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"server did not come up ({exc}); log tail:\n{tail}") from exc

    def stop(self, timeout: float = 60.0) -> None:
        if not terminate(self.proc, timeout):
            logger.warning("server %d ignored SIGTERM for %.0fs; killing its process group", self.proc.pid, timeout)
        try:  # the ranks torchrun started live in the session this Popen created
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(timeout=10)


def _counters(client: Client) -> tuple[int, int, float]:
    """(dispatches, requests, merged dispatches) so far, from the server's batching stats."""
    cumulative = client.stats()["batching"]["cumulative"]
    return cumulative["dispatches"], cumulative["requests"], cumulative["merged_rate"] * cumulative["dispatches"]


def _wave(client: Client, count: int, fields: dict, tag: str) -> None:
    threads = [
        threading.Thread(
            target=client.generate,
            kwargs=dict(prompt=f"{tag} {i}", seed=i, timeout=REQUEST_TIMEOUT_S, **fields),
            daemon=True,
        )
        for i in range(count)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _drive(endpoint: str, *, num_clients: int, requests_per_client: int, fields: dict) -> dict[str, Any]:
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    with Client(endpoint, timeout=REQUEST_TIMEOUT_S) as client:
        # Warm-up, not counted: the first calls of a fresh process (and of each new batch shape)
        # are many times slower than steady state (allocator, kernel selection).
        for i in range(WARMUP_SEQUENTIAL):
            client.generate(prompt=f"warm-up {i}", seed=i, timeout=REQUEST_TIMEOUT_S, **fields)
        _wave(client, num_clients, fields, "warm-up wave")
        before = _counters(client)
        start = threading.Barrier(num_clients + 1)

        def user(index: int) -> None:
            start.wait()
            for k in range(requests_per_client):
                began = time.perf_counter()
                try:
                    client.generate(**bench_request(index, k), timeout=REQUEST_TIMEOUT_S, **fields)
                except Exception as exc:  # noqa: BLE001 - counted and reported
                    with lock:
                        errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                with lock:
                    latencies.append(time.perf_counter() - began)

        threads = [threading.Thread(target=user, args=(i,), daemon=True) for i in range(num_clients)]
        for thread in threads:
            thread.start()
        start.wait()
        t0 = time.perf_counter()
        for thread in threads:
            thread.join()
        wall_s = time.perf_counter() - t0
        after = _counters(client)
    dispatches, requests, merged = (a - b for a, b in zip(after, before))
    return {
        "requests": len(latencies),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "wall_s": wall_s,
        "throughput_rps": len(latencies) / wall_s if wall_s > 0 else 0.0,
        "p50_ms": percentile_nearest_rank(latencies, 50.0) * 1000.0,
        "p95_ms": percentile_nearest_rank(latencies, 95.0) * 1000.0,
        "avg_batch_size": requests / dispatches if dispatches else 0.0,
        "merged_rate": round(merged) / dispatches if dispatches else 0.0,
        "dispatches": dispatches,
    }


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchTopology:
    """One server layout of the bench."""

    num_gpus: int = 1
    dp_degree: int | None = None
    """``--dp-degree`` (None: not passed, the server derives it)."""
    ulysses_degree: int | None = None
    """``--ulysses-degree`` (None: not passed, the server picks it)."""

    @classmethod
    def parse(cls, text: str) -> "BenchTopology":
        """``dp2``, ``ulysses2``, ``dp2xulysses2`` (``--topology``): the ranks are the product of the degrees."""
        degrees: dict[str, int] = {}
        for part in text.strip().lower().split("x"):
            name = part.rstrip("0123456789")
            value = part[len(name) :]
            if name not in ("dp", "ulysses") or not value or int(value) < 1 or name in degrees:
                raise ValueError(
                    f"--topology {text!r}: expected dp<N>, ulysses<N> or dp<N>xulysses<N> (N >= 1), e.g. dp2xulysses2"
                )
            degrees[name] = int(value)
        dp, ulysses = degrees.get("dp"), degrees.get("ulysses")
        return cls(num_gpus=(dp or 1) * (ulysses or 1), dp_degree=dp, ulysses_degree=ulysses)

    @property
    def label(self) -> str:
        """``1 rank``, ``2 ranks dp 2``, ``4 ranks dp 2 x ulysses 2``."""
        text = f"{self.num_gpus} rank{'s' if self.num_gpus > 1 else ''}"
        parts = [f"dp {self.dp_degree}"] if self.dp_degree else []
        parts += [f"ulysses {self.ulysses_degree}"] if self.ulysses_degree else []
        return text + (" " + " x ".join(parts) if parts else "")

    def serve_args(self) -> list[str]:
        args = ["--num-gpus", str(self.num_gpus)]
        if self.dp_degree is not None:
            args += ["--dp-degree", str(self.dp_degree)]
        if self.ulysses_degree is not None:
            args += ["--ulysses-degree", str(self.ulysses_degree)]
        return args

    def check(self) -> None:
        """``ValueError`` listing what ``tilecast serve`` would refuse about this layout."""
        from tilecast.runtime.topology import Topology

        for name in ("dp_degree", "ulysses_degree"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        errors = Topology.check(
            num_gpus=self.num_gpus, ulysses_degree=self.ulysses_degree or 1, dp_degree=self.dp_degree
        )
        if errors:
            raise ValueError("; ".join(errors))


def run_batching_bench(
    model_path: str,
    *,
    num_clients: int,
    requests_per_client: int,
    width: int,
    height: int,
    steps: int,
    device: str,
    num_gpus: int = 1,
    dp_degree: int | None = None,
    ulysses_degree: int | None = None,
    topologies: Sequence[BenchTopology] = (),
    baseline: bool = True,
    dtype: str | None = None,
    peer: str | None = None,
    extra_serve_args: Sequence[str] = (),
    batching_max_size: int = 8,
    batching_delay_ms: float = 20.0,
    print_table: bool = True,
) -> dict[str, Any]:
    """Run the same closed-loop traffic against a singleton and a dynamic-batching server; see the module doc.

    The servers run with ``num_gpus`` ranks (``dp_degree`` / ``ulysses_degree`` passed when given),
    or on each of ``topologies`` in turn (``BenchTopology.parse``; exclusive with those three);
    with ``baseline`` and more than one rank, on one rank first as well: ``results["topologies"]``
    then has a row per topology, each but the first with ``vs_one_rank`` (throughput and latency
    ratios to one rank, per mode) and ``throughput_ratio`` (dynamic / singleton);
    ``results["singleton"]``/``["dynamic"]``/``["vs_one_rank"]`` are the last topology's.
    ``dtype`` is passed to both servers as ``--dtype`` (their default when None). ``peer="diffusers"``
    first measures the same traffic on diffusers alone in this process (``bench.peer``)
    and adds its rows and the ratios against it.
    """
    from tilecast.runtime.config import DTYPES, default_dtype

    for name, value in (
        ("num_clients", num_clients),
        ("requests_per_client", requests_per_client),
        ("steps", steps),
        ("num_gpus", num_gpus),
        ("batching_max_size", batching_max_size),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if peer is not None and peer not in PEERS:
        raise ValueError(f"--peer must be one of {', '.join(PEERS)} or none, got {peer!r}")
    if topologies and (num_gpus != 1 or dp_degree is not None or ulysses_degree is not None):
        raise ValueError("--topology names the layouts itself; leave out --num-gpus, --dp-degree and --ulysses-degree")
    requested = list(topologies) or [
        BenchTopology(num_gpus=num_gpus, dp_degree=dp_degree, ulysses_degree=ulysses_degree)
    ]
    for topology in requested:
        topology.check()
    if peer is not None and any(topology.num_gpus != 1 for topology in requested):
        raise ValueError(f"--peer {peer} runs on one device; measure one rank only, got {requested[-1].label}")
    if baseline and any(topology.num_gpus > 1 for topology in requested) and requested[0] != BenchTopology():
        requested.insert(0, BenchTopology())
    fields = {"width": width, "height": height, "num_inference_steps": steps}
    dtype_args = ["--dtype", dtype] if dtype else []
    modes = {
        "singleton": ["--batching-max-size", "1"],
        "dynamic": [
            "--batching-mode",
            "dynamic",
            "--batching-max-size",
            str(batching_max_size),
            "--batching-delay-ms",
            str(batching_delay_ms),
        ],
    }
    results: dict[str, Any] = {
        "model": model_path,
        "num_clients": num_clients,
        "requests_per_client": requests_per_client,
        "width": width,
        "height": height,
        "steps": steps,
        "device": device,
        "num_gpus": num_gpus,
        "dp_degree": dp_degree,
        "ulysses_degree": ulysses_degree,
        "dtype": dtype or default_dtype(device),
        "peer": peer,
        "topologies": [],
    }
    if peer is not None:
        from tilecast.launcher.bench.peer import measure_diffusers_peer

        peer_modes = measure_diffusers_peer(
            model_path,
            num_clients=num_clients,
            requests_per_client=requests_per_client,
            fields=fields,
            device=device,
            dtype=results["dtype"],
        )
        results.update({f"peer_{mode}": row for mode, row in peer_modes.items()})
    with tempfile.TemporaryDirectory(prefix="tilecast-bench-") as tmp:
        for index, topology in enumerate(requested):
            row: dict[str, Any] = {"topology": topology.label, **dataclasses.asdict(topology)}
            for mode, mode_args in modes.items():
                name = f"t{index}-{mode}"
                args = [
                    "--model-path",
                    model_path,
                    *topology.serve_args(),
                    "--device",
                    device,
                    "--output-dir",
                    str(Path(tmp, name)),
                    *dtype_args,
                    *mode_args,
                    *extra_serve_args,
                ]
                server = _Server(args, Path(tmp, f"{name}.log"))
                try:
                    server.wait_ready()
                    row[mode] = _drive(
                        server.endpoint,
                        num_clients=num_clients,
                        requests_per_client=requests_per_client,
                        fields=fields,
                    )
                finally:
                    server.stop()
            row.update(_ratios(row["dynamic"], row["singleton"]))
            if index and topology.num_gpus > 1:
                one = results["topologies"][0]
                row["vs_one_rank"] = {mode: _ratios(row[mode], one[mode]) for mode in modes}
            results["topologies"].append(row)
    last = results["topologies"][-1]
    results.update(
        {key: last[key] for key in (*modes, "throughput_ratio", "p50_ratio", "p95_ratio", "vs_one_rank") if key in last}
    )
    single, dynamic = results["singleton"], results["dynamic"]
    if peer is not None:
        one, batch = results["peer_one_at_a_time"], results["peer_offline_batch"]
        results["dynamic_vs_peer_offline_batch"] = ratio(dynamic["throughput_rps"], batch["throughput_rps"])
        results["dynamic_vs_peer_one_at_a_time"] = ratio(dynamic["throughput_rps"], one["throughput_rps"])
        results["singleton_vs_peer_one_at_a_time"] = ratio(single["throughput_rps"], one["throughput_rps"])
    if print_table:
        print_bench_table(results)
    return results


def _ratios(row: dict[str, Any], reference: dict[str, Any]) -> dict[str, float]:
    """Throughput and p50/p95 latency of ``row`` over ``reference``."""
    return {
        "throughput_ratio": ratio(row["throughput_rps"], reference["throughput_rps"]),
        "p50_ratio": ratio(row["p50_ms"], reference["p50_ms"]),
        "p95_ratio": ratio(row["p95_ms"], reference["p95_ms"]),
    }


PEER_RATIOS = {
    "dynamic_vs_peer_offline_batch": "ratio dynamic / {peer} offline batch",
    "dynamic_vs_peer_one_at_a_time": "ratio dynamic / {peer} one at a time",
    "singleton_vs_peer_one_at_a_time": "ratio singleton / {peer} one at a time",
}
"""Throughput ratios against the peer: result key -> table row label."""


BATCHING_COLUMNS = ("mode", "requests", "errors", "throughput (req/s)", "p50 (ms)", "p95 (ms)", "avg batch", "merged")
"""The batching report's columns, in order."""


def bench_table_rows(results: dict[str, Any]) -> list[dict[str, str]]:
    """The report's rows (cells already formatted), peer rows first, then the two servers and the ratios."""
    rows = []
    for mode in ("one_at_a_time", "offline_batch"):
        row = results.get(f"peer_{mode}")
        if row is not None:
            rows.append(
                {
                    "mode": f"{results['peer']} {mode.replace('_', ' ')}",
                    "requests": str(row["requests"]),
                    "throughput (req/s)": f"{row['throughput_rps']:.3f}",
                    "p50 (ms)": f"{row['p50_ms']:.1f}",
                    "avg batch": f"{row['batch_size']:.2f}",
                }
            )
    topologies = results.get("topologies") or [results]
    several = len(topologies) > 1
    for topology in topologies:
        prefix = f"{topology['topology']}: " if several else ""
        for mode in ("singleton", "dynamic"):
            row = topology[mode]
            rows.append(
                {
                    "mode": prefix + mode,
                    "requests": str(row["requests"]),
                    "errors": str(row["errors"]),
                    "throughput (req/s)": f"{row['throughput_rps']:.3f}",
                    "p50 (ms)": f"{row['p50_ms']:.1f}",
                    "p95 (ms)": f"{row['p95_ms']:.1f}",
                    "avg batch": f"{row['avg_batch_size']:.2f}",
                    "merged": f"{row['merged_rate'] * 100:.0f}%",
                }
            )
        rows.append(_ratio_row(f"{prefix}ratio dynamic / singleton", topology))
        for mode, ratios in (topology.get("vs_one_rank") or {}).items():
            rows.append(_ratio_row(f"ratio {topology['topology']} / 1 rank ({mode})", ratios))
    for key, label in PEER_RATIOS.items():
        if key in results:
            rows.append({"mode": label.format(peer=results["peer"]), "throughput (req/s)": f"{results[key]:.2f}x"})
    return rows


def _ratio_row(label: str, ratios: dict[str, float]) -> dict[str, str]:
    return {
        "mode": label,
        "throughput (req/s)": f"{ratios['throughput_ratio']:.2f}x",
        "p50 (ms)": f"{ratios['p50_ratio']:.2f}x",
        "p95 (ms)": f"{ratios['p95_ratio']:.2f}x",
    }


def print_bench_table(results: dict[str, Any]) -> None:
    """Print ``run_batching_bench``'s results as one table."""
    print_table(
        bench_table_rows(results),
        BATCHING_COLUMNS,
        title=(
            f"Dynamic batching bench: {results['model']} {results['width']}x{results['height']}, "
            f"{results['steps']} steps, {results['num_clients']} clients x {results['requests_per_client']} requests, "
            f"{results['device']}"
            f"{' (' + ', '.join(t['topology'] for t in results['topologies']) + ')' if results.get('topologies') else ''}"
            f", {results['dtype']}"
        ),
    )
