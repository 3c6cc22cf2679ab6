"""One tune run, from a validated config to a stored plan: ``run(validated) -> exit status``.

1. Pick the backend (``auto``: PyCUDA when a CUDA device answers, else the cost
   model) and say which and why in one line.
2. Plan the candidate space on the device profile (the live GPU's for PyCUDA,
   the config's otherwise); for PyCUDA compile it first, in parallel, and drop
   what the compiler rules out (``tuner.precompile``).
3. Search (``tuner.search``): an Optuna study that continues where the last
   run of the same command stopped, with a progress bar on stderr; with
   ``workers=N`` (or ``auto``) in N worker processes on this host, one GPU
   each, sharing the study (``tuner.workers``).
4. Print the best plans, store the best one with its evidence in the registry
   (as measured only for GPU timings), and write PNG plots into the run
   directory (Hydra's output directory when run from the CLI).

What every problem of a run shares (the backend, chosen and started once, the device,
the environment, the study storage, the registry) is a ``TuneSession``; a problem is
prepared through it (candidates, predictions, its study's name) and searched. The shape
command tunes its one problem so; a model run (``tuner.llm.run``) each of a model's
problems in turn, through the same session.

Ctrl-C during the search ends it cleanly: finished trials stay in the study,
the best so far is printed and stored (the output says so), measurement
workers are stopped, and the exit status is 130. SIGTERM does the same and
exits 143 (``tuner.termination``). A worker process that failed
or died is named in one line each, and the exit status is then 1 (the best of
the study is stored all the same). Every run-level problem is a
``TunerError`` (one line at the CLI); failures of single candidates are values.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from optuna.storages import BaseStorage
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from db import PlanRecord, PlanRegistry, RecordStatus
from kernels.backends import Backend, BackendChoice, BackendFactory, choose_backend, make_backend
from kernels.backends.model import MODEL_GPU_NAME
from tuner import plots, report, termination
from tuner.config import TunerConfig, ValidatedConfig, space_axes_from
from tuner.costmodel import Prediction, predict
from tuner.data_dir import default_registry_url
from tuner.device import DeviceProfile
from tuner.environment import Environment
from tuner.errors import BackendError, ConfigError
from tuner.isolation import IsolatedBackend
from tuner.phases import PhaseClock
from tuner.planner.errors import PlanError
from tuner.planner.families import family_named
from tuner.planner.space import CandidateSpace, candidate_space
from tuner.planner.tunable import KernelPlan
from tuner.precompile import CompileAhead, precompile
from tuner.problem import Problem
from tuner.progress import SearchProgress, TrialProgress
from tuner.recorded_space import within_recording
from tuner.run_log import to_log_file
from tuner.search import (
    allowed_plans,
    encoding_for,
    rule_off_reason,
    run_search,
    stopping_rule,
    study_trials,
)
from tuner.study_names import default_storage_url, study_name
from tuner.study_space import StudySpace
from tuner.study_storage import open_storage
from tuner.study_storage import storage_url as display_url
from tuner.trials import SearchResult, TrialOutcome
from tuner.workers import GpuPlan, IsolatedFactory, WorkerJob, plan_gpus, search_with_workers

TOP_ROWS = 5
_STATUS_WORDS = {
    RecordStatus.STORED_NEW_BEST: "the first plan of this problem and environment",
    RecordStatus.REPLACED_BEST: "replaces the previous best",
    RecordStatus.KEPT_PREVIOUS_BEST: "kept as history; the previous best stays",
    RecordStatus.ALREADY_STORED: "already stored by an earlier run of this study; nothing added",
}


def run(
    validated: ValidatedConfig,
    *,
    output_dir: str | Path | None = None,
    out: TextIO | None = None,
    clock: PhaseClock | None = None,
) -> int:
    """Tune ``validated.problem``; 0 when done, 130 (Ctrl-C) or 143 (SIGTERM) when interrupted
    (the best so far stored).

    ``clock``: where the wall time goes, one line at the end (``tuner.phases``).
    """
    problem = validated.problem
    say = _sayer(out or sys.stdout)
    clock = clock or PhaseClock()
    session = TuneSession.open(
        validated.config, validated.device, say, problem=problem, clock=clock
    )
    try:
        prepared = session.prepare(problem)
        shown = display_url(session.storage)  # a server's password stays off the terminal
        # The viewer is an optional extra: named where it is installed, as what it is.
        viewer = (
            f"; browse it with optuna-dashboard {shown}"
            if importlib.util.find_spec("optuna_dashboard") is not None
            else ""
        )
        compiled = (
            "by the planner; compiled as the search reaches them"
            if session.compiles_ahead
            else "candidates"
        )
        say(
            f"study: {prepared.study_name} in {shown} ({len(prepared.feasible)} feasible "
            f"{compiled}, {len(prepared.rejected)} rejected{viewer})"
        )
        if prepared.done is not None:
            say(
                f"study: continuing {prepared.study_name} ({prepared.done} trials done of "
                f"search.n_trials={session.config.search.n_trials}; "
                "search.study_name=<new name> starts another)"
            )
        settings = session.config.search
        if settings.stop and stopping_rule(settings) is None:
            say(f"search.stop: off ({rule_off_reason(settings)})")
        with TrialProgress(session.progress_label) as progress:
            tuned = session.search(prepared, progress)
    finally:
        session.close()

    result = tuned.result
    with clock.phase("report"):
        for line in tuned.failures:
            say(line)
        if result.interrupted:
            say(
                f"interrupted ({termination.cause()}): the study keeps its finished trials; "
                "the best so far follows"
            )
        say(report.best_table(result, TOP_ROWS))
        for line in report.summary_lines(result):
            say(line)
        say(
            _store_best(
                result,
                problem,
                session.environment,
                tuned.source_hashes,
                session.registry_url,
                replayed=session.replayed,
            )
        )
        say(_write_plots(result, problem, output_dir))
    say(clock.line())
    if result.interrupted:
        return termination.exit_status()
    return 1 if tuned.failures else 0


def _sayer(out: TextIO) -> Callable[[str], None]:
    """Print a line to ``out`` and to the run's log file."""

    def say(line: str) -> None:
        print(line, file=out, flush=True)
        to_log_file(line)

    return say


