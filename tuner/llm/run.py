"""A model run: every problem of the model tuned in one command, one table at the end.

    python -m tuner model=llama-3.1-8b

One backend, one study storage and one registry serve every problem
(``tuner.app.TuneSession``). Each problem has its own study, named after the problem
as the shape command names it, so a rerun continues each study where it stopped, and
a finished study is not searched again: its trials are read back for the table. One
progress display follows the problems in turn (``problem i/n``). Each best plan is
stored in the registry unless the registry already holds that very trial (a rerun
adds no history). A problem the planner cannot serve, or a replay file does not hold,
is listed as skipped with the reason.

Ctrl-C ends the problem in hand as the shape command does (its best so far is stored)
and leaves the rest to the next run; the exit status is then 130. Worker processes
that failed, or no problem tuned at all (each skipped when the run came to it), make
it 1.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import TextIO

from db import PlanRegistry, RecordStatus
from tuner import termination
from tuner.app import TunedProblem, TuneSession, best_record
from tuner.errors import ConfigError
from tuner.llm.problems import ModelProblem
from tuner.llm.servable import SkippedProblem
from tuner.llm.summary import (
    ProblemOutcome,
    layers_text,
    scale_text,
    skipped_lines,
    summary_table,
)
from tuner.llm.validation import ValidatedModel
from tuner.problem import Problem
from tuner.progress import ProblemsProgress
from tuner.run_log import to_log_file
from tuner.study_storage import storage_url as display_url

#: registry outcomes, as the run's registry line counts them
_STORED_WORDS = {
    RecordStatus.STORED_NEW_BEST: "new",
    RecordStatus.REPLACED_BEST: "replaced a previous best",
    RecordStatus.KEPT_PREVIOUS_BEST: "kept as history (a previous best stays)",
    RecordStatus.ALREADY_STORED: "already stored",
}
_NOTHING = "without a time (nothing to store)"


def run_model(
    validated: ValidatedModel, *, out: TextIO | None = None, stream: TextIO | None = None
) -> int:
    """Tune every problem of ``validated``; 0 when done, 130 when interrupted, 1 when a
    worker process failed or nothing was tuned. ``stream``: where the progress display
    goes (stderr)."""
    return _ModelRun(validated, out or sys.stdout, stream).run()


class _ModelRun:
    def __init__(self, validated: ValidatedModel, out: TextIO, stream: TextIO | None) -> None:
        self.validated = validated
        self.attention = validated.attention
        self.config = validated.config
        self.out = out
        self.progress = ProblemsProgress(self.config.search.n_trials, stream)
        self.skipped = list(validated.skipped)
        self.tuned: list[tuple[ModelProblem, TunedProblem]] = []
        self.not_reached: list[ModelProblem] = []
        self.interrupted = False

    def say(self, line: str) -> None:
        with self.progress.output_cleared(self.out):
            print(line, file=self.out, flush=True)
        to_log_file(line)

    def run(self) -> int:
        session = TuneSession.open(self.config, self.validated.device, self.say)
        self.store = _PlanStore(session)
        try:
            problems = self._announce(session)
            with self.progress:
                self.progress.expect(len(problems))
                self._tune(session, problems)
        finally:
            session.close()
            self.store.close()
        return self._report(session)

    def _announce(self, session: TuneSession) -> list[ModelProblem]:
        """Say what the model is and what will be tuned; the problems a replay lacks are
        skipped here."""
        attention, n_trials = self.attention, self.config.search.n_trials
        self.say(f"model: {attention.name}: {attention.describe()}")
        self.say(
            f"softmax scale {scale_text(attention)}: run-time data, not part of what is "
            "tuned (pass it as kernels.attention(..., scale=))"
        )
        problems = []
        for model_problem in self.validated.problems:
            gap = session.replay_gap(model_problem.problem)
            if gap:
                self.skipped.append(SkippedProblem(model_problem, gap))
            else:
                problems.append(model_problem)
        self.say(
            f"problems: {self.validated.total} distinct from {len(self.validated.buckets)} "
            f"buckets x {attention.layers} layers ({self.config.dtype}), {len(problems)} to "
            f"tune with search.n_trials={n_trials} each, {len(self.skipped)} skipped; "
            f"studies in {display_url(session.storage)}"
        )
        return problems

    def _tune(self, session: TuneSession, problems: list[ModelProblem]) -> None:
        """Each problem in turn, its best plan stored as soon as its search ends (a run
        killed later keeps it). Ctrl-C stops after the problem in hand."""
        for index, model_problem in enumerate(problems, 1):
            self.progress.begin(index)
            try:
                tuned = self._tune_one(session, model_problem, index, len(problems))
            except KeyboardInterrupt:  # outside a search: while planning or compiling
                self.interrupted = True
                self.not_reached = problems[index - 1 :]
                return
            finally:
                self.progress.end()
            if tuned is None:
                continue
            self.tuned.append((model_problem, tuned))
            self.store.store(model_problem.problem, tuned)
            if tuned.result.interrupted:
                self.interrupted = True
                self.not_reached = problems[index:]
                return

    def _tune_one(
        self, session: TuneSession, model_problem: ModelProblem, index: int, count: int
    ) -> TunedProblem | None:
        problem = model_problem.problem
        try:
            prepared = session.prepare(problem, self.validated.spaces.get(problem))
        except ConfigError as error:  # the compiler ruled out every candidate
            self.skipped.append(SkippedProblem(model_problem, str(error)))
            return None
        n_trials = self.config.search.n_trials
        if prepared.done is None:
            state = "new study"
        elif prepared.done >= n_trials:
            state = f"tuned before ({prepared.done} trials)"
        else:
            state = f"continuing ({prepared.done} of {n_trials} trials done)"
        serves = self._serves(model_problem)
        self.say(f"problem {index}/{count}: {problem.label()} ({serves}): {state}")
        return session.search(prepared, self.progress)

    def _serves(self, model_problem: ModelProblem) -> str:
        return "; ".join(
            f"{use.bucket.label()}, layers {layers_text(use.layers, self.attention.layers)}"
            for use in model_problem.uses
        )

    # ------------------------------------------------------------------ the end

    def _report(self, session: TuneSession) -> int:
        failures = [line for _, tuned in self.tuned for line in tuned.failures]
        for line in dict.fromkeys(failures):
            self.say(line)
        if self.interrupted:
            self.say(
                "interrupted: the problem in hand keeps its finished trials and its best so "
                f"far; not reached: {len(self.not_reached)} of the problems (rerun the "
                "command to continue)"
            )
        outcomes = [
            ProblemOutcome(
                model_problem=model_problem,
                result=tuned.result,
                pick_key=tuned.pick.key(),
                pick_predicted_ms=tuned.prepared.predictions[tuned.pick.key()].time_ms,
            )
            for model_problem, tuned in self.tuned
        ]
        gpu = session.environment.gpu_name if session.environment else "-"
        best = [t.result.best for _, t in self.tuned if t.result.best is not None]
        how = "measured on" if best and all(b.measured for b in best) else "predicted for"
        self.say(
            f"best plan per problem, {how} {gpu} ({len(outcomes)} tuned, "
            f"{len(self.skipped)} skipped; {self.config.dtype}, causal):"
        )
        self.say(summary_table(outcomes, self.attention))
        for line in skipped_lines(self.skipped, self.attention):
            self.say(line)
        self.say(self.store.line())
        if self.interrupted:
            return termination.exit_status()
        # Every problem skipped when the run came to it (a replay file that holds none of
        # them, a compiler that ruled out every candidate): the run did not do its job.
        return 1 if failures or not self.tuned else 0


class _PlanStore:
    """The registry a model run stores each problem's best plan in, opened at the first
    plan; a plan it holds already (that very trial of that study) is not stored again."""

    def __init__(self, session: TuneSession) -> None:
        self.session = session
        self.registry: PlanRegistry | None = None
        self.counts: Counter[str] = Counter()
        self.measured: set[bool] = set()

    def store(self, problem: Problem, tuned: TunedProblem) -> None:
        session = self.session
        environment = session.environment
        assert environment is not None
        record = best_record(tuned.result, tuned.source_hashes, replayed=session.replayed)
        if record is None:
            self.counts[_NOTHING] += 1
            return
        self.measured.add(record.measured)
        if self.registry is None:
            self.registry = PlanRegistry.open(session.registry_url)
        outcome = self.registry.record(
            problem, environment, record, source_hashes=tuned.source_hashes
        )
        self.counts[_STORED_WORDS[outcome.status]] += 1

    def line(self) -> str:
        """What was stored where, in one line."""
        stored = sum(count for words, count in self.counts.items() if words != _NOTHING)
        if not stored:
            return "registry: nothing stored (no problem produced a time)"
        session = self.session
        kind = (
            "measured"
            if self.measured == {True}
            else "replayed, stored as predicted"
            if session.replayed
            else "predicted"
        )
        parts = ", ".join(f"{count} {words}" for words, count in self.counts.items())
        where = self.registry.url if self.registry is not None else session.registry_url
        gpu = session.environment.gpu_name if session.environment else "-"
        return (
            f"registry: the best plans of {stored} problems ({kind}) in {where} for {gpu}: {parts}"
        )

    def close(self) -> None:
        if self.registry is not None:
            self.registry.close()
