"""``python -m tuner`` run as a user runs it, interrupted mid-search: the CLI tests of Ctrl-C
and SIGTERM (a single problem's search and the model command's) share this."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

#: seconds to wait for the trials, and for the process to exit after the signal
TIMEOUT_S = 120


def interrupt_tuner(
    overrides: Sequence[str],
    cwd: Path,
    study: Path,
    sent: signal.Signals,
    finished_trials: int = 4,
) -> subprocess.CompletedProcess[str]:
    """``python -m tuner *overrides`` in ``cwd``, sent ``sent`` once the study database
    ``study`` holds ``finished_trials`` finished trials; the exited process (killed, never
    left behind, when it does not exit in time)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tuner", *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
    )
    try:
        wait_for_finished_trials(study, finished_trials, process)
        process.send_signal(sent)
        stdout, stderr = process.communicate(timeout=TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def wait_for_finished_trials(path: Path, count: int, process: subprocess.Popen) -> None:
    """Returns once the Optuna study database at ``path`` has ``count`` COMPLETE trials;
    fails if ``process`` exits first or none come in time."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        if path.exists():
            try:
                with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
                    (finished,) = db.execute(
                        "SELECT COUNT(*) FROM trials WHERE state = 'COMPLETE'"
                    ).fetchone()
                if finished >= count:
                    return
            except sqlite3.Error:
                pass  # tables not created yet
        time.sleep(0.1)
    raise AssertionError("the tuner finished no trials in time")
