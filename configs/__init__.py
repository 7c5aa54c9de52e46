"""Named presets, batching rules and tiny model configs (package data)."""
