"""Where a tune run's wall time goes: named phases, and the one line a run prints about them.

    clock = PhaseClock()
    with clock.phase("planning"):
        ...
    clock.line()  # "time: 6.1 s: 1.3 start-up, 0.2 planning, ..., 1.0 report"

The start-up phase (the interpreter's imports and Hydra's composition before
the run) is this process's age when the clock starts, read from Linux's
``/proc``; elsewhere it is left out.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path


class PhaseClock:
    """Seconds by phase, in the order the phases first ran; a phase may run several times."""

    def __init__(self, *, start_up_s: float | None = None) -> None:
        self.seconds: dict[str, float] = {}
        if start_up_s is not None:
            self.seconds["start-up"] = start_up_s
        #: words that go after a phase's time: "9 trials, 0.31 s each"
        self.notes: dict[str, str] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        began = time.monotonic()
        try:
            yield
        finally:
            self.add(name, time.monotonic() - began)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def note(self, name: str, words: str) -> None:
        self.notes[name] = words

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def line(self) -> str:
        parts = []
        for name, seconds in self.seconds.items():
            note = f" ({self.notes[name]})" if name in self.notes else ""
            parts.append(f"{seconds:.1f} s {name}{note}")
        return f"time: {self.total:.1f} s: " + ", ".join(parts)

    def as_dict(self) -> dict[str, float]:
        return {name: round(seconds, 3) for name, seconds in self.seconds.items()}


def process_age_s() -> float | None:
    """Seconds since this process started (Linux); None where that cannot be read."""
    try:
        stat = Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None
    return max(0.0, uptime - int(stat[19]) / ticks)
