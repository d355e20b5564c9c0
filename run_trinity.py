"""The script mlx.launch runs on every rank. See distributed/cli.py."""

from distributed.startup.lifecycle import block_stop_signals

# Before anything starts a thread (numpy's BLAS, MLX, gRPC), so that a thread of
# ours takes stop signals even while the main thread is blocked inside MLX.
block_stop_signals()

from distributed.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
