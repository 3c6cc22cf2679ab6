"""Progress displays of a tune run, on stderr: a tqdm bar on a terminal, lines elsewhere.

``TrialProgress`` follows one study (the shape command); ``ProblemsProgress`` follows
the studies of a model run one after another in a single display. Both take the
search's ``start(done, total)`` and ``progress(trial)`` calls.
"""

from __future__ import annotations

import contextlib
import sys
from contextlib import AbstractContextManager
from typing import Protocol, TextIO

from tqdm import tqdm

from tuner.trials import TrialOutcome


class SearchProgress(Protocol):
    """What a search reports to: ``start`` once the study is open, then every trial."""

    def start(self, done: int, total: int) -> None: ...

    def __call__(self, trial: TrialOutcome) -> None: ...


class TrialProgress:
    """A tqdm bar on stderr over the trials that count, with the best time so far.

    Not on a terminal (CI logs, a pipe) a bar would be noise: a line every tenth of
    the trials instead (``trials: 12/40, best 0.2431 ms``), and one at the end.
    """

    def __init__(self, desc: str = "trials", stream: TextIO | None = None) -> None:
        self.bar: tqdm | None = None
        self.best = float("inf")
        self.desc = desc
        self.stream = stream or sys.stderr
        self.lines = not is_terminal(self.stream)
        self.done = self.total = self.every = 0

    def start(self, done: int, total: int) -> None:
        if self.lines:
            self.done, self.total = done, total
            self.every = max(1, (total - done + 9) // 10)
            return
        self.bar = tqdm(
            total=total, initial=done, desc=self.desc, unit="trial", file=self.stream, disable=None
        )

    def __call__(self, trial: TrialOutcome) -> None:
        if not trial.counted or (self.bar is None and not self.total):
            return
        if trial.median_ms is not None:
            self.best = min(self.best, trial.median_ms)
        if self.bar is None:
            self.done += 1
            if self.done % self.every == 0 or self.done >= self.total:
                best = f", best {self.best:.4f} ms" if self.best < float("inf") else ""
                print(f"{self.desc}: {self.done}/{self.total}{best}", file=self.stream, flush=True)
            return
        self.bar.update(1)
        if self.best < float("inf"):
            self.bar.set_postfix_str(f"best {self.best:.4f} ms", refresh=False)

    def __enter__(self) -> TrialProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()


class ProblemsProgress:
    """One display over the studies of several problems, tuned one after another.

    On a terminal, one bar over every problem's ``n_trials`` (a problem finished in an
    earlier run fills its share at once), described ``problem 3/9``, with the current
    problem's best time. Elsewhere (CI logs, a pipe), one line per problem searched,
    when it ends: ``problem 3/9: trials 40/40, best 0.2431 ms``.
    """

    def __init__(self, n_trials: int, stream: TextIO | None = None) -> None:
        self.n_trials = n_trials
        self.stream = stream or sys.stderr
        self.problems = self.index = 0
        self.bar: tqdm | None = None
        self.shown = 0  # the current problem's trials the bar shows
        self.done: int | None = None  # the current problem's counted trials, once started
        self.best = float("inf")

    def expect(self, problems: int) -> None:
        """``problems`` will be tuned (the bar appears now, on a terminal)."""
        self.problems = problems
        if is_terminal(self.stream) and problems:
            self.bar = tqdm(
                total=problems * self.n_trials, desc="problems", unit="trial", file=self.stream
            )

    def begin(self, index: int) -> None:
        """Problem ``index`` (from 1) starts."""
        self.index, self.shown, self.done, self.best = index, 0, None, float("inf")
        if self.bar is not None:
            self.bar.set_description_str(f"problem {index}/{self.problems}", refresh=False)
            self.bar.set_postfix_str("", refresh=True)

    def start(self, done: int, total: int) -> None:
        """The problem's study has ``done`` of its ``total`` trials already."""
        self.done = done
        if self.bar is not None:
            self._advance(done)

    def __call__(self, trial: TrialOutcome) -> None:
        if not trial.counted:
            return
        self.done = (self.done or 0) + 1
        if trial.median_ms is not None and trial.median_ms < self.best:
            self.best = trial.median_ms
            if self.bar is not None:
                self.bar.set_postfix_str(f"best {self.best:.4f} ms", refresh=False)
        if self.bar is not None:
            self._advance(1)

    def end(self) -> None:
        """The problem is done: its share of the bar fills, however its study ended."""
        if self.bar is not None:
            self._advance(self.n_trials)
        elif self.done is not None:
            best = f", best {self.best:.4f} ms" if self.best < float("inf") else ""
            print(
                f"problem {self.index}/{self.problems}: trials {self.done}/{self.n_trials}{best}",
                file=self.stream,
                flush=True,
            )

    def output_cleared(self, output: TextIO) -> AbstractContextManager[object]:
        """A context to print to ``output`` in without tearing the bar (it is redrawn after)."""
        if self.bar is None:
            return contextlib.nullcontext()
        return tqdm.external_write_mode(file=output)

    def _advance(self, count: int) -> None:
        assert self.bar is not None
        count = min(count, self.n_trials - self.shown)
        if count > 0:
            self.shown += count
            self.bar.update(count)

    def __enter__(self) -> ProblemsProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False
