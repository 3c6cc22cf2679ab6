"""A reader that stops reading (``python -m tuner mode=plan ... | head -1``) ends the run quietly.

Unix tools die of SIGPIPE when the pipe they write to is closed: no message,
and the shell reports status 141 (128 + SIGPIPE). Python ignores SIGPIPE and
raises ``BrokenPipeError`` instead, whose traceback would end up on the
terminal, and the interpreter's last flush of stdout would fail and complain
again. ``quiet_exit_status`` points stdout at ``/dev/null`` (nothing more can
reach the reader anyway) and gives the status a Unix tool would have.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

EXIT_BROKEN_PIPE = 128 + int(getattr(signal, "SIGPIPE", 13))


def quiet_exit_status() -> int:
    """After a ``BrokenPipeError`` on stdout: silence stdout for good; the exit status."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return EXIT_BROKEN_PIPE