# ---------------------------------------------------------------------- one problem


@dataclass(frozen=True)
class PreparedProblem:
    """A problem ready to search: its candidates, their predictions, its study."""

    problem: Problem
    feasible: list[KernelPlan]
    rejected: list[KernelPlan]
    predictions: dict[str, Prediction]
    source_hashes: dict[str, str]
    study_name: str
    #: trials that count in the study already; None when the study is new
    done: int | None


@dataclass(frozen=True)
class TunedProblem:
    """A problem's search as it ended: the study's trials, and the workers that failed."""

    prepared: PreparedProblem
    result: SearchResult
    failures: list[str]
    #: the plan the cost model ranks first (what the search measures first, and what a
    #: deployment without a registry launches): the zero-trial pick the search is judged by
    pick: KernelPlan

    @property
    def source_hashes(self) -> dict[str, str]:
        return self.prepared.source_hashes


class TuneSession:
    """What the problems of one run share: the backend (chosen and started once), the
    device and environment, the study storage and the registry it writes to.

    ``prepare(problem)`` plans a problem's candidates and names its study;
    ``search(prepared, progress)`` runs or continues the study (in this process, or
    in ``workers`` worker processes). The shape command tunes one problem through it,
    a model run (``tuner.llm.run``) each of the model's problems in turn. ``clock``
    adds up where the time goes (backend start, planning, compiling, study, search).
    """

    def __init__(
        self,
        config: TunerConfig,
        configured_device: DeviceProfile,
        choice: BackendChoice,
        backend: Backend,
        gpu_plan: GpuPlan | None,
        say: Callable[[str], None],
        clock: PhaseClock | None = None,
    ) -> None:
        self.config = config
        self.clock = clock or PhaseClock()
        self.say = say
        self.configured_device = configured_device
        self.choice = choice
        self.backend = backend
        self.gpu_plan = gpu_plan
        self.registry_url = config.registry.url or default_registry_url()  # validated: resolved
        self.device = configured_device
        self.environment: Environment | None = None
        self.storage: BaseStorage | None = None
        self.storage_url = ""
        self._backend_closed = False
        self._workers_announced = False
        self._compile_ahead: CompileAhead | None = None

    @classmethod
    def open(
        cls,
        config: TunerConfig,
        configured_device: DeviceProfile,
        say: Callable[[str], None],
        *,
        problem: Problem | None = None,
        clock: PhaseClock | None = None,
    ) -> TuneSession:
        """Choose and build the backend (saying which in one line), read the device and
        the environment, and open the study storage; ``RegistryError`` now, before any
        trial, when the registry cannot take the results. ``problem``: the one problem a
        replay must hold (a model run asks per problem)."""
        choice = choose_backend(config.backend)
        gpu_plan = None if config.workers == 1 else plan_gpus(config.workers)
        if gpu_plan is not None and gpu_plan.count == 1:
            say(gpu_plan.line())
            gpu_plan = None
        backend = _build_backend(choice, config, configured_device, problem)
        session = cls(config, configured_device, choice, backend, gpu_plan, say, clock)
        try:
            session._start()
        except BaseException:
            session.close()
            raise
        return session

    def _start(self) -> None:
        with self.clock.phase("backend start"):
            self.say(self.choice.line(_measures_on_a_gpu(self.choice, self.backend)))
            self.device = _device_profile(self.choice, self.backend, self.configured_device)
            self.environment = Environment(**self.backend.environment())  # type: ignore[arg-type]
        with self.clock.phase("study"):
            self._open_storage()

    def _open_storage(self) -> None:
        self.storage_url = self.config.search.storage or default_storage_url(self.registry_url)
        _check_storage(self.storage_url, self.registry_url, shared=self.gpu_plan is not None)
        # Checked before the study is touched: a registry that cannot take the
        # result is refused now, not after the search has spent its trials. A new
        # SQLite registry is created only when there is a plan to store.
        PlanRegistry.check_writable(self.registry_url)
        self.storage = open_storage(
            self.storage_url,
            heartbeat_interval_s=self.config.search.heartbeat_interval_s,
            grace_period_s=self.config.search.grace_period_s,
        )

    @property
    def compiles_ahead(self) -> bool:
        """Whether PyCUDA's candidates compile as the search reaches them (the model
        sampler measures a few of many, in this process) rather than all before it."""
        return (
            self.choice.name == "pycuda"
            and self.gpu_plan is None
            and self.config.search.sampler == "model"
        )

    @property
    def replayed(self) -> bool:
        """A replay is a simulation of a GPU run: its own studies, results stored as predicted."""
        return self.choice.name == "replay"

    @property
    def progress_label(self) -> str:
        return "trials" if self.gpu_plan is None else f"trials ({self.gpu_plan.count} workers)"

    def replay_gap(self, problem: Problem) -> str:
        """Why a replay cannot serve ``problem`` (its file has no recording of it); ""."""
        if not self.replayed:
            return ""
        try:
            self.backend.recording_for(problem)  # type: ignore[attr-defined]
        except BackendError as error:
            return str(error)
        return ""

    def prepare(self, problem: Problem, space: CandidateSpace | None = None) -> PreparedProblem:
        """Plan ``problem``'s candidates (compiling them for PyCUDA) and name its study.

        ``space``: the planner's space of ``problem`` when already planned on this
        run's device. ``ConfigError`` when no candidate is left (the compiler ruled
        them all out)."""
        assert self.storage is not None and self.environment is not None
        if self.gpu_plan is None and not self._backend_closed:
            # The measurement worker builds the inputs and references meanwhile.
            self.backend.prepare(problem)
        with self.clock.phase("planning"):
            if space is None or self.device != self.configured_device:
                space = _plan_space(problem, self.config, self.device)
            feasible, rejected = _planned(self.choice, self.backend, problem, space, self.device)
        if self.choice.name == "pycuda" and not self.compiles_ahead:
            with self.clock.phase("compiling"):
                feasible, compiled_out = precompile(
                    feasible,
                    self.device,
                    self.config.backend.cache_dir,
                    self.config.backend.compile_jobs,
                )
            rejected += compiled_out
            _require_some(feasible, rejected, problem, self.device)
        with self.clock.phase("planning"):
            predictions = {plan.key(): predict(plan, self.device) for plan in feasible}
        hashes = _source_hashes(self.choice, self.backend, problem)
        name = self.config.search.study_name or study_name(
            problem,
            self.environment,
            hashes,
            "replay" if self.replayed else "",
            sampler=self.config.search.sampler,
        )
        return PreparedProblem(
            problem=problem,
            feasible=feasible,
            rejected=rejected,
            predictions=predictions,
            source_hashes=hashes,
            study_name=name,
            done=_trials_done(self.storage, name),
        )

    def _compile_ahead_for_search(self) -> CompileAhead | None:
        if not self.compiles_ahead:
            return None
        if self._compile_ahead is None:
            self._compile_ahead = CompileAhead(
                self.device, self.config.backend.cache_dir, self.config.backend.compile_jobs
            )
        return self._compile_ahead

    def search(self, prepared: PreparedProblem, progress: SearchProgress) -> TunedProblem:
        """Run or continue ``prepared``'s study until ``search.n_trials`` count."""
        assert self.storage is not None and self.environment is not None
        settings = self.config.search
        space = StudySpace(
            prepared.problem,
            self.device,
            prepared.feasible,
            prepared.rejected,
            encoding=encoding_for(settings.sampler),
        )
        pick, _ = allowed_plans(space, prepared.predictions, settings.traffic_cutoff)[0]
        began = time.monotonic()
        if self.choice.name == "pycuda":  # the search waits on the GPU: import meanwhile
            plots.import_ahead()
        if self.gpu_plan is None:
            compile_ahead = self._compile_ahead_for_search()
            before = compile_ahead.variants if compile_ahead is not None else (0, 0)
            result = run_search(
                space,
                self.backend,
                settings,
                storage=self.storage,
                study_name=prepared.study_name,
                predictions=prepared.predictions,
                progress=progress,
                on_start=progress.start,
                compile_ahead=compile_ahead,
            )
            self._time_search(began, result, compile_ahead, before)
            return TunedProblem(prepared, result, [], pick)
        # The parent measures nothing: its backend (and, for PyCUDA, the GPU
        # context of its measurement process) goes before the workers start.
        self._close_backend()
        if not self._workers_announced:
            self._workers_announced = True
            self.say(self.gpu_plan.line())
        job = WorkerJob(
            space=space,
            predictions=prepared.predictions,
            settings=settings,
            storage_url=self.storage_url,
            study_name=prepared.study_name,
            backend=_worker_backend(self.choice, self.config, self.configured_device),
            environment=self.environment.as_dict(),
        )
        result, outcome = search_with_workers(
            job, self.gpu_plan, self.storage, progress=progress, on_start=progress.start
        )
        failures = [f"workers: {e.describe()}" for e in outcome.failed] if outcome else []
        self._time_search(began, result, None, (0, 0))
        return TunedProblem(prepared, result, failures, pick)

    def _time_search(
        self,
        began: float,
        result: SearchResult,
        compile_ahead: CompileAhead | None,
        before: tuple[int, int],
    ) -> None:
        """The search's seconds on the clock, noted per trial (and what compiled ahead)."""
        seconds = time.monotonic() - began
        self.clock.add("search", seconds)
        notes = []
        trials = result.new_measurements
        if trials:
            notes.append(f"{trials} trials, {seconds / trials:.2f} s each")
        if compile_ahead is not None:
            asked, cached = (
                now - then for now, then in zip(compile_ahead.variants, before, strict=True)
            )
            notes.append(f"{asked} kernels compiled ahead, {cached} cached")
        if notes:
            self.clock.note("search", "; ".join(notes))

    def close(self) -> None:
        if self._compile_ahead is not None:
            self._compile_ahead.close()
            self._compile_ahead = None
        self._close_backend()
        if self.storage is not None:
            self.storage.engine.dispose()  # SQLite checkpoints its WAL into the file

    def _close_backend(self) -> None:
        if not self._backend_closed:
            self._backend_closed = True
            self.backend.close()


