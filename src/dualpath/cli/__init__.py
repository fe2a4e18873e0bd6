"""The `dualpath` command line."""
