"""python -m launch plan|run|doctor (see launch/cli.py)."""

from .cli import main

main()
