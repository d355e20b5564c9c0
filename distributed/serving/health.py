"""What `GET /health` answers (on the HTTP API's port and on --metrics'): 200 while
serving, 503 with the reason otherwise. Its states follow the calls that drive
gRPC's health service (grpc_service.py) alike: loading until attach(), serving,
down once the ring breaks, stopping at shutdown; and, in the launcher's router
(launch/router/), recovering while the ring restarts: requests are still taken
then (they wait for it), so `refusal` is None while `reason` is not."""

from typing import Optional, Tuple

LOADING = ("loading", "the model is loading")


class Health:
    def __init__(self):
        self.state: Tuple[str, Optional[str]] = LOADING  # (status, reason); one attribute: read whole

    def serving(self) -> None:
        self.state = ("serving", None)

    def down(self, reason: str) -> None:
        self.state = ("down", f"the pipeline is down: {reason}")

    def recovering(self, reason: str) -> None:
        self.state = ("recovering", f"the pipeline is down: {reason}; requests wait for it to restart")

    def stopping(self) -> None:
        self.state = ("stopping", "the server is shutting down")

    @property
    def reason(self) -> Optional[str]:
        """Why requests are refused now; None while serving."""
        return self.state[1]

    @property
    def refusal(self) -> Optional[str]:
        """Why requests are refused now; None while serving or recovering."""
        return None if self.state[0] == "recovering" else self.state[1]

    def answer(self) -> Tuple[int, dict]:
        """HTTP status and JSON body."""
        status, reason = self.state
        return (200, {"status": status}) if reason is None else (503, {"status": status, "reason": reason})
