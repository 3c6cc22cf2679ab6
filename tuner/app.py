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

Ctrl-C during the search ends it cleanly: finished trials stay in the study,
the best so far is printed and stored (the output says so), measurement
workers are stopped, and the exit status is 130. A worker process that failed
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
from pathlib import Path
from typing import Any, TextIO

from optuna.storages import BaseStorage
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError
from tqdm import tqdm

from db import PlanRecord, PlanRegistry, RecordStatus
from kernels.backends import Backend, BackendChoice, BackendFactory, choose_backend, make_backend
from tuner import plots, report
from tuner.config import ValidatedConfig, space_axes_from
from tuner.costmodel import predict
from tuner.data_dir import default_registry_url
from tuner.device import DeviceProfile
from tuner.environment import Environment
from tuner.errors import BackendError, ConfigError
from tuner.isolation import IsolatedBackend
from tuner.phases import PhaseClock
from tuner.planner.errors import PlanError
from tuner.planner.families import family_named
from tuner.planner.space import candidate_space
from tuner.planner.tunable import KernelPlan
from tuner.precompile import CompileAhead, precompile
from tuner.problem import Problem
from tuner.run_log import to_log_file
from tuner.search import (
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
from tuner.workers import IsolatedFactory, WorkerJob, plan_gpus, search_with_workers

EXIT_INTERRUPTED = 130
TOP_ROWS = 5
_STATUS_WORDS = {
    RecordStatus.STORED_NEW_BEST: "the first plan of this problem and environment",
    RecordStatus.REPLACED_BEST: "replaces the previous best",
    RecordStatus.KEPT_PREVIOUS_BEST: "kept as history; the previous best stays",
}


def run(
    validated: ValidatedConfig,
    *,
    output_dir: str | Path | None = None,
    out: TextIO | None = None,
    clock: PhaseClock | None = None,
) -> int:
    """Tune ``validated.problem``; 0 when done, 130 when interrupted (best so far stored).

    ``clock``: where the wall time goes, one line at the end (``tuner.phases``).
    """
    out = out or sys.stdout
    clock = clock or PhaseClock()
    config, problem = validated.config, validated.problem
    registry_url = config.registry.url or default_registry_url()  # validate() resolved it

    def say(line: str) -> None:
        print(line, file=out, flush=True)
        to_log_file(line)

    choice = choose_backend(config.backend)
    gpu_plan = None if config.workers == 1 else plan_gpus(config.workers)
    if gpu_plan is not None and gpu_plan.count == 1:
        say(gpu_plan.line())
        gpu_plan = None
    backend = _build_backend(choice, validated)
    storage = None
    compile_ahead = None
    failures: list[str] = []
    try:
        with clock.phase("backend start"):
            say(choice.line(_measures_on_a_gpu(choice, backend)))
            device = _device_profile(choice, backend, validated.device)
            environment = Environment(**backend.environment())  # type: ignore[arg-type]
        if gpu_plan is None:
            # The measurement worker builds the inputs and references meanwhile.
            backend.prepare(problem)
        lazy = choice.name == "pycuda" and gpu_plan is None and config.search.sampler == "model"
        feasible, rejected = _candidates(
            choice, backend, validated, device, clock, precompiled=not lazy
        )
        with clock.phase("planning"):
            predictions = {plan.key(): predict(plan, device) for plan in feasible}
        if lazy:
            compile_ahead = CompileAhead(
                device, config.backend.cache_dir, config.backend.compile_jobs
            )
        hashes = _source_hashes(choice, backend, problem)
        # A replay is a simulation of a GPU run: its own study, never the GPU's.
        variant = "replay" if choice.name == "replay" else ""
        name = config.search.study_name or study_name(
            problem, environment, hashes, variant, sampler=config.search.sampler
        )
        storage_url = config.search.storage or default_storage_url(registry_url)
        _check_storage(storage_url, registry_url, shared=gpu_plan is not None)
        # Checked before the study is touched: a registry that cannot take the
        # result is refused now, not after the search has spent its trials. A new
        # SQLite registry is created only when there is a plan to store.
        with clock.phase("study"):
            PlanRegistry.check_writable(registry_url)
            storage = open_storage(
                storage_url,
                heartbeat_interval_s=config.search.heartbeat_interval_s,
                grace_period_s=config.search.grace_period_s,
            )
            done = _trials_done(storage, name)
        shown = display_url(storage)  # a server's password stays off the terminal
        compiled = "by the planner; compiled as the search reaches them" if lazy else "candidates"
        say(
            f"study: {name} in {shown} ({len(feasible)} feasible {compiled}, "
            f"{len(rejected)} rejected; optuna-dashboard {shown} shows it)"
        )
        if done is not None:
            say(
                f"study: continuing {name} ({done} trials done of "
                f"search.n_trials={config.search.n_trials}; search.study_name=<new name> "
                "starts another)"
            )
        if config.search.stop and stopping_rule(config.search) is None:
            say(f"search.stop: off ({rule_off_reason(config.search)})")
        space = StudySpace(
            problem, device, feasible, rejected, encoding=encoding_for(config.search.sampler)
        )
        search_began = time.monotonic()
        if choice.name == "pycuda":  # the search waits on the GPU: import meanwhile
            plots.import_ahead()
        if gpu_plan is None:
            with _ProgressBar() as progress:
                result = run_search(
                    space,
                    backend,
                    config.search,
                    storage=storage,
                    study_name=name,
                    predictions=predictions,
                    progress=progress,
                    on_start=progress.start,
                    compile_ahead=compile_ahead,
                )
        else:
            # The parent measures nothing: its backend (and, for PyCUDA, the GPU
            # context of its measurement process) goes before the workers start.
            backend.close()
            say(gpu_plan.line())
            job = WorkerJob(
                space=space,
                predictions=predictions,
                settings=config.search,
                storage_url=storage_url,
                study_name=name,
                backend=_worker_backend(choice, validated),
                environment=environment.as_dict(),
            )
            with _ProgressBar(f"trials ({gpu_plan.count} workers)") as progress:
                result, outcome = search_with_workers(
                    job, gpu_plan, storage, progress=progress, on_start=progress.start
                )
            failures = [f"workers: {e.describe()}" for e in outcome.failed] if outcome else []
        clock.add("search", time.monotonic() - search_began)
        trials = result.new_measurements
        if trials:
            seconds = clock.seconds["search"]
            clock.note("search", f"{trials} trials, {seconds / trials:.2f} s each")
        if compile_ahead is not None:
            asked, cached = compile_ahead.variants
            compiled = f"{asked} kernels compiled ahead, {cached} cached"
            clock.note("search", "; ".join(filter(None, (clock.notes.get("search"), compiled))))
    finally:
        if compile_ahead is not None:
            compile_ahead.close()
        backend.close()
        if storage is not None:
            storage.engine.dispose()  # SQLite checkpoints its WAL into the file

    with clock.phase("report"):
        for line in failures:
            say(line)
        if result.interrupted:
            say("interrupted: the study keeps its finished trials; the best so far follows")
        say(report.best_table(result, TOP_ROWS))
        for line in report.summary_lines(result):
            say(line)
        say(_store_best(result, problem, environment, hashes, registry_url, replayed=variant != ""))
        say(_write_plots(result, problem, output_dir))
    say(clock.line())
    if result.interrupted:
        return EXIT_INTERRUPTED
    return 1 if failures else 0


# ---------------------------------------------------------------------- backend


def _build_backend(choice: BackendChoice, validated: ValidatedConfig) -> Backend:
    """The backend, not started yet. PyCUDA measures in worker processes unless
    ``backend.isolate=false``; the model and replay backends run in this process
    (they only read numbers: nothing there can crash or hang)."""
    config = validated.config
    if choice.name == "pycuda" and importlib.util.find_spec("pycuda") is None:
        # Said here, not by a worker that cannot start.
        raise BackendError(
            "backend=pycuda: pycuda is not installed (pip install 'flash-attention-tuner[cuda]')"
        )
    if choice.name == "pycuda" and config.backend.isolate:
        factory = BackendFactory("pycuda", config.backend, device=validated.device)
        return IsolatedBackend(factory, config.search.trial_timeout_s, name="pycuda")
    backend = make_backend(choice.name, config.backend, device=validated.device)
    if choice.name == "replay":
        backend.recording_for(validated.problem)  # type: ignore[attr-defined]
    return backend


def _worker_backend(choice: BackendChoice, validated: ValidatedConfig) -> Callable[[], Backend]:
    """The recipe each worker process builds its own backend from (isolated for PyCUDA)."""
    config = validated.config
    factory = BackendFactory(choice.name, config.backend, device=validated.device)
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


def _candidates(
    choice: BackendChoice,
    backend: Backend,
    validated: ValidatedConfig,
    device: DeviceProfile,
    clock: PhaseClock,
    *,
    precompiled: bool = True,
) -> tuple[list[KernelPlan], list[KernelPlan]]:
    """The feasible and rejected plans; for PyCUDA with ``precompiled`` every variant is
    compiled first and judged by ptxas (without, the search compiles ahead of itself)."""
    with clock.phase("planning"):
        feasible, rejected = _planned(choice, backend, validated, device)
    if choice.name == "pycuda" and precompiled:
        config = validated.config
        with clock.phase("compiling"):
            feasible, compiled_out = precompile(
                feasible, device, config.backend.cache_dir, config.backend.compile_jobs
            )
        rejected += compiled_out
        _require_some(feasible, rejected, validated.problem, device)
    return feasible, rejected


def _planned(
    choice: BackendChoice, backend: Backend, validated: ValidatedConfig, device: DeviceProfile
) -> tuple[list[KernelPlan], list[KernelPlan]]:
    """The planner's feasible and rejected plans (for a replay, less what the recording's
    compiler ruled out)."""
    problem, config = validated.problem, validated.config
    try:
        space = candidate_space(problem, device, space_axes_from(config.search))
    except PlanError as error:
        raise ConfigError(f"{problem.label()} cannot be planned: {error}") from error
    feasible, rejected = list(space.feasible), list(space.rejected)
    if choice.name == "replay":
        # What the recording machine's compiler ruled out is dropped here, as
        # precompiling drops it in a PyCUDA run, so a replay searches the same space.
        recording = backend.recording_for(problem)  # type: ignore[attr-defined]
        # A family the recording did not time (its source_hashes name the ones it did)
        # has nothing to replay: its plans are ruled out, not tried and failed one by one.
        recorded = set(recording.source_hashes)
        if recorded:
            rejected += [
                dataclasses.replace(
                    plan, feasible=False, reason=f"{plan.family} is not in the recording"
                )
                for plan in feasible
                if plan.family not in recorded
            ]
            feasible = [plan for plan in feasible if plan.family in recorded]
        verdicts = {plan.key(): recording.rejection(plan.key()) for plan in feasible}
        rejected += [
            dataclasses.replace(plan, feasible=False, reason=verdicts[plan.key()])
            for plan in feasible
            if verdicts[plan.key()]
        ]
        feasible = [plan for plan in feasible if not verdicts[plan.key()]]
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
    if best is None:
        return "registry: nothing stored (no candidate produced a time)"
    record = plan_record(best, source_hashes, result.study_name)
    if replayed:
        # Recorded timings replayed here are not a measurement on this machine.
        record = dataclasses.replace(record, measured=False)
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
    return (
        f"registry: {so_far}{best.key} ({best.median_ms:.4f} ms, {kind}) stored in {where} "
        f"for {problem.label()} on {environment.gpu_name}: {_STATUS_WORDS[outcome.status]}"
    )


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
    return f"plots: {', '.join(p.name for p in written)} in {directory}"


def _hydra_run_directory() -> Path | None:
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except (ImportError, ValueError):  # ValueError: HydraConfig was not set (no Hydra run)
        return None


class _ProgressBar:
    """A tqdm bar on stderr over the trials that count, with the best time so far.

    Not on a terminal (CI logs, a pipe) a bar would be noise: a line every tenth of
    the trials instead (``trials: 12/40, best 0.2431 ms``), and one at the end.
    """

    def __init__(self, desc: str = "trials", stream: TextIO | None = None) -> None:
        self.bar: tqdm | None = None
        self.best = float("inf")
        self.desc = desc
        self.stream = stream or sys.stderr
        self.lines = not _is_terminal(self.stream)
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

    def __enter__(self) -> _ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False
