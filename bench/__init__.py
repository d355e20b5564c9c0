"""The benchmarks: `python -m bench SUBCOMMAND` (bench/__main__.py lists them; docs/benchmarks.md gives
each figure with its command)."""
