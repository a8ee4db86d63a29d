"""One run per run_dir: an exclusive lock that the driver holds for its life.

``RunLock.acquire(storage)`` takes ``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``run_dir/.sliderl.lock`` and writes
the holder (host, pid, start time) into it. The OS drops the lock when the process ends, however it ends (an
exception, Ctrl-C, SIGKILL, a crashed node's reboot), so a dead run never leaves a lock to clean up by hand;
``release`` drops it earlier. A second driver on the same folder gets ``RunDirInUse`` naming the live one,
before it reads a checkpoint or touches the trace log.

An object store has no locks: a run whose root is a URI locks a file named after the URI in this machine's
temporary folder, so two drivers on one machine exclude each other, two on different machines do not.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from sliderl.cluster.errors import ConfigError
from sliderl.cluster.storage.root import Storage

LOCK_FILE = ".sliderl.lock"


class RunDirInUse(ConfigError):
    """Another live driver holds the run directory."""


@dataclass
class RunLock:
    """A held lock on one run directory; ``release`` (or the process's end) lets it go."""

    path: Path
    fd: int | None

    @classmethod
    def acquire(cls, storage: Storage) -> RunLock:
        """The lock of ``storage``'s run; RunDirInUse naming the holder when a live process has it."""
        path = lock_path(storage)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise RunDirInUse(f"run_dir {storage.location!r} is in use by a live run ({holder}); a second driver "
                              "would roll back the trace log under it: wait for that run to end (or stop it), or "
                              "choose another run_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                  "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        """Let the lock go (closing the file drops it); a second call does nothing."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def lock_path(storage: Storage) -> Path:
    """The lock file of a run: in its folder, or for a URI root in this machine's temporary folder."""
    if storage.local:
        return Path(storage.root) / LOCK_FILE
    digest = hashlib.sha256(storage.location.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"sliderl-run-{digest}.lock"


def _holder(fd: int) -> str:
    """``host H, pid P, started T`` from the lock file, as far as it reads."""
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"host {data['host']}, pid {data['pid']}, started {data['started']}"
    except (OSError, ValueError, KeyError):
        return "its host and pid not written yet"
