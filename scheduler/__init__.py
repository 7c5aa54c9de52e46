"""Rank-0 scheduling: wire protocol, IO thread, job table, batching, client."""
