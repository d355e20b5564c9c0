"""A transport guarded by a watchdog (distributed.startup.watchdog) or anything with its
`verdict(timeout)` and `peer_timeout`."""

import threading


class GuardedTransport:
    """A transport whose failing calls (a peer died under the ring backend, say)
    wait for the watchdog's verdict: with one, the watchdog ends the process,
    so the caller blocks rather than raising an error that names nobody."""

    def __init__(self, inner, watchdog):
        self._inner, self._watchdog = inner, watchdog

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _guard(self, fn, *args):
        try:
            return fn(*args)
        except Exception:
            if self._watchdog.verdict(self._watchdog.peer_timeout + 2.0) is None:
                raise
            threading.Event().wait()  # the watchdog exits the process

    def send(self, *args):
        return self._guard(self._inner.send, *args)

    def recv(self):
        return self._guard(self._inner.recv)

    def header_of(self, pending, *also):
        """A PendingFrame's header (recv_ahead): the wait for the frame, guarded as recv is."""
        return self._guard(pending.header, *also)

    def payload_of(self, pending, header):
        """A PendingFrame's payload as `header` announces it (one that follows: a receive)."""
        return self._guard(pending.payload_as, header)

    def close(self):
        return self._guard(self._inner.close)