# ---------------------------------------------------------------------- backend


def _build_backend(
    choice: BackendChoice, config: TunerConfig, device: DeviceProfile, problem: Problem | None
) -> Backend:
    """The backend, not started yet. PyCUDA measures in worker processes unless
    ``backend.isolate=false``; the model and replay backends run in this process
    (they only read numbers: nothing there can crash or hang). A replay must hold
    ``problem`` when one is given."""
    if choice.name == "pycuda" and importlib.util.find_spec("pycuda") is None:
        # Said here, not by a worker that cannot start.
        raise BackendError(
            "backend=pycuda: pycuda is not installed (pip install 'flash-attention-tuner[cuda]')"
        )
    if choice.name == "pycuda" and config.backend.isolate:
        factory = BackendFactory("pycuda", config.backend, device=device)
        return IsolatedBackend(factory, config.search.trial_timeout_s, name="pycuda")
    backend = make_backend(choice.name, config.backend, device=device)
    if choice.name == "replay" and problem is not None:
        backend.recording_for(problem)  # type: ignore[attr-defined]
    return backend


def _worker_backend(
    choice: BackendChoice, config: TunerConfig, device: DeviceProfile
) -> Callable[[], Backend]:
    """The recipe each worker process builds its own backend from (isolated for PyCUDA)."""
    factory = BackendFactory(choice.name, config.backend, device=device)
    if choice.name == "pycuda" and config.backend.isolate:
        return IsolatedFactory(factory, config.search.trial_timeout_s)
    return factory


