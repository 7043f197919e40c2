"""Expected failures. Each carries a one-line message and the process exit code it maps to."""
from __future__ import annotations

EXIT_OK = 0
EXIT_RUNTIME = 1      # a step failed while running (backend crash, build failure)
EXIT_USAGE = 2        # bad command line (Typer/click's own code)
EXIT_BAD_INPUT = 3    # the input files or options cannot be used
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143   # SIGTERM (128 + 15)


class Terminated(BaseException):
    """Raised from the SIGTERM handler so that `finally`/atomic-output cleanup runs as for Ctrl-C."""


class DsaError(Exception):
    """An expected failure: printed as one line, no traceback (unless --debug)."""

    exit_code = EXIT_RUNTIME

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class BadInputError(DsaError):
    """The user's input (files, options) cannot be used."""

    exit_code = EXIT_BAD_INPUT
