"""``tilecast bench``: benchmarks (not tests), each against its peer in the same run."""

from tilecast.launcher.bench.cli import bench_app

__all__ = ["bench_app"]