def _check_storage(storage_url: str, registry_url: str, *, shared: bool) -> None:
    """The study's database must not be the registry's, nor private to one process if shared."""
    try:
        storage, registry = make_url(storage_url), make_url(registry_url)
    except ArgumentError:
        return  # each is opened later and reports its own error
    if _same_database(storage, registry):
        raise ConfigError(
            f"search.storage={storage_url} is invalid: it is the registry's database "
            "(registry.url); Optuna's tables and the registry's each need a database of "
            "their own (both keep an alembic_version table): give the study another one"
        )
    if (
        shared
        and storage.get_backend_name() == "sqlite"
        and storage.database in (None, "", ":memory:")
    ):
        raise ConfigError(
            f"search.storage={storage_url} is invalid: workers share the study through "
            "a database file or server; an in-memory SQLite database is one process's own"
        )


def _same_database(a: Any, b: Any) -> bool:
    if a.get_backend_name() != b.get_backend_name():
        return False
    if a.get_backend_name() == "sqlite":
        if a.database in (None, "", ":memory:") or b.database in (None, "", ":memory:"):
            return False
        return Path(a.database).expanduser().resolve() == Path(b.database).expanduser().resolve()
    where = ("host", "port", "database")
    return all(getattr(a, part) == getattr(b, part) for part in where)


