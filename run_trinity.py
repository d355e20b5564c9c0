"""The script mlx.launch runs on every rank. See distributed/cli.py."""

from distributed.cli import main

if __name__ == "__main__":
    main()
