"""`python -m distributed.client`: the command-line gRPC client (serving/grpc_client.py)."""

from .serving.grpc_client import main

if __name__ == "__main__":
    main()
