"""`run_trinity.py --serve`: rank 0's network front ends around the scheduler.

The front ends start before the weights load (health says NOT_SERVING), turn
SERVING once every rank has loaded, and NOT_SERVING again if the ring breaks.
They share one RequestLog (the access log and the metrics: request_log.py).
"""

from typing import List

from .grpc_service import start_grpc_server
from .http_api import start_http_server
from .options import ServeOptions
from .request_log import RequestLog


def start_front_ends(options: ServeOptions, requests: RequestLog) -> List:
    """gRPC (and HTTP, and the --metrics port, if asked), listening but NOT_SERVING until attach()."""
    front_ends = [start_grpc_server(options, requests)]
    if options.http_address:
        front_ends.append(start_http_server(options, requests))
    if options.metrics_address:
        front_ends.append(start_http_server(options, requests, api=False))
    return front_ends
