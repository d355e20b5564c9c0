"""python -m launch plan|run (see launch/cli.py)."""

from .cli import main

main()
