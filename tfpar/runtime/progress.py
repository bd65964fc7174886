"""The planner's progress lines ("tfpar auto [1/6] ...") as log records.

They go to the ``tfpar.progress`` logger at INFO. While the application
configures no logging (no handler on the ``tfpar`` or root logger, as in a
plain script or notebook), a handler of that logger writes them to stderr,
as tfpar printed them before; once it does, they reach its handlers
instead, formatted as it says. ``logging.getLogger("tfpar.progress")
.setLevel(logging.WARNING)`` silences them.
"""
import logging
import sys

__all__ = ["LOGGER", "progress"]

LOGGER = "tfpar.progress"


class _UntilConfigured(logging.Handler):
    """Writes a record's message to the current ``sys.stderr`` unless a
    handler above its logger would handle it."""

    def emit(self, record: logging.LogRecord) -> None:
        logger = logging.getLogger(record.name)
        while logger.propagate and logger.parent is not None:
            logger = logger.parent
            if logger.handlers:
                return
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # pylint: disable=broad-except  (logging's own rule)
            self.handleError(record)


_log = logging.getLogger(LOGGER)
if _log.level == logging.NOTSET:  # a level the application set stays
    _log.setLevel(logging.INFO)
_log.addHandler(_UntilConfigured())


def progress(line: str) -> None:
    """Log one progress line of the planner."""
    _log.info(line)
