"""The watchdog's rules on a fake clock: silence means dead; stuck means every busy rank stopped
counting, and a long stage that calls ``ctx.alive()`` keeps counting (the K-VAE decode does, per block)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch

from tests.harness import make_context
from tilecast.client import ServerDeadError
from tilecast.runtime.watchdog import ProgressBeat, Watchdog, WatchdogConfig


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def dog():
    clock = FakeClock()
    config = WatchdogConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0, stuck_timeout_s=20.0)
    watchdog = Watchdog(world_size=3, beat=ProgressBeat(), config=config, on_fatal=lambda reason: None, clock=clock)
    yield watchdog, clock
    watchdog._sock.close()


def test_a_silent_rank_is_dead(dog):
    watchdog, clock = dog
    clock.now += 4.0
    watchdog.last_seen[1] = clock.now  # rank 1 keeps beating, rank 2 does not
    assert watchdog.check() is None
    clock.now += 1.5
    watchdog.last_seen[1] = clock.now
    assert watchdog.check() == "rank 2 sent no heartbeat for 5.5 s (process died or hung hard)"


def _beat(watchdog, clock, seconds: int, counters) -> list[str | None]:
    """Advance ``seconds``; each second every rank heartbeats with ``counters(second)`` ->
    ``{rank: (counter, busy)}``; returns ``check()`` after each second."""
    verdicts = []
    for second in range(seconds):
        clock.now += 1.0
        watchdog.last_seen.update({1: clock.now, 2: clock.now})
        for rank, (counter, busy) in counters(second).items():
            watchdog._observe(rank, counter, busy)
        verdicts.append(watchdog.check())
    return verdicts


def test_a_busy_rank_without_progress_is_stuck(dog):
    """Rank 1 freezes at once, rank 2 (waiting for it in a collective) ten seconds later: stuck
    once both have been still for the 20 s timeout, naming the one still longest."""
    watchdog, clock = dog
    verdicts = _beat(watchdog, clock, 32, lambda s: {0: (s, False), 1: (7, True), 2: (min(s, 10), True)})
    assert verdicts[:31] == [None] * 31  # rank 2 moved until second 11: then 20 s of grace
    assert verdicts[31] == "rank 1 made no progress for 31.0 s (stuck; --stuck-timeout-s)"


def test_a_rank_waiting_for_a_peer_that_still_beats_is_not_stuck(dog):
    """Uneven work (the last gather round, a unit with fewer chunks): rank 2 waits in a collective
    for a minute while rank 1 keeps beating. Not stuck; once rank 1 stops too, it is."""
    watchdog, clock = dog
    verdicts = _beat(watchdog, clock, 60, lambda s: {0: (s, False), 1: (s, True), 2: (7, True)})
    assert verdicts == [None] * 60
    verdicts = _beat(watchdog, clock, 21, lambda s: {0: (s, False), 1: (59, True), 2: (7, True)})
    assert verdicts[:20] == [None] * 20
    assert verdicts[20].startswith("rank 2 made no progress for 80.0 s")


def test_the_rank_that_stopped_first_is_named_by_its_own_clock_not_the_reading(dog):
    """Heartbeats arrive up to an interval late: rank 2's counter stopped 3 s before rank 1's but
    its heartbeat is read later. The verdict goes by when each counter moved, as each rank reports."""
    watchdog, clock = dog
    watchdog._observe(1, 1, False, still_s=1e6)  # loading before the watchdog started is not stillness
    assert watchdog.progress[1] == (1, 100.0)
    clock.now += 10.0
    watchdog._observe(1, 5, True, still_s=0.0)
    clock.now += 0.4
    watchdog._observe(2, 5, True, still_s=3.0)
    watchdog.last_seen.update({1: clock.now, 2: clock.now})
    clock.now += 20.0
    watchdog.last_seen.update({1: clock.now, 2: clock.now})
    assert watchdog.check() == "rank 2 made no progress for 23.0 s (stuck; --stuck-timeout-s)"


def test_alive_inside_a_long_stage_keeps_rank_0_from_being_stuck(dog):
    """A 90 s stage with no progress units (a VAE decode) that calls ``ctx.alive()`` every few
    seconds is not stuck under a 20 s timeout; the same stage without beats is."""
    watchdog, clock = dog
    beat = watchdog.beat
    ctx = make_context(world_size=3)
    ctx.heartbeat = beat.tick
    beat.set_busy(True)

    def stage(second: int) -> dict:
        if second % 5 == 4:  # every 5 s, the last one at the stage's end
            ctx.alive()
        return {0: (beat.counter, beat.busy), 1: (0, False), 2: (0, False)}

    assert _beat(watchdog, clock, 90, stage) == [None] * 90
    silent = _beat(watchdog, clock, 21, lambda s: {0: (beat.counter, beat.busy), 1: (0, False), 2: (0, False)})
    assert silent[:20] == [None] * 20 and silent[20].startswith("rank 0 made no progress for 21.0 s")


def test_alive_during_beats_on_every_module_call_and_unhooks():
    beat = ProgressBeat()
    ctx = make_context()
    ctx.heartbeat = beat.tick
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(2, 1)))
    with ctx.alive_during(net):
        net(torch.ones(1, 2))
    assert beat.counter == 5  # the two Sequentials, two Linears, one ReLU
    net(torch.ones(1, 2))
    assert beat.counter == 5  # hooks gone
    with make_context().alive_during(net):
        net(torch.ones(1, 2))  # no heartbeat: nothing hooked, nothing fails


def test_kvae_decode_beats_per_decoder_block():
    """tilecast's channels-last decoder calls ``alive`` after every block of every segment;
    diffusers' decode beats through ``alive_during`` (``stages.decode_latents`` either way)."""
    from diffusers import Kandinsky6SRVAE

    from tilecast.runtime.models.k6sr import stages
    from tilecast.runtime.models.k6sr.tiny import VAE_CONFIG
    from tilecast.runtime.models.k6sr.vae_decode import ChannelsLastDecoder

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        vae = Kandinsky6SRVAE(**VAE_CONFIG).eval().requires_grad_(False)
    blocks = 2 + sum(len(up.block) + hasattr(up, "upsample") for up in vae.decoder.up)  # mid + levels
    latents = torch.randn(1, vae.config.latent_channels, 11, 2, 2)  # three segments (5 + 4 + 2 latent frames)
    beats = []
    parts = SimpleNamespace(vae=vae, decoder=ChannelsLastDecoder(vae))
    stages.decode_latents(parts, latents, alive=lambda: beats.append(1))
    assert len(beats) == 3 * blocks

    beat = ProgressBeat()
    ctx = make_context()
    ctx.heartbeat = beat.tick
    with torch.no_grad(), ctx.alive_during(vae):
        stages.decode_latents(SimpleNamespace(vae=vae, decoder=None), latents)
    assert beat.counter > 3 * blocks


