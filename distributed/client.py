"""`python -m distributed.client`: the command-line gRPC client (serving/client.py)."""

from .serving.client import main

if __name__ == "__main__":
    main()
