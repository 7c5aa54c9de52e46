"""The `tilecast` command line."""
