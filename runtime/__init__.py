"""Per-rank execution: process groups, the worker loop, pipelines."""
