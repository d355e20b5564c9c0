"""Opaque, tamper-evident text for clients to hold and send back: the Responses API's
`encrypted_content` of a reasoning item (include: ["reasoning.encrypted_content"]), which a
stateless client (Codex with store false) returns in its next request's input so that the
reasoning goes back into the prompt.

A sealed text is base64 (URL-safe) of JSON {"v": 1, "t": text} and an HMAC-SHA256 of it.
The key comes from --auth-token (TRINITY_AUTH_TOKEN) where one is set, so that servers
sharing a token (a restarted ring, the launcher's router and rank 0) read each other's,
else it is drawn for each HTTP front end (which owns its Sealer). It is signed, not enciphered:
it keeps a client from passing off text of its own as the model's reasoning, not from reading it.
"""

import base64
import hashlib
import hmac
import json
import secrets
from typing import Optional

PREFIX = "trinity1."


class Sealer:
    """Seals and unseals with one key: derived from the server's auth token (servers sharing it
    read each other's), else drawn for this server alone."""

    def __init__(self, token: Optional[str] = None):
        if token:
            self._key = hmac.new(token.encode(), b"trinity-pipeline sealed reasoning v1", hashlib.sha256).digest()
        else:
            self._key = secrets.token_bytes(32)

    def seal(self, text: str) -> str:
        body = json.dumps({"v": 1, "t": text}, ensure_ascii=False, separators=(",", ":")).encode()
        mac = hmac.new(self._key, body, hashlib.sha256).digest()
        return PREFIX + base64.urlsafe_b64encode(mac + body).decode().rstrip("=")

    def unseal(self, token: str) -> Optional[str]:
        """The text `seal` made, or None: not one of ours, or signed with another key."""
        if not isinstance(token, str) or not token.startswith(PREFIX):
            return None
        raw = token[len(PREFIX):]
        try:
            data = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4))
        except ValueError:
            return None
        mac, body = data[:32], data[32:]
        if len(mac) < 32 or not hmac.compare_digest(mac, hmac.new(self._key, body, hashlib.sha256).digest()):
            return None
        try:
            value = json.loads(body)
        except ValueError:
            return None
        return value.get("t") if isinstance(value, dict) and isinstance(value.get("t"), str) else None
