"""The service log: `<store_dir>/service.log`, rotated by size inside the service.

Why in the service, and by size: the service is the log's only writer (it installs the
handler once it holds the service lock; a racing second service that exits at once only
appends its one line), and it may run for weeks on a login node with no logrotate
entry of ours, so the process that writes the file is the one that can bound it.
Python's RotatingFileHandler keeps `service.log` plus SERVICE_LOG_BACKUPS old files of at
most SERVICE_LOG_MAX_BYTES each (40 MiB in all at the defaults). The spawned service's
stdout and stderr (a traceback, a library's print) point at the same file; after each
rotation they are moved to the new file, so nothing keeps growing the rotated one.
Under systemd (`serve install-unit`) there is no file: stderr goes to the journal,
which journald rotates.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
from pathlib import Path
from typing import Any

SERVICE_LOG_MAX_BYTES = 10 << 20
SERVICE_LOG_BACKUPS = 3
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # a long-lived log needs times


class ServiceLogHandler(logging.handlers.RotatingFileHandler):
    """Size-rotated, owner-only log file; optionally fds 1 and 2 follow the current file."""

    def __init__(self, path: Path, *, max_bytes: int = SERVICE_LOG_MAX_BYTES, backups: int = SERVICE_LOG_BACKUPS,
                 redirect_std: bool = False) -> None:
        self.redirect_std = redirect_std
        super().__init__(path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
        self.setFormatter(logging.Formatter(LOG_FORMAT))
        self._follow()

    def _open(self) -> Any:  # typeshed: TextIOWrapper[...]
        stream = super()._open()
        os.chmod(self.baseFilename, 0o600)  # job names and paths: the store folder's privacy
        return stream

    def doRollover(self) -> None:
        super().doRollover()
        self._follow()

    def _follow(self) -> None:
        if not self.redirect_std or self.stream is None:
            return
        for s in (sys.stdout, sys.stderr):
            s.flush()
        fd = self.stream.fileno()
        os.dup2(fd, 1)
        os.dup2(fd, 2)


def install(path: Path, *, redirect_std: bool, max_bytes: int = SERVICE_LOG_MAX_BYTES,
            backups: int = SERVICE_LOG_BACKUPS) -> ServiceLogHandler:
    """Log to `path` (rotated) instead of stderr. Returns the handler for `uninstall`."""
    root = logging.getLogger()
    # With redirect_std, stderr is this very file: a stderr handler would write each line twice.
    for h in list(root.handlers):
        if type(h) is logging.StreamHandler and getattr(h, "stream", None) in (sys.stderr, sys.__stderr__):
            root.removeHandler(h)
    handler = ServiceLogHandler(path, max_bytes=max_bytes, backups=backups, redirect_std=redirect_std)
    root.addHandler(handler)
    return handler


def uninstall(handler: ServiceLogHandler) -> None:
    logging.getLogger().removeHandler(handler)
    handler.close()