def _trials_done(storage: BaseStorage, name: str) -> int | None:
    """The trials that count in the study ``name`` already; None when there is no such study."""
    if name not in {summary.study_name for summary in storage.get_all_studies()}:
        return None
    return sum(1 for trial in study_trials(storage, name) if trial.counted)


def _measures_on_a_gpu(choice: BackendChoice, backend: Backend) -> bool:
    """Whether this run's timings are stored as measured: only PyCUDA's, taken here.

    A replay serves GPU timings recorded elsewhere (another GPU, perhaps one this
    machine does not have): stored as predicted, so ``db best`` never serves them
    as measured on the recording's GPU.
    """
    return choice.name == "pycuda"


def _device_profile(
    choice: BackendChoice, backend: Backend, configured: DeviceProfile
) -> DeviceProfile:
    """The live GPU's limits for PyCUDA (read by its worker), else the configured profile."""
    if choice.name != "pycuda":
        return configured
    live = getattr(backend, "device_profile", None)
    profile = live() if callable(live) else None
    return profile or configured


# ---------------------------------------------------------------------- candidates


def _plan_space(problem: Problem, config: TunerConfig, device: DeviceProfile) -> CandidateSpace:
    try:
        return candidate_space(problem, device, space_axes_from(config.search))
    except PlanError as error:
        raise ConfigError(f"{problem.label()} cannot be planned: {error}") from error


def _planned(
    choice: BackendChoice,
    backend: Backend,
    problem: Problem,
    space: CandidateSpace,
    device: DeviceProfile,
) -> tuple[list[KernelPlan], list[KernelPlan]]:
    """The planner's feasible and rejected plans (for a replay, less what the recording's
    compiler ruled out); ``ConfigError`` when none is feasible."""
    feasible, rejected = list(space.feasible), list(space.rejected)
    if choice.name == "replay":
        # What the recording machine's compiler ruled out is dropped here, as
        # precompiling drops it in a PyCUDA run, so a replay searches the same space.
        recording = backend.recording_for(problem)  # type: ignore[attr-defined]
        feasible, outside = within_recording(feasible, recording)
        rejected += outside
    _require_some(feasible, rejected, problem, device)
    return feasible, rejected


