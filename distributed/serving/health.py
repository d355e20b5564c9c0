"""What `GET /health` answers (on the HTTP API's port and on --metrics'): 200 while
serving, 503 with the reason otherwise. Its states follow the calls that drive
gRPC's health service (grpc_service.py) alike: loading until attach(), serving,
down once the ring breaks, stopping at shutdown."""

from typing import Optional, Tuple

LOADING = ("loading", "the model is loading")


class Health:
    def __init__(self):
        self.state: Tuple[str, Optional[str]] = LOADING  # (status, reason); one attribute: read whole

    def serving(self) -> None:
        self.state = ("serving", None)

    def down(self, reason: str) -> None:
        self.state = ("down", f"the pipeline is down: {reason}")

    def stopping(self) -> None:
        self.state = ("stopping", "the server is shutting down")

    @property
    def reason(self) -> Optional[str]:
        """Why requests are refused now; None while serving."""
        return self.state[1]

    def answer(self) -> Tuple[int, dict]:
        """HTTP status and JSON body."""
        status, reason = self.state
        return (200, {"status": status}) if reason is None else (503, {"status": status, "reason": reason})
