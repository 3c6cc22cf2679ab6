"""SIGTERM ends a run as Ctrl-C does: the best so far is stored, the output says so, exit non-zero.

``kill PID``, ``timeout``, SLURM's and systemd's stop all send SIGTERM, whose
default action ends the process at once, silently, with status 143 and nothing
stored. While ``sigterm_as_ctrl_c()`` is active, SIGTERM is handed to whatever
handles SIGINT at that moment (the search's deferred Ctrl-C, the worker pool's
forwarder, or Python's ``KeyboardInterrupt``), so every path Ctrl-C takes
(finished trials kept, the trial in flight failed as interrupted, the best so
far stored) is taken; the run then exits 143 instead of Ctrl-C's 130, and its
lines name SIGTERM.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

EXIT_CTRL_C = 128 + int(signal.SIGINT)  # 130
EXIT_SIGTERM = 128 + int(signal.SIGTERM)  # 143

_received = False


def received() -> bool:
    """Whether a SIGTERM arrived since ``sigterm_as_ctrl_c()`` was entered."""
    return _received


def cause() -> str:
    """What stopped the run, for its output: ``Ctrl-C`` or ``SIGTERM``."""
    return "SIGTERM" if _received else "Ctrl-C"


def exit_status() -> int:
    return EXIT_SIGTERM if _received else EXIT_CTRL_C


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    global _received
    _received = True
    handler = signal.getsignal(signal.SIGINT)
    if handler is signal.SIG_IGN:
        return
    if callable(handler):
        handler(signal.SIGINT, frame)
        return
    raise KeyboardInterrupt  # SIG_DFL or unknown: what an unhandled Ctrl-C does


@contextlib.contextmanager
def sigterm_as_ctrl_c() -> Iterator[None]:
    """SIGTERM is handled as SIGINT inside; outside, as it was. Main thread only."""
    global _received
    _received = False
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
