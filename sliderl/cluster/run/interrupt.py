"""A Ctrl-C that is never lost: the SIGINT is recorded before Python raises its ``KeyboardInterrupt``.

Python turns a SIGINT into a ``KeyboardInterrupt`` raised wherever the main thread happens to be. If that is
inside library code that catches it, or a callback whose exceptions are discarded, the job goes on as if nothing
happened: ``tests/test_interrupt.py`` caught `sliderl train` still stepping 120 s after its SIGINT, with no trace
of the exception anywhere (three times in full-suite runs on 2 loaded cores). ``install`` (the CLI, at start)
makes the handler record the signal first; the driver's loops call ``check`` at every step and every wait, which
raises the ``KeyboardInterrupt`` again if one arrived, so the job stops within a step of the Ctrl-C whatever
swallowed the first one.
"""

from __future__ import annotations

import signal
import threading

_received = threading.Event()


def _on_sigint(signum, frame) -> None:
    _received.set()
    raise KeyboardInterrupt


def install() -> None:
    """From the main thread: SIGINT records itself, then raises ``KeyboardInterrupt`` as Python's default
    handler does. Forgets an earlier one (a second job in the same process starts clean)."""
    _received.clear()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _on_sigint)


def check() -> None:
    """Raise ``KeyboardInterrupt`` if a SIGINT arrived since ``install``."""
    if _received.is_set():
        raise KeyboardInterrupt
