"""Measurements in a worker process that a bad candidate cannot take the tuner down with.

A kernel can crash its process (SIGSEGV in the driver, ``os._exit``), destroy
its CUDA context (illegal address: every later call in that process fails) or
hang. ``IsolatedBackend`` is a ``Backend`` that forwards each ``measure`` to a
worker process and turns each of those into a failure value:

=====================  ============================================  =========
what happened          trial's failure                               worker
=====================  ============================================  =========
worker died            ``WORKER_CRASH`` (signal or exit status)      replaced
no answer in time      ``TIMEOUT``                                   replaced
context lost           ``RUNTIME_DEVICE`` (the backend says so)      replaced
``measure`` raised     ``WORKER_CRASH`` (the exception's text)       replaced
compile error, wrong   as the backend reports it                     kept
answer, launch refused
=====================  ============================================  =========

"Replaced" means the worker is stopped (a hung one: SIGTERM, then SIGKILL
after ``KILL_GRACE_S``) and a fresh one starts on the next measurement; the
failures that leave the CUDA context intact keep the worker and its warm state.

Protocol (a ``multiprocessing`` pipe, pickled values): the worker builds its
backend once from a picklable factory and answers ``("ready", environment,
device_profile)`` (or ``("failed", text)``, a run-level ``BackendError``);
then for each ``("measure", plan, problem)`` it answers ``("result",
measurement)`` or ``("raised", text)``; ``("prepare", problem)`` gets no answer
(the worker builds the problem's inputs and references meanwhile);
``("stop",)`` ends it. Workers are
started with the ``spawn`` method: a forked child of a process that touched
CUDA inherits an unusable context. Workers ignore SIGINT (Ctrl-C reaches the
whole process group; the parent decides), die with their parent on Linux
(``PR_SET_PDEATHSIG``), and ``close``, interpreter exit or a failed start stop
them, so no process outlives the run.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import signal
import sys
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from kernels.backends.base import Backend, Failure, Measurement
from tuner.device import DeviceProfile
from tuner.errors import BackendError
from tuner.planner.tunable import KernelPlan
from tuner.problem import Problem

#: seconds a worker gets to leave after ``stop`` / SIGTERM before the next step
KILL_GRACE_S = 2.0
#: seconds a fresh worker gets to import and build its backend (CUDA start-up)
DEFAULT_START_TIMEOUT_S = 120.0
#: failures after which the worker's process is not trusted with another candidate
REPLACE_AFTER = frozenset({Failure.RUNTIME_DEVICE, Failure.TIMEOUT, Failure.WORKER_CRASH})

_live: weakref.WeakSet[IsolatedBackend] = weakref.WeakSet()


class IsolatedBackend(Backend):
    """A ``Backend`` whose measurements run in a replaceable worker process."""

    def __init__(
        self,
        factory: Callable[[], Backend],
        timeout_s: float,
        *,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        name: str | None = None,
    ) -> None:
        self.factory = factory
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.name = name or getattr(factory, "name", "isolated")
        #: workers started so far (1 + replacements)
        self.starts = 0
        self._context = multiprocessing.get_context("spawn")
        self._process: Any = None
        self._conn: Connection | None = None
        self._environment: dict[str, str | int] = {}
        self._profile: DeviceProfile | None = None
        _live.add(self)

    # ------------------------------------------------------------------ facts

    def environment(self) -> dict[str, str | int]:
        self.start()
        return dict(self._environment)

    def device_profile(self) -> DeviceProfile | None:
        """The worker's backend's device profile (the live GPU's for PyCUDA), if it has one."""
        self.start()
        return self._profile

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start a worker unless one runs; ``BackendError`` if it cannot build its backend."""
        if self._process is not None and self._process.is_alive():
            return
        self._discard()
        parent_end, child_end = self._context.Pipe()
        process = self._context.Process(
            target=_worker_main, args=(child_end, self.factory), daemon=True
        )
        process.start()
        child_end.close()
        self._process, self._conn = process, parent_end
        self.starts += 1
        answer = self._receive(self.start_timeout_s)
        if answer is None or answer[0] != "ready":
            if answer is None:
                why = f"did not answer within {self.start_timeout_s:.0f} s"
            elif answer[0] == "failed":
                why = answer[1]
            else:
                why = self._death_notice()
            self._stop(graceful=False)
            raise BackendError(f"the {self.name} measurement worker cannot start: {why}")
        _, self._environment, self._profile = answer

    def close(self) -> None:
        self._stop(graceful=True)

    def _discard(self) -> None:
        if self._process is not None:
            self._stop(graceful=False)

    def _stop(self, *, graceful: bool) -> None:
        process, conn = self._process, self._conn
        self._process, self._conn = None, None
        if process is None:
            return
        if graceful and conn is not None and process.is_alive():
            with contextlib.suppress(OSError, ValueError):
                conn.send(("stop",))
            process.join(KILL_GRACE_S)
        if process.is_alive():
            process.terminate()
            process.join(KILL_GRACE_S)
        if process.is_alive():
            process.kill()
            process.join()
        if conn is not None:
            conn.close()
        with contextlib.suppress(ValueError):
            process.close()

    # ------------------------------------------------------------------ measuring

    def prepare(self, problem: Problem) -> None:
        """Ask the worker to prepare ``problem`` and return at once: it does so while this
        process goes on (compiling, say), and answers the next ``measure`` after it. A
        failure is left to that ``measure`` (it meets it again and reports it)."""
        self.start()
        assert self._conn is not None
        with contextlib.suppress(OSError, ValueError):
            self._conn.send(("prepare", problem))

    def measure(self, plan: KernelPlan, problem: Problem) -> Measurement:
        self.start()
        assert self._conn is not None
        try:
            self._conn.send(("measure", plan, problem))
        except (OSError, ValueError):
            return self._crashed(plan)
        try:
            answer = self._receive(self.timeout_s)
        except BaseException:
            # Ctrl-C while waiting: the worker is mid-measurement; stop it now.
            self._stop(graceful=False)
            raise
        if answer is None:
            self._stop(graceful=False)
            return Measurement.failed(
                Failure.TIMEOUT,
                f"{plan.key()} gave no result within {self.timeout_s:g} s; worker stopped",
            )
        if answer == ("died",):
            return self._crashed(plan)
        if answer[0] == "raised":
            self._stop(graceful=False)
            return Measurement.failed(Failure.WORKER_CRASH, f"the backend raised {answer[1]}")
        measurement: Measurement = answer[1]
        if measurement.failure in REPLACE_AFTER:
            self._stop(graceful=False)
        return measurement

    def _receive(self, timeout_s: float) -> tuple[Any, ...] | None:
        """The worker's next message; ``("died",)`` if it died first; None on timeout."""
        assert self._conn is not None and self._process is not None
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready = wait([self._conn, self._process.sentinel], timeout=left)
            if self._conn in ready:
                try:
                    return self._conn.recv()
                except (EOFError, OSError):
                    return ("died",)
            if ready:  # the sentinel alone: it died without a word
                return ("died",)

    def _crashed(self, plan: KernelPlan) -> Measurement:
        notice = self._death_notice()
        self._stop(graceful=False)
        return Measurement.failed(Failure.WORKER_CRASH, f"{notice} while measuring {plan.key()}")

    def _death_notice(self) -> str:
        process = self._process
        if process is None:
            return "worker is gone"
        process.join(KILL_GRACE_S)
        code = process.exitcode
        if code is None:
            return "worker stopped answering"
        if code < 0:
            try:
                return f"worker killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"worker killed by signal {-code}"
        return f"worker exited with status {code}"


def _worker_main(conn: Connection, factory: Callable[[], Backend]) -> None:
    """The worker process: build the backend once, then measure until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    try:
        backend = factory()
        environment = backend.environment()
        profile_of = getattr(backend, "device_profile", None)
        profile = profile_of() if callable(profile_of) else None
    except BaseException as error:  # noqa: BLE001 - every start failure is reported
        conn.send(("failed", _one_line(error)))
        return
    conn.send(("ready", environment, profile))
    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:  # the parent is gone
                return
            if message[0] == "stop":
                return
            if message[0] == "prepare":
                # No answer: a failure here meets the next measurement again, which says it.
                with contextlib.suppress(Exception):
                    backend.prepare(message[1])
                continue
            _, plan, problem = message
            try:
                measurement = backend.measure(plan, problem)
            except BaseException as error:  # noqa: BLE001 - a value for the parent
                conn.send(("raised", _one_line(error)))
                return
            conn.send(("result", measurement))
    finally:
        with contextlib.suppress(Exception):
            backend.close()


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies, even by SIGKILL."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(Exception):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


@atexit.register
def _stop_all_workers() -> None:
    for backend in list(_live):
        backend._stop(graceful=False)
