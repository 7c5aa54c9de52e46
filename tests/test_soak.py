"""Soak: two torchrun ranks serve 2,000 requests from 8 client threads with random cancels and a
malformed message in every 50; nothing is lost, rank 0's memory and the job folders stay bounded.

Every request must end in a terminal state the client can read (completed, or cancelled when the
thread cancelled it), every malformed message gets an error reply, and the server serves on
afterwards. Rank 0's RSS is sampled after a warm-up and at the end; the growth is printed (run
with ``-s``) and must stay under 50 MB. ``--max-stored-outputs`` bounds the job folders throughout.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import msgspec
import pytest
import zmq

from tests.harness import ServerProcess, plain_socket, serve_args
from tilecast.scheduler import protocol as P

NUM_THREADS = 8
REQUESTS_PER_THREAD = 250
MAX_STORED = 32
MAX_RSS_GROWTH_MB = 50.0

MALFORMED = [
    [b"Z", b"junk"],
    [b"S", msgspec.msgpack.encode([1, {"prompt": 3}, ["video"]])],
    [b"S", msgspec.msgpack.encode({"req_id": 1})],
    [b"Q"],
]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def job_folders(out: Path) -> int:
    return sum(1 for path in out.iterdir() if path.name.startswith("job_"))


class Tally:
    """What the client threads saw, under one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.completed = self.cancelled = self.malformed_answered = 0
        self.problems: list[str] = []
        self.max_folders = 0

    def add(self, **counts) -> None:
        with self.lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def problem(self, text: str) -> None:
        with self.lock:
            self.problems.append(text)


def send_malformed(endpoint: str, frames: list[bytes], tally: Tally) -> None:
    with plain_socket(endpoint, receive_timeout_ms=10_000) as sock:
        try:
            sock.send_multipart(frames)
            reply, _ = P.decode(sock.recv_multipart())
            if isinstance(reply, P.ErrorReply) and reply.code == "bad_request":
                tally.add(malformed_answered=1)
            else:
                tally.problem(f"malformed {frames[0]!r} got {reply!r}")
        except zmq.Again:
            tally.problem(f"malformed {frames[0]!r} got no reply")


def client_thread(server: ServerProcess, out: Path, index: int, tally: Tally) -> None:
    rng = random.Random(index)
    with server.client(timeout=60) as client:
        for i in range(REQUESTS_PER_THREAD):
            if i % 50 == 49:
                send_malformed(server.endpoint, MALFORMED[(index + i) % len(MALFORMED)], tally)
            job_id = client.submit(
                prompt=f"soak {index} {i}", width=32, height=32, num_inference_steps=1, seed=index * 10_000 + i
            )
            cancel = rng.random() < 0.1
            if cancel:
                client.cancel(job_id)
            job = client.result(job_id, timeout=120)
            state = job.job.state
            if state == "cancelled" and cancel:
                tally.add(cancelled=1)
                continue
            if state != "completed" or not job.files:
                tally.problem(f"{job_id}: {state} {job.job.error} with {len(job.files)} files (cancelled: {cancel})")
                continue
            tally.add(completed=1)
            folders = job_folders(out)
            with tally.lock:
                tally.max_folders = max(tally.max_folders, folders)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_soak_two_ranks_nothing_lost_memory_and_folders_bounded(tmp_path, tiny_cache):
    out = tmp_path / "out"
    args = serve_args(
        "tiny/flux", out, num_gpus=2, batching_mode="dynamic", batching_max_size=8, max_stored_outputs=MAX_STORED
    )
    with ServerProcess(*args, env={"TILECAST_CACHE": str(tiny_cache)}) as server:
        with server.client() as client:  # warm-up: allocator pools, kernels, the first batch shapes
            for i in range(40):
                client.generate(prompt=f"warm {i}", width=32, height=32, num_inference_steps=1, timeout=60)
        rss_before = rss_mb(server.pid)

        tally = Tally()
        threads = [threading.Thread(target=client_thread, args=(server, out, i, tally)) for i in range(NUM_THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=800)
        assert not any(thread.is_alive() for thread in threads), "client threads did not finish"
        rss_after = rss_mb(server.pid)

        with server.client() as client:
            assert client.health().status == "serving"
            stats = client.stats()
        growth = rss_after - rss_before
        print(
            f"\nsoak: {tally.completed} completed, {tally.cancelled} cancelled, "
            f"{tally.malformed_answered} malformed answered; rank-0 RSS {rss_before:.1f} -> {rss_after:.1f} MB "
            f"(+{growth:.1f}); max job folders {tally.max_folders}; jobs {stats['jobs']}"
        )

    total = NUM_THREADS * REQUESTS_PER_THREAD
    assert tally.problems == [], tally.problems[:10]
    assert tally.completed + tally.cancelled == total
    assert tally.malformed_answered == NUM_THREADS * (REQUESTS_PER_THREAD // 50)
    assert tally.max_folders <= MAX_STORED + NUM_THREADS  # the bound, plus jobs that finished meanwhile
    assert growth < MAX_RSS_GROWTH_MB, f"rank-0 RSS grew {growth:.1f} MB"