def test_idle_ranks_are_not_stuck_and_config_is_checked(dog):
    watchdog, clock = dog
    clock.now += 60.0
    watchdog.last_seen.update({1: clock.now, 2: clock.now})
    watchdog._observe(0, 1, False)
    assert watchdog.check() is None  # rank 1 and 2 idle: no progress is expected
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        WatchdogConfig(heartbeat_interval_s=1.0, heartbeat_timeout_s=1.5)


# ------------------------------------------------------------------------------------ served
@pytest.mark.timeout(120)
def test_a_served_sr_decode_longer_than_the_stuck_timeout_completes(tmp_path):
    """One tile of 41 frames: a single decode stage of several seconds on this CPU, against a 2 s
    ``--stuck-timeout-s``. The decoder's blocks beat, so the job completes and the server serves on."""
    from tests.media import write_test_video
    from tilecast.client import Client
    from tilecast.runtime.config import ServeConfig
    from tilecast.runtime.inproc import InProcessServer

    video = write_test_video(tmp_path / "long.mp4", 64, 64, 41, 24.0)
    config = ServeConfig(
        model_path="tiny/k6sr",
        device="cpu",
        port=0,
        output_dir=tmp_path / "out",
        allowed_video_dirs=(tmp_path,),
        stuck_timeout_s=2.0,
    )
    with InProcessServer(config) as srv, Client(srv.endpoint) as client:
        result = client.result(client.submit(video_path=str(video), sr_resolution_scale=2), timeout=100)
        assert result.job.state == "completed", result.job.error
        assert result.info["num_tiles"] == 1 and result.info["timings"]["decode"] > 2.0, result.info
        assert client.health().status == "serving"


