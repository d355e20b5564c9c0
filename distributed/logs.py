"""One logging set-up for every process (each rank, the launcher and its router), on stderr.

Informational lines read as they always have (the access log, start-up and launcher lines are
their text alone, so scripts that read them keep working); warnings and errors name their level
and logger, and carry the traceback where there is one. `--log-level` sets the threshold.
"""

import logging
import sys

LEVELS = ("debug", "info", "warning", "error")


class Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if record.levelno <= logging.INFO else f"{record.levelname.lower()}: {record.name}: {text}"


class Stderr(logging.StreamHandler):
    """Writes each record whole to sys.stderr as it is then (tests and stops swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure(level: str = "info") -> None:
    """Every logger's records to stderr at `level` and above (one of LEVELS). A write that fails
    (the reader gone at a stop) is dropped, never raised or reported: the teardown matters more."""
    logging.raiseExceptions = False
    handler = Stderr()
    handler.setFormatter(Formatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
