"""The HTTP server under the OpenAI API and --metrics (http_api.py): a thread per
connection, IPv4 or IPv6, TLS with --tls-cert, listening from the start."""

import socket
import ssl
import threading
from http.server import ThreadingHTTPServer

from .. import TrinityError
from .options import ServeOptions, split_address


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def handle_error(self, request, client_address):
        pass  # a connection that failed (reset, TLS handshake); API errors are answered in the handler


class _Server6(_Server):
    address_family = socket.AF_INET6


def serve_http(address: str, flag: str, handler, options: ServeOptions, front_end) -> ThreadingHTTPServer:
    """Listen on `address` (given as `flag`) and serve `handler` on a thread of its own;
    handlers find `front_end` as their server's."""
    host, port = split_address(address, flag)
    try:
        server = (_Server6 if ":" in host else _Server)((host, port), handler)
    except OSError as e:
        raise TrinityError(f"{flag} {address}: cannot listen ({e})") from None
    if options.tls_cert:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(options.tls_cert, options.tls_key)
        server.socket = context.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    server.front_end = front_end
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    return server
