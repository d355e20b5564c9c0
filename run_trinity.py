"""The script every rank runs (see distributed/cli.py): `python run_trinity.py` in a checkout;
pip installs it as the module `run_trinity`, so `run-trinity` (its console script) and
`python -m run_trinity` run it from any directory."""

from distributed.startup.lifecycle import block_stop_signals
from distributed.startup.light_imports import defer_package_init

# Before anything starts a thread (numpy's BLAS, MLX, gRPC), so that a thread of
# ours takes stop signals even while the main thread is blocked inside MLX.
block_stop_signals()
defer_package_init("mlx_lm")  # ranks other than 0 never import transformers

from distributed.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