def _require_some(
    feasible: list[KernelPlan], rejected: list[KernelPlan], problem: Problem, device: DeviceProfile
) -> None:
    if not feasible:
        raise ConfigError(
            f"no feasible candidate for {problem.label()} on {device.name}: "
            f"all {len(rejected)} rejected (first: {rejected[0].reason if rejected else '-'})"
        )


def _source_hashes(choice: BackendChoice, backend: Backend, problem: Problem) -> dict[str, str]:
    """The kernel sources the timings belong to: today's, or for a replay the
    recording's (so the registry sees a stale recording as stale)."""
    from kernels import build

    current = {family: build.source_hash(family) for family in build.sources()}
    if choice.name == "replay":
        recorded = backend.recording_for(problem).source_hashes  # type: ignore[attr-defined]
        return current | dict(recorded)
    return current


# ---------------------------------------------------------------------- results


def _store_best(
    result: SearchResult,
    problem: Problem,
    environment: Environment,
    source_hashes: Mapping[str, str],
    registry_url: str,
    *,
    replayed: bool = False,
) -> str:
    best = result.best
    record = best_record(result, source_hashes, replayed=replayed)
    if best is None or record is None:
        return "registry: nothing stored (no candidate produced a time)"
    with PlanRegistry.open(registry_url) as registry:
        outcome = registry.record(problem, environment, record, source_hashes=source_hashes)
        where = registry.url
    kind = (
        "measured"
        if record.measured
        else "replayed, stored as predicted"
        if replayed
        else "predicted"
    )
    so_far = "best so far " if result.interrupted else ""
    line = (
        f"registry: {so_far}{best.key} ({best.median_ms:.4f} ms, {kind}) stored in {where} "
        f"for {problem.label()} on {environment.gpu_name}: {_STATUS_WORDS[outcome.status]}"
    )
    if environment.gpu_name == MODEL_GPU_NAME:
        line += (
            f" (GPU name {MODEL_GPU_NAME!r}: a plan tuned without a GPU is never served on one; "
            "kernels.attention there asks for its own GPU's plans)"
        )
    return line


def best_record(
    result: SearchResult, source_hashes: Mapping[str, str], *, replayed: bool = False
) -> PlanRecord | None:
    """The registry's record of the study's best trial; None when no trial has a time."""
    if result.best is None:
        return None
    record = plan_record(result.best, source_hashes, result.study_name)
    if replayed:
        # Recorded timings replayed here are not a measurement on this machine.
        record = dataclasses.replace(record, measured=False)
    return record


def plan_record(
    best: TrialOutcome, source_hashes: Mapping[str, str], study: str | None = None
) -> PlanRecord:
    """The registry's record of a trial: the plan's parameters and all its evidence."""
    family = str(best.params["family"])
    # The family's tunables only (the trial also records the plan's sequence_splits).
    params = {
        tunable.name: int(best.params[tunable.name])
        for tunable in family_named(family).tunables
        if tunable.name in best.params
    }
    return PlanRecord(
        family=family,
        params=params,
        source_hash=source_hashes.get(family, ""),
        measured=best.measured,
        median_ms=best.median_ms,
        spread_ms=best.spread_ms,
        tflops=best.tflops,
        gbps=best.gbps,
        max_abs_error=best.max_abs_error,
        predicted_ms=best.predicted_ms,
        predicted_read_bytes=best.predicted_read_bytes,
        predicted_write_bytes=best.predicted_write_bytes,
        study_name=study,
        trial_number=best.number,
    )


def _write_plots(result: SearchResult, problem: Problem, output_dir: str | Path | None) -> str:
    if not plots.available():
        return (
            "plots: none (matplotlib is not installed; pip install 'flash-attention-tuner[plots]')"
        )
    directory = Path(output_dir) if output_dir is not None else _hydra_run_directory()
    if directory is None:
        return "plots: none (no run directory: not started by Hydra and none given)"
    written = plots.write_plots(result, directory, problem.label())
    if not written:
        return "plots: none (no candidate produced a time)"
    line = f"plots: {', '.join(p.name for p in written)} in {directory}"
    if not any(trial.measured for trial in result.trials):
        line += " (predicted times: without GPU timings no heatmap or predicted-vs-measured plot)"
    return line


def _hydra_run_directory() -> Path | None:
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except (ImportError, ValueError):  # ValueError: HydraConfig was not set (no Hydra run)
        return None
