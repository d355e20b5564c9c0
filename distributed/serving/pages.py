"""The status page (`GET /`) and the chat page (`GET /chat`): plain HTML, CSS and
JavaScript files in pages/ (package data), served as they are: no build step, and
nothing they need comes from elsewhere (a Content-Security-Policy of 'self' holds
them to that). They call /v1/status and /v1/chat/completions; where the server has
--auth-token, each page asks for the token and sends it as a bearer header (never in
a URL): its HTML is told so by its `trinity-auth` meta tag."""

from pathlib import Path
from typing import Optional, Tuple

FOLDER = Path(__file__).parent / "pages"
TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
         ".js": "text/javascript; charset=utf-8", ".png": "image/png"}
FILES = {p.name: p.read_bytes() for p in sorted(FOLDER.iterdir()) if p.suffix in TYPES}  # by name: no paths
ROUTES = {"": "status.html", "/chat": "chat.html"}  # a request path without its trailing "/"
API_ONLY = ("chat.html",)  # a --metrics port serves the status page alone
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
           "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'"}


def find(path: str, auth: bool, api: bool) -> Optional[Tuple[bytes, str]]:
    """(body, content type) of the page or file at `path` (`/`, `/chat`, `/pages/NAME`), or None."""
    name = ROUTES.get(path) or (path[len("/pages/"):] if path.startswith("/pages/") else None)
    if name not in FILES or (name in API_ONLY and not api):
        return None
    body = FILES[name]
    if name.endswith(".html"):
        body = body.replace(b"{{auth}}", b"bearer" if auth else b"none")
    return body, TYPES[Path(name).suffix]
