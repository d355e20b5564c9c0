"""Generated gRPC code for trinity.v1 (see generation.proto and regenerate.py)."""
