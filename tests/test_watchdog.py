"""The watchdog's rules on a fake clock: silence means dead, a busy rank that stops counting is stuck."""

from __future__ import annotations

import pytest

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


def test_a_busy_rank_without_progress_is_stuck(dog):
    watchdog, clock = dog
    for second in range(30):
        clock.now += 1.0
        watchdog.last_seen.update({1: clock.now, 2: clock.now})
        watchdog._observe(0, second, False)  # rank 0 idles and counts
        watchdog._observe(1, second, True)  # rank 1 works and counts
        watchdog._observe(2, 7, True)  # rank 2 is busy but its counter froze
        if second < 19:
            assert watchdog.check() is None, second
    assert watchdog.check().startswith("rank 2 made no progress for")


def test_idle_ranks_are_not_stuck_and_config_is_checked(dog):
    watchdog, clock = dog
    clock.now += 60.0
    watchdog.last_seen.update({1: clock.now, 2: clock.now})
    watchdog._observe(0, 1, False)
    assert watchdog.check() is None  # rank 1 and 2 idle: no progress is expected
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        WatchdogConfig(heartbeat_interval_s=1.0, heartbeat_timeout_s=1.5)