def _probe_server(tmp_path, **options):
    """The probe on two CPU ranks under a 2 s ``--stuck-timeout-s``."""
    from tests.harness import ServerProcess, serve_args

    return ServerProcess(*serve_args("test/allreduce", tmp_path, num_gpus=2, stuck_timeout_s=2, **options))


@pytest.mark.timeout(120)
def test_two_ranks_a_long_beating_stage_completes_and_a_rank_that_stops_is_stuck(tmp_path):
    """Under a 2 s stuck timeout: 6 s stages that beat complete on both ranks; then a rank whose
    compute stops (its heartbeat thread still reporting) fails the server as stuck within seconds,
    named as the one that stopped first (its peer works 1.5 s more, then waits in the all-reduce)."""
    from tilecast.client import Client

    server = _probe_server(tmp_path)
    try:
        with server.client() as client:
            for seed in range(2):
                result = client.result(client.submit(size=2, seed=seed, stage_s=6.0), timeout=60)
                assert result.job.state == "completed", (result.job.error, server.log())
            stopped_at = time.monotonic()
            hung = client.submit(size=2, hang_rank=1, sleep_s=1.5)
        with Client(server.endpoint, heartbeat_s=1.0, dead_after_s=3.0) as client:
            try:
                outcome = client.result(hung, timeout=30).job.error or ""
            except ServerDeadError as exc:
                outcome = str(exc)
        assert "rank 1 made no progress" in outcome, (outcome, server.log())
        assert time.monotonic() - stopped_at < 20
        assert server.wait(timeout=30) != 0
    finally:
        server.stop()


@pytest.mark.timeout(120)
def test_a_sigstopped_rank_is_declared_dead_while_its_peer_beats(tmp_path):
    """SIGSTOP freezes a rank's compute and heartbeats alike: even though rank 0 keeps beating in its
    long stage, the frozen rank is named after ``--heartbeat-timeout-s``."""
    from tests.harness import rank_pid
    from tilecast.client import Client

    server = _probe_server(tmp_path, heartbeat_timeout_s=3)
    worker = None
    try:
        with server.client() as client:
            job = client.submit(size=2, stage_s=60.0)
            deadline = time.monotonic() + 30  # until its one step is done: both ranks are in the stage
            while client.status(job).progress < 1.0 and time.monotonic() < deadline:
                time.sleep(0.05)
        worker = rank_pid(server.marker, 1)
        assert worker is not None, server.log()
        os.kill(worker, signal.SIGSTOP)
        stopped_at = time.monotonic()
        with Client(server.endpoint, heartbeat_s=1.0, dead_after_s=3.0) as client:
            try:
                outcome = client.result(job, timeout=40).job.error or ""
            except ServerDeadError as exc:
                outcome = str(exc)
        assert "rank 1 sent no heartbeat" in outcome, (outcome, server.log())  # not "stuck": rank 0 beats
        assert time.monotonic() - stopped_at < 20
    finally:
        if worker is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGCONT)
        server.stop()


def test_heartbeat_hooks_leave_compiled_modules_alone():
    """alive_during beats per module call, but not inside a Module.compile()-d submodule: a hook
    added there changed what the graph was guarded on, so every call recompiled it (FLUX's
    compiled VAE decoder: seconds per served batch on the H200)."""
    import torch
    from torch._dynamo.testing import CompileCounter

    from tilecast.runtime.pipeline import alive_during

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), Block())
    compiles = CompileCounter()
    net[1].compile(backend=compiles)
    beats = []
    for _ in range(3):
        with alive_during(net, lambda: beats.append(1)):
            net(torch.randn(2, 4))
    assert compiles.frame_count == 1  # compiled once, not once per call
    assert len(beats) == 3 * 2  # the Sequential and its first Linear beat on every call
    assert not any(m._forward_pre_hooks for m in net.modules())  # nothing left behind
