"""Benchmarks: preftune vs TRL on the same work, in one run (see bench/README.md)."""
