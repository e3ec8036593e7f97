"""Exit codes and the domain errors that map onto them.

Every command exits with one of these (documented in the README):

    0  success
    1  runtime error (Slurm refused, a job failed, the cluster is down, ...)
    2  usage error or bad input (bad spec, bad site config, unknown option)

The library raises these; only the CLI turns them into a one-line message and an
exit code, so nothing below the CLI prints or exits.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2


class DlrmError(Exception):
    """Base of every error the CLI reports as one line."""

    exit_code = EXIT_RUNTIME


class BadInput(DlrmError):
    """Input the user can fix: a bad spec, site config, or option (exit 2)."""

    exit_code = EXIT_USAGE


class ConfigError(BadInput):
    """A site-config key is missing, unknown or has a bad value."""

    def __init__(self, key: str, reason: str, path: str | None = None) -> None:
        self.key = key
        self.reason = reason
        self.path = path
        where = f"{path}: " if path else ""
        super().__init__(f"{where}{key}: {reason}")


class SpecError(BadInput):
    """A job spec field is missing, unknown or has a bad value."""

    def __init__(self, field: str, reason: str, path: str | None = None) -> None:
        self.field = field
        self.reason = reason
        self.path = path
        where = f"{path}: " if path else ""
        super().__init__(f"{where}{field}: {reason}")
