"""Several worker processes on one host sharing one study: ``workers=N`` or ``workers=auto``.

    python -m tuner seq_len=4096 head_dim=128 workers=auto     # one worker per visible GPU

The parent plans the space, compiles it (PyCUDA), creates the study and queues
the cost model's top once (``tuner.search.prepare_study``); then it starts the
workers, each a ``spawn``ed process that runs ``tuner.search.run_search`` on
the same storage and study with its own backend, pinned to one GPU with
``CUDA_VISIBLE_DEVICES=<id>`` (round-robin when there are more workers than
GPUs, so two workers can share one GPU). ``tuner.claims`` keeps the count at
exactly ``n_trials`` and every plan measured once. The parent shows one
progress bar over all workers' trials, waits for them, and then reads the
study back: the table, the registry write and the plots happen once, in it.

Workers run in their own process group, so a terminal's Ctrl-C reaches the
parent only; it passes each Ctrl-C on to every worker, which then behaves as
a single tuner would (the first ends the trial in hand, or interrupts a
measurement; the second interrupts). Workers die with the parent (Linux
``PR_SET_PDEATHSIG``). A worker that dies (SIGKILL, out of memory) leaves its
trial RUNNING: the heartbeat grace period fails it, and the next worker to
start a trial runs it again (``retry_of``).

GPUs are found in ``CUDA_VISIBLE_DEVICES`` when set (its entries are pinned
as given), else by ``nvidia-smi`` (indices, with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
so that CUDA numbers them as nvidia-smi does), else by the CUDA probe in a
subprocess. One study assumes identical GPUs: a worker whose backend reports
another environment than the parent's stops with an error.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.util
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from optuna.storages import BaseStorage

from kernels.backends import Backend, BackendFactory
from tuner import termination
from tuner.config import SearchConfig
from tuner.costmodel import Prediction
from tuner.errors import BackendError, TunerError
from tuner.isolation import IsolatedBackend, _die_with_parent
from tuner.study_space import StudySpace
from tuner.trials import SearchResult, TrialOutcome

#: seconds ``nvidia-smi`` and the CUDA probe may take
PROBE_TIMEOUT_S = 60.0
_POLL_S = 0.2

_COUNT_PROBE = """
import pycuda.driver as drv
drv.init()
print(drv.Device.count())
"""


# ---------------------------------------------------------------------- GPUs


@dataclass(frozen=True)
class GpuPlan:
    """How many workers, and the GPU each is pinned to (None: not pinned)."""

    count: int
    gpus: tuple[str | None, ...]
    #: how the GPUs were found, for the one line the run prints
    source: str
    #: extra environment for every worker (CUDA_DEVICE_ORDER with nvidia-smi indices)
    env: Mapping[str, str] = field(default_factory=dict)

    def line(self) -> str:
        if not any(gpu is not None for gpu in self.gpus):
            return f"workers: {self.count} processes share the study ({self.source}; not pinned)"
        pinned = ", ".join(f"{i}->GPU {gpu}" for i, gpu in enumerate(self.gpus))
        return f"workers: {self.count} processes share the study ({pinned}; {self.source})"


def visible_gpus() -> tuple[list[str], str]:
    """The GPU ids a worker can be pinned to, and how they were found."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        ids = []
        for entry in given.split(","):
            entry = entry.strip()
            if not entry or entry.startswith("-"):
                break  # CUDA ignores everything from the first invalid entry on
            ids.append(entry)
        return ids, f"CUDA_VISIBLE_DEVICES={given}"
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        try:
            listed = subprocess.run(
                [smi, "--query-gpu=index", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=PROBE_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            listed = None
        if listed is not None and listed.returncode == 0:
            ids = [line.strip() for line in listed.stdout.splitlines() if line.strip().isdigit()]
            return ids, "nvidia-smi"
    return [str(i) for i in range(_probe_count())], "CUDA probe"


def _probe_count() -> int:
    """Devices CUDA sees, asked in a subprocess (this process never initialises CUDA)."""
    import importlib.util

    if importlib.util.find_spec("pycuda") is None:
        return 0
    try:
        probe = subprocess.run(
            [sys.executable, "-c", _COUNT_PROBE],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return 0
    answer = probe.stdout.strip().splitlines()[-1:] or [""]
    return int(answer[0]) if probe.returncode == 0 and answer[0].isdigit() else 0


def plan_gpus(workers: int | str, found: tuple[list[str], str] | None = None) -> GpuPlan:
    """``workers`` (a count or ``"auto"``) as processes pinned round-robin to the visible GPUs."""
    ids, source = found if found is not None else visible_gpus()
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"} if source == "nvidia-smi" else {}
    if workers == "auto":
        count = max(1, len(ids))
        source = f"auto: {len(ids)} GPU(s) visible by {source}"
    else:
        count = int(workers)
    if not ids:
        return GpuPlan(count, (None,) * count, f"{source}: no GPU visible")
    return GpuPlan(count, tuple(ids[i % len(ids)] for i in range(count)), source, env)


# ---------------------------------------------------------------------- jobs


@dataclass(frozen=True)
class IsolatedFactory:
    """Picklable: a worker's backend that measures in its own isolated process (PyCUDA)."""

    inner: BackendFactory
    timeout_s: float

    def __call__(self) -> Backend:
        return IsolatedBackend(self.inner, self.timeout_s, name=self.inner.name)


@dataclass(frozen=True)
class WorkerJob:
    """Everything a worker process needs (picklable: it is sent to a spawned process)."""

    space: StudySpace
    predictions: Mapping[str, Prediction]
    settings: SearchConfig
    storage_url: str
    study_name: str
    backend: Callable[[], Backend]
    #: the parent's backend environment; a worker whose backend differs refuses to run
    environment: Mapping[str, Any] | None = None


@dataclass
class WorkerExit:
    index: int
    gpu: str | None
    pid: int | None = None
    stop_reason: str = ""
    interrupted: bool = False
    new_trials: list[int] = field(default_factory=list)
    error: str = ""
    exitcode: int | None = None

    @property
    def ok(self) -> bool:
        # 130: the worker stopped on Ctrl-C, as asked, after saying so
        return not self.error and self.exitcode in (0, 130, None) and bool(self.stop_reason)

    def describe(self) -> str:
        where = f"worker {self.index}" + (f" (GPU {self.gpu})" if self.gpu is not None else "")
        if self.error:
            return f"{where} failed: {self.error}"
        code = self.exitcode
        if code is not None and code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exited with status {code}"
        return (
            f"{where} died ({how}, pid {self.pid}); its trial in flight is failed after the "
            "heartbeat grace period and run again by another worker or the next run"
        )


@dataclass
class WorkersOutcome:
    exits: list[WorkerExit]
    interrupted: bool

    @property
    def failed(self) -> list[WorkerExit]:
        return [e for e in self.exits if not e.ok]

    @property
    def new_trials(self) -> list[int]:
        return sorted({n for e in self.exits for n in e.new_trials})

    def stop_reason(self) -> str:
        reasons = Counter(e.stop_reason for e in self.exits if e.stop_reason)
        return reasons.most_common(1)[0][0] if reasons else ""


def run_workers(
    job: WorkerJob,
    plan: GpuPlan,
    *,
    progress: Callable[[TrialOutcome], None] | None = None,
) -> WorkersOutcome:
    """Start ``plan.count`` workers on ``job``, wait for all of them, and say how each ended.

    Each worker reports on a pipe of its own (a worker killed mid-message can
    then break nothing but its own pipe). Raises ``BackendError`` when every
    worker failed before it could search.
    """
    context = multiprocessing.get_context("spawn")
    exits = [WorkerExit(i, gpu) for i, gpu in enumerate(plan.gpus)]
    processes, readers = [], []
    # Set by the parent's Ctrl-C: a worker still starting (SIGINT ignored) stops once up.
    stop = context.Event()
    for i, gpu in enumerate(plan.gpus):
        reader, writer = context.Pipe(duplex=False)
        processes.append(
            context.Process(
                target=_worker_main,
                args=(job, i, gpu, dict(plan.env), writer, stop),
                name=f"tuner-worker-{i}",
            )
        )
        readers.append((reader, writer))
    interrupts = 0
    try:
        with _forward_sigint(processes, stop) as interrupted:
            for process, worker_exit, (_, writer) in zip(processes, exits, readers, strict=True):
                with _started_ignoring_sigint():
                    process.start()
                writer.close()  # the worker holds the only write end: EOF when it is gone
                worker_exit.pid = process.pid
            open_readers = {reader: i for i, (reader, _) in enumerate(readers)}
            while open_readers:
                for reader in wait(list(open_readers), timeout=_POLL_S):
                    index = open_readers[reader]
                    try:
                        event = reader.recv()
                    except (EOFError, OSError):
                        del open_readers[reader]
                        continue
                    _handle(event, exits[index], progress)
            interrupts = interrupted()
    finally:
        for process in processes:
            _stop(process)
        for reader, _ in readers:
            reader.close()
    for process, worker_exit in zip(processes, exits, strict=True):
        worker_exit.exitcode = process.exitcode
    if all(e.error for e in exits):
        raise BackendError(f"every worker failed; {exits[0].describe()}")
    return WorkersOutcome(exits, interrupts > 0 or any(e.interrupted for e in exits))


def _handle(
    event: tuple[Any, ...],
    worker_exit: WorkerExit,
    progress: Callable[[TrialOutcome], None] | None,
) -> None:
    kind = event[0]
    if kind == "trial" and progress is not None:
        progress(event[1])
    elif kind == "done":
        worker_exit.stop_reason, worker_exit.interrupted, worker_exit.new_trials = event[1:]
    elif kind == "error":
        worker_exit.error = event[1]


@contextlib.contextmanager
def _started_ignoring_sigint() -> Iterator[None]:
    """Start a worker with SIGINT ignored, an ignored signal staying ignored across exec.

    Until the worker is in its own process group, a terminal's Ctrl-C reaches it
    too, and a spawned interpreter interrupted while it imports prints a
    traceback and dies ("worker died"). It takes SIGINT back in ``_worker_main``
    and then checks ``stop`` for a Ctrl-C it missed. The parent ignores SIGINT
    only for the fork and exec themselves (``multiprocessing.util.spawnv_passfds``,
    milliseconds; not while the job is pickled to the child), with SIGINT blocked
    in this thread, so its own Ctrl-C is, but for that instant on another
    thread, handled when the handler is back rather than lost.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    spawn = multiprocessing.util.spawnv_passfds

    def spawn_ignoring_sigint(path: Any, args: Any, passfds: Any) -> int:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            return spawn(path, args, passfds)
        finally:
            signal.signal(signal.SIGINT, previous)

    blockable = hasattr(signal, "pthread_sigmask")
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if blockable else None
    multiprocessing.util.spawnv_passfds = spawn_ignoring_sigint  # type: ignore[assignment]
    try:
        yield
    finally:
        multiprocessing.util.spawnv_passfds = spawn
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)


@contextlib.contextmanager
def _forward_sigint(processes: list[Any], stop: Any = None) -> Iterator[Callable[[], int]]:
    """Ctrl-C in the parent: passed on to every live worker; counted, never raised here."""
    count = 0

    def handler(signum: int, frame: object) -> None:
        nonlocal count
        count += 1
        if stop is not None:
            stop.set()  # first: a worker not listening yet finds it when it starts to
        for process in processes:
            if process.pid is not None and process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGINT)

    if threading.current_thread() is not threading.main_thread():
        yield lambda: count
        return
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: count
    finally:
        signal.signal(signal.SIGINT, previous)


def _stop(process: Any) -> None:
    if process.pid is None:
        return
    if process.is_alive():
        process.join(2.0)
    if process.is_alive():
        process.terminate()
        process.join(5.0)
    if process.is_alive():
        process.kill()
        process.join()


# ---------------------------------------------------------------------- in the worker


def _worker_main(
    job: WorkerJob,
    index: int,
    gpu: str | None,
    env: Mapping[str, str],
    events: Connection,
    stop: Any = None,
) -> None:
    """One worker process: its own backend and storage handle, the shared study."""
    # Before anything can touch CUDA: this worker sees its one GPU, as device 0.
    os.environ.update(env)
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    os.setpgrp()  # the terminal's Ctrl-C goes to the parent, which passes it on
    _die_with_parent()
    from tuner.search import run_search
    from tuner.study_storage import open_storage

    def progress(trial: TrialOutcome) -> None:
        events.send(("trial", trial))

    storage = None
    try:
        # Started ignoring SIGINT, and with the parent's mask blocking it
        # (_started_ignoring_sigint): take it back, then honour a Ctrl-C the parent
        # passed on while this worker was starting.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        if stop is not None and stop.is_set():
            raise KeyboardInterrupt
        backend = job.backend()
        try:
            if job.environment is not None:
                _check_environment(backend, job.environment, gpu)
            backend.prepare(job.space.problem)  # meanwhile, the storage and the study
            storage = open_storage(
                job.storage_url,
                heartbeat_interval_s=job.settings.heartbeat_interval_s,
                grace_period_s=job.settings.grace_period_s,
            )
            result = run_search(
                job.space,
                backend,
                job.settings,
                storage=storage,
                study_name=job.study_name,
                predictions=job.predictions,
                progress=progress,
                worker=index,
                parallel=True,
                enqueue=False,
            )
        finally:
            backend.close()
    except TunerError as error:
        events.send(("error", " ".join(str(error).split())))
        sys.exit(1)
    except KeyboardInterrupt:
        events.send(("done", "interrupted (Ctrl-C)", True, []))
        sys.exit(130)
    finally:
        if storage is not None:
            storage.engine.dispose()
    events.send(("done", result.stop_reason, result.interrupted, result.new_trials))
    sys.exit(130 if result.interrupted else 0)


def _check_environment(backend: Backend, expected: Mapping[str, Any], gpu: str | None) -> None:
    mine = backend.environment()
    if dict(mine) != dict(expected):
        where = f"GPU {gpu}" if gpu is not None else "this worker"
        differs = sorted(k for k in set(mine) | set(expected) if mine.get(k) != expected.get(k))
        raise BackendError(
            f"{where} is not the GPU the study is for ({', '.join(differs)} differ: "
            f"{mine.get('gpu_name')} vs {expected.get('gpu_name')}); one study needs identical "
            "GPUs: pin the workers with CUDA_VISIBLE_DEVICES"
        )


# ---------------------------------------------------------------------- the parent's search


def search_with_workers(
    job: WorkerJob,
    plan: GpuPlan,
    storage: BaseStorage,
    *,
    progress: Callable[[TrialOutcome], None] | None = None,
    on_start: Callable[[int, int], None] | None = None,
) -> tuple[SearchResult, WorkersOutcome | None]:
    """Prepare the study once, run the workers on it, and read the whole study back."""
    from tuner.search import prepare_study, study_stopped_by_rule, study_trials

    result, counted = prepare_study(
        job.space,
        job.settings,
        storage=storage,
        study_name=job.study_name,
        predictions=job.predictions,
    )
    outcome = None
    if not result.stop_reason:
        if on_start is not None:
            on_start(counted, job.settings.n_trials)
        outcome = run_workers(job, plan, progress=progress)
        result.new_trials = outcome.new_trials
        result.interrupted = outcome.interrupted
        result.stop_reason = outcome.stop_reason()
    result.trials = study_trials(storage, job.study_name)
    n_trials = job.settings.n_trials
    if outcome is not None and result.counted >= n_trials:
        result.stop_reason = f"n_trials={n_trials} reached"
    stopped = study_stopped_by_rule(storage, job.study_name, job.settings)
    if outcome is not None and stopped is not None:
        # Whichever worker's trial made the rule fire, the study holds its verdict.
        result.stopped_by_rule = stopped
        result.stop_reason = str(stopped.get("reason"))
    if result.interrupted:
        result.stop_reason = f"interrupted ({termination.cause()})"
    return result, outcome
