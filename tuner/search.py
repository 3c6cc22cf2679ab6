"""The search: an Optuna study over the feasible candidates, measured through a backend.

    result = run_search(space, backend, settings, storage_url=..., study_name=...,
                        predictions=...)

The study lives in Optuna's RDB storage (SQLite by default, see
``tuner.study_names``), so re-running the same command continues it, and
``optuna-dashboard <storage-url>`` shows it live. Order of work:

1. The cost model's best ``enqueue_top`` candidates (within the traffic
   cutoff, not yet evaluated in this study) are enqueued, best first.
2. The sampler (``model``: the cost model's ranking corrected by the measured
   residuals, proposing the plan most likely to beat the best by
   ``stop_margin``, ``tuner.model_sampler``; ``tpe``: multivariate TPE seeded
   with ``seed``; ``random``; ``grid``: every feasible candidate once, see
   ``tuner.study_space``) proposes.
3. Each proposal becomes a trial with one ``outcome`` user attribute:

   ============  ===========  =====================================  =======
   outcome       state        what happened                          counts
   ============  ===========  =====================================  =======
   measured      COMPLETE     backend timed it (value = median ms)   yes
   failed        PRUNED       backend: compile, crash, timeout, ...  yes
   infeasible    PRUNED       planner/compiler rejects the point     no
   skipped       PRUNED       predicted traffic > cutoff x the best  no
   duplicate     as before    already evaluated in this study        no
   duplicate     FAIL         being measured by another worker now   no
   surplus       FAIL         other workers filled ``n_trials``, or  no
                              the stopping rule fired (``STOPPED``)
   interrupted   FAIL         Ctrl-C during its measurement          no
   ============  ===========  =====================================  =======

   Only *measured* and *failed* trials cost backend time, and only they count
   towards ``n_trials``: a resumed study runs ``n_trials`` minus the ones it
   has. The free trials stay in the study (the dashboard shows what the
   sampler tried) and teach the sampler, but a sampler that keeps proposing
   them is given the best-predicted unevaluated candidate after
   ``FREE_STREAK_LIMIT`` in a row, and the search ends when every candidate
   within the cutoff has been evaluated.
4. With the model sampler and ``stop`` (the default), the stopping rule
   (``tuner.stopping``) is asked after each trial: once ``min_trials`` count and
   no unmeasured plan has a ``stop_probability`` chance of beating the best by
   ``stop_margin``, the search ends (``n_trials`` stays the cap). The study
   records the rule (user attribute ``stop_rule``) and its verdict
   (``stopped``: the trial, the count, the largest chance and its plan, the
   reason). A study the rule ended stays ended when resumed under the same rule
   settings; other settings judge it afresh.

Several workers (processes, GPUs, hosts) may run the same study on one
storage at once (``tuner.workers``); the counting and the "already evaluated
or being measured" check are made on the shared storage, with the claims of
``tuner.claims``, so the study still ends with exactly ``n_trials`` trials that
count (or fewer, by the stopping rule) and no plan measured twice. Each worker
asks the rule after its trials; the first verdict is recorded in the study,
and a worker whose claim comes after it gives its trial up (``surplus``,
``STOPPED``) unmeasured, so no trial starts after the rule fired. Each
worker's sampler has its own seed (``seed + worker``), and TPE treats the
other workers' running trials as "constant liars" so it does not propose them
again; the model sampler never proposes a plan another worker is measuring.

Failures are PRUNED with the constraint ``failed = 1`` rather than FAIL or a
penalty value: TPE ignores FAIL trials (it would propose the same crash
again), and a penalty value would distort the best value, the history and the
plots. Pruned trials and, ranked below them, constraint-violating ones are
what TPE puts in its "bad" group, so it learns to stay away.

Each trial's user attributes: ``outcome``, ``plan_key``, ``params`` (``family``,
the family's tunables, and the plan's ``sequence_splits``), ``predicted`` (``ms``, ``read_bytes``,
``write_bytes``), ``measured``, ``median_ms``, ``timing`` (``spread_ms``,
``tflops``, ``gbps``, ``max_abs_error``), ``failure``, ``detail``, and
``duplicate_of``, ``enqueued`` or ``retry_of`` (the trial of a dead worker that
this one runs again) where they apply, and ``claim`` (see ``tuner.claims``).
(Grouped: every attribute is a storage transaction of its own.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import optuna
from optuna.storages import BaseStorage
from optuna.trial import FrozenTrial, TrialState

from kernels.backends.base import Backend, Measurement
from tuner import claims, termination
from tuner.config import SearchConfig
from tuner.costmodel import Prediction
from tuner.errors import ConfigError, TunerError
from tuner.model_sampler import ModelSampler, ResidualModel
from tuner.planner.tunable import KernelPlan
from tuner.precompile import CompileAhead
from tuner.problem import Problem
from tuner.stopping import StoppingRule, Verdict, judge
from tuner.study_space import Encoding, StudySpace
from tuner.study_storage import HEARTBEAT_INTERVAL_S, open_storage, storage_url
from tuner.trials import SearchResult, TrialOutcome

__all__ = ["HEARTBEAT_INTERVAL_S", "SearchResult", "open_storage", "run_search"]

SAMPLERS = ("model", "tpe", "random", "grid")
#: free proposals (infeasible, skipped, duplicate) in a row before the search
#: hands the sampler the best-predicted candidate it has not evaluated yet
FREE_STREAK_LIMIT = 25

#: the failure of a plan the compiler ruled out during the search (``CompileAhead``)
COMPILED_OUT = "COMPILER"
#: study user attributes: the stopping rule a run used, and its verdict when it fired
RULE_ATTR = "stop_rule"
STOPPED_ATTR = "stopped"

Progress = Callable[[TrialOutcome], None]


def stopping_rule(settings: SearchConfig) -> StoppingRule | None:
    """The rule ``settings`` ask for; None when it is off (``rule_off_reason`` says why)."""
    if not settings.stop or settings.sampler != "model":
        return None
    return StoppingRule(settings.stop_margin, settings.stop_probability, settings.min_trials)


def recorded_stop(study: optuna.Study, rule: StoppingRule | None) -> dict[str, Any] | None:
    """The rule's verdict recorded in ``study`` when it was made under ``rule``'s settings."""
    if rule is None:
        return None
    record = study.user_attrs.get(STOPPED_ATTR)
    if not isinstance(record, dict):
        return None
    same = all(record.get(name) == value for name, value in rule.settings().items())
    return record if same else None


def study_stopped_by_rule(
    storage: BaseStorage, study_name: str, settings: SearchConfig
) -> dict[str, Any] | None:
    """``recorded_stop`` of the study ``study_name`` under the rule ``settings`` ask for."""
    with _quiet_optuna():
        study = optuna.load_study(study_name=study_name, storage=storage)
        return recorded_stop(study, stopping_rule(settings))


def rule_off_reason(settings: SearchConfig) -> str:
    if not settings.stop:
        return "search.stop=false"
    return (
        f"search.sampler={settings.sampler}: the stopping rule reads the model sampler's "
        "posterior, and this sampler runs n_trials"
    )


class _Unmeasured(Exception):
    """Ends a trial as FAIL without a value (in flight elsewhere, surplus): the
    sampler ignores it, and it is not an error of the run."""


def make_sampler(
    name: str,
    seed: int,
    space: StudySpace,
    *,
    parallel: bool = False,
    ranked: Sequence[tuple[KernelPlan, float]] = (),
    margin: float = SearchConfig.stop_margin,
) -> optuna.samplers.BaseSampler:
    """The sampler ``name``; ``parallel``: other workers share the study (TPE then
    counts their running trials as bad, so it does not propose what they measure).
    ``ranked``: the plans the ``model`` sampler may propose with their predicted ms
    (``allowed_plans``); ``margin``: the improvement its proposals aim at."""
    if name == "model":
        if space.encoding != encoding_for(name):
            raise ConfigError("the model sampler proposes plan keys: give it a candidate space")
        if not ranked:
            ranked = [(plan, 1.0) for plan in space.feasible]
        plans, predicted = [p for p, _ in ranked], [ms for _, ms in ranked]
        return ModelSampler(plans, predicted, seed=seed, margin=margin)
    if name == "tpe":
        with warnings.catch_warnings():
            # ``group`` is experimental; it is what handles the family-conditional space.
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.TPESampler(
                seed=seed, multivariate=True, group=True, constant_liar=parallel
            )
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "grid":
        return optuna.samplers.GridSampler({"candidate": space.keys}, seed=seed)
    raise ConfigError(f"search.sampler={name} is invalid: allowed: {', '.join(SAMPLERS)}")


def encoding_for(sampler: str) -> Encoding:
    """TPE learns from the tunables' structure; the others draw from the plans.

    Random search over the structured space would spend half its draws on the
    ``family`` coin and so on the three scalar plans; uniform over the feasible
    plans is the baseline worth comparing TPE with. The model sampler learns
    from the tunables itself (``tuner.model_sampler``) and proposes plan keys.
    """
    return "structured" if sampler == "tpe" else "candidate"


def allowed_plans(
    space: StudySpace, predictions: Mapping[str, Prediction], traffic_cutoff: float
) -> list[tuple[KernelPlan, float]]:
    """The feasible plans within the traffic cutoff with their predicted ms, best first.

    A plan whose predicted traffic exceeds ``traffic_cutoff`` times the
    smallest is not worth a measurement; a plan without a prediction ranks last.
    """

    def traffic(plan: KernelPlan) -> int:
        prediction = predictions.get(plan.key())
        return prediction.traffic_bytes if prediction else plan.global_bytes

    def predicted(plan: KernelPlan) -> float:
        prediction = predictions.get(plan.key())
        return prediction.time_ms if prediction else math.inf

    cutoff = traffic_cutoff * min(traffic(plan) for plan in space.feasible)
    allowed = [(plan, predicted(plan)) for plan in space.feasible if traffic(plan) <= cutoff]
    allowed.sort(key=lambda item: (item[1], item[0].key()))
    return allowed


@contextlib.contextmanager
def _quiet_optuna() -> Iterator[None]:
    # The search reports every trial itself; Optuna's INFO lines and its
    # warning (with traceback) for an interrupted trial would repeat them.
    previous = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            yield
    finally:
        optuna.logging.set_verbosity(previous)


class _Search:
    """The state of one ``run_search`` call (the objective and its callback)."""

    def __init__(
        self,
        space: StudySpace,
        backend: Backend,
        settings: SearchConfig,
        predictions: Mapping[str, Prediction],
        study: optuna.Study,
        progress: Progress | None,
        compile_ahead: CompileAhead | None = None,
    ) -> None:
        self.space = space
        self.compile_ahead = compile_ahead
        self.backend = backend
        self.settings = settings
        self.predictions = predictions
        self.study = study
        self.progress = progress
        #: the shared study as last read (every worker's trials)
        self.shared = claims.Snapshot()
        #: plans the compiler ruled out during the search (``compile_ahead``)
        self.compiled_out: set[str] = set()
        self.deadline: float | None = None
        self.free_streak = 0
        self.new_trials: list[int] = []
        self.stop_reason = ""
        self.measuring = False
        self.stop_requested = False
        best_traffic = min(self._traffic(plan) for plan in space.feasible)
        self.cutoff_bytes = settings.traffic_cutoff * best_traffic
        # Best predicted first: the enqueue order and the fallback order.
        self.ranked = allowed_plans(space, predictions, settings.traffic_cutoff)
        self.allowed = [plan for plan, _ in self.ranked]
        self.allowed_keys = [plan.key() for plan in self.allowed]
        self.rule = stopping_rule(settings)
        #: the regression the rule reads: the model sampler's own, where it runs here
        self.model: ResidualModel | None = None
        if self.rule is not None:
            sampler = study.sampler
            self.model = (
                sampler.model
                if isinstance(sampler, ModelSampler)
                else ResidualModel(self.allowed, [ms for _, ms in self.ranked])
            )
        #: the rule's verdict when it ended the search
        self.stopped_by_rule: dict[str, Any] | None = None
        self.refresh()

    # ------------------------------------------------------------------ bookkeeping

    def _traffic(self, plan: KernelPlan) -> int:
        prediction = self.predictions.get(plan.key())
        return prediction.traffic_bytes if prediction else plan.global_bytes

    def refresh(self) -> None:
        """Read the shared study again: what counts, what is evaluated, what is in flight."""
        trials = self.study.get_trials(deepcopy=False)
        self.shared = claims.snapshot(trials)
        self.compiled_out = {
            str(t.user_attrs.get("plan_key"))
            for t in trials
            if t.user_attrs.get("failure") == COMPILED_OUT
        }

    @property
    def counted(self) -> int:
        return self.shared.counted

    @property
    def evaluated(self) -> dict[str, FrozenTrial]:
        return self.shared.evaluated

    def unevaluated(self) -> list[KernelPlan]:
        """Allowed plans neither evaluated nor being measured by another worker."""
        busy = self.shared.in_flight
        evaluated = self.evaluated
        return [
            plan
            for plan, key in zip(self.allowed, self.allowed_keys, strict=True)
            if key not in evaluated and key not in busy and key not in self.compiled_out
        ]

    def upcoming(self, count: int) -> list[KernelPlan]:
        """The ``count`` plans the search will most likely measure next: the queued ones,
        then the model sampler's order (highest chance first), else the predicted order."""
        waiting = {
            str((t.system_attrs.get("fixed_params") or {}).get("candidate"))
            for t in self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        }
        open_plans = self.unevaluated()
        queued = [plan for plan in open_plans if plan.key() in waiting]
        rest = [plan for plan in open_plans if plan.key() not in waiting]
        sampler = self.study.sampler
        measured = self.measured()
        if isinstance(sampler, ModelSampler) and measured and rest:
            model = sampler.model
            rows = [model.index[plan.key()] for plan in rest]
            z = model.chances(measured, rows, sampler.margin).z
            rest = [rest[i] for i in np.argsort(-z, kind="stable")]
        return (queued + rest)[:count]

    def compile_upcoming(self) -> None:
        if self.compile_ahead is not None:
            self.compile_ahead.request(self.upcoming(self.compile_ahead.window))

    def remaining(self) -> int:
        return self.settings.n_trials - self.counted

    # ------------------------------------------------------------------ the stopping rule

    def measured(self) -> dict[str, float]:
        """Median by plan key of the evaluated plans that have a time."""
        return {
            key: float(trial.value)
            for key, trial in self.evaluated.items()
            if trial.state == TrialState.COMPLETE
            and trial.value is not None
            and math.isfinite(trial.value)
            and trial.value > 0
        }

    def verdict(self) -> Verdict | None:
        """The rule's answer on the shared study as last read; None where the rule is off."""
        if self.rule is None or self.model is None:
            return None
        unmeasured = [plan.key() for plan in self.unevaluated()]
        return judge(self.rule, self.model, self.measured(), unmeasured, self.counted)

    def record_stop(self, verdict: Verdict, trial: int | None) -> str:
        """Write the verdict into the study (the first worker's stays) and say why it stops."""
        assert self.rule is not None
        n_trials = self.settings.n_trials
        contender = (
            f" (the largest: {verdict.chance:.1%}, {verdict.contender})"
            if verdict.contender is not None
            else ""
        )
        reason = (
            f"after {verdict.counted} of {n_trials} trials: {self.rule.describe()}{contender}"
        )
        record = self.rule.settings() | {
            "n_trials": n_trials,
            "trial": trial,
            "counted": verdict.counted,
            "chance": verdict.chance,
            "contender": verdict.contender,
            "best": verdict.best_key,
            "best_ms": verdict.best_ms,
            "reason": reason,
        }
        earlier = self.recorded_stop()  # another worker's verdict on the same data stays
        if earlier is None:
            self.study.set_user_attr(STOPPED_ATTR, record)
        else:
            record = earlier
        self.stopped_by_rule = record
        return str(record.get("reason", reason))

    def recorded_stop(self) -> dict[str, Any] | None:
        """The rule's record in the study when it was made under this run's rule settings."""
        if self.rule is None:
            return None
        return recorded_stop(self.study, self.rule)

    def record_rule(self) -> None:
        """Say in the study which rule this run stops by (or why none)."""
        settings = self.settings
        described: dict[str, Any] = {"n_trials": settings.n_trials}
        if self.rule is not None:
            described |= self.rule.settings()
        else:
            described |= {"rule": "off", "why": rule_off_reason(settings)}
        if self.study.user_attrs.get(RULE_ATTR) != described:
            self.study.set_user_attr(RULE_ATTR, described)

    def enqueue_top(self) -> list[str]:
        """The top of the whole ranking: a resumed study does not enqueue the next ones."""
        count = self.settings.enqueue_top
        top = [p for p in self.allowed[:count] if p.key() not in self.evaluated]
        return self.enqueue(top, "cost model top")

    def enqueue(self, plans: list[KernelPlan], why: str) -> list[str]:
        """Queue ``plans`` in order, except those already waiting (from an interrupted run)
        or being measured (by another worker)."""
        pending = [
            t.system_attrs.get("fixed_params")
            for t in self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        ]
        keys = []
        for plan in plans:
            params = self.space.fixed_params(plan)
            if params in pending or plan.key() in self.shared.in_flight:
                continue
            self.study.enqueue_trial(params, user_attrs={"enqueued": why})
            keys.append(plan.key())
        return keys

    # ------------------------------------------------------------------ one trial

    def objective(self, trial: optuna.Trial) -> float:
        self.new_trials.append(trial.number)
        retry_of = _retry_of(trial)
        point = self.space.suggest(trial)
        resolved = self.space.resolve(point)
        if resolved.plan is None:
            attrs: dict[str, Any] = {"plan_key": resolved.key, "outcome": "infeasible"}
            if not isinstance(point, str):
                attrs["params"] = point.as_dict()
            return self._prune(trial, attrs, "INFEASIBLE", resolved.reason)
        plan = resolved.plan
        attrs = self._plan_attrs(plan) | {"retry_of": retry_of}
        earlier = self.evaluated.get(plan.key())
        if earlier is not None:
            return self._repeat(trial, attrs, earlier)
        if self._traffic(plan) > self.cutoff_bytes:
            attrs["outcome"] = "skipped"
            reason = (
                f"predicted traffic {self._traffic(plan)} B exceeds "
                f"{self.settings.traffic_cutoff:g} x the best candidate's"
            )
            return self._prune(trial, attrs, "TRAFFIC_CUTOFF", reason)
        if self.compile_ahead is not None:
            judged = self.compile_ahead.judged(plan)
            if not judged.feasible:
                attrs["outcome"] = "infeasible"
                return self._prune(trial, attrs, COMPILED_OUT, judged.reason)
        claim = claims.acquire(
            self.study,
            trial,
            plan.key(),
            self.settings.n_trials,
            should_stop=lambda: self.stop_requested,
            deadline=self.deadline,
        )
        if claim.verdict is not claims.Verdict.GO:
            return self._not_measured(trial, attrs, claim)
        stopped = self.recorded_stop()
        if stopped is not None:  # another worker's trial made the rule fire
            trial.set_user_attr(claims.CLAIM_ATTR, None)
            detail = f"the stopping rule ended the study after trial {stopped.get('trial')}"
            _write(trial, attrs | {"outcome": "surplus", "failure": "STOPPED", "detail": detail})
            raise _Unmeasured(detail)
        self.measuring = True
        try:
            measurement = self.backend.measure(plan, self.space.problem)
        except KeyboardInterrupt:
            self.measuring = False
            self.stop_requested = True
            _write(trial, attrs | {"outcome": "interrupted", "failure": "INTERRUPTED"})
            raise
        except TunerError as error:  # the backend cannot go on at all: the run ends
            _write(trial, attrs | {"outcome": "error", "detail": str(error)})
            raise
        finally:
            self.measuring = False
        attrs |= _measurement_attrs(measurement)
        if measurement.ok:
            _write(trial, attrs | {"outcome": "measured"})
            return float(measurement.median_ms)  # type: ignore[arg-type]
        attrs["outcome"] = "failed"
        return self._prune(trial, attrs, str(measurement.failure), measurement.detail)

    def _not_measured(
        self, trial: optuna.Trial, attrs: dict[str, Any], claim: claims.Claim
    ) -> float:
        """The shared study said no to measuring this trial's plan now."""
        if claim.verdict is claims.Verdict.DUPLICATE:
            assert claim.earlier is not None
            return self._repeat(trial, attrs, claim.earlier)
        if claim.verdict is claims.Verdict.IN_FLIGHT:
            detail = f"trial {claim.other} of another worker is measuring it"
            attrs |= {"outcome": "duplicate", "duplicate_of": claim.other}
            attrs |= {"failure": "IN_FLIGHT", "detail": detail}
        elif claim.verdict is claims.Verdict.FULL:
            detail = f"other workers filled n_trials={self.settings.n_trials}"
            attrs |= {"outcome": "surplus", "failure": "SURPLUS", "detail": detail}
        else:
            attrs |= {"outcome": "interrupted", "failure": "INTERRUPTED"}
            attrs["detail"] = "stopped while waiting for a slot"
        _write(trial, attrs)
        raise _Unmeasured(attrs["detail"])

    def _repeat(self, trial: optuna.Trial, attrs: dict[str, Any], earlier: FrozenTrial) -> float:
        """Reuse an earlier trial's result for the same plan; the backend is not asked."""
        attrs = attrs | {
            k: v for k, v in earlier.user_attrs.items() if k not in ("outcome", "enqueued")
        }
        attrs |= {"outcome": "duplicate", "duplicate_of": earlier.number}
        if earlier.state == TrialState.COMPLETE and earlier.value is not None:
            _write(trial, attrs)
            return float(earlier.value)
        return self._prune(trial, attrs, str(attrs.get("failure")), str(attrs.get("detail", "")))

    @staticmethod
    def _prune(trial: optuna.Trial, attrs: dict[str, Any], failure: str, detail: str) -> float:
        _write(trial, attrs | {"failure": failure, "detail": detail})
        trial.set_constraint("failed", 1.0)
        raise optuna.TrialPruned(f"{failure}: {detail}")

    def _plan_attrs(self, plan: KernelPlan) -> dict[str, Any]:
        attrs: dict[str, Any] = {"plan_key": plan.key()}
        attrs["params"] = plan.params.as_dict() | {"sequence_splits": plan.sequence_splits}
        prediction = self.predictions.get(plan.key())
        if prediction is not None:
            attrs["predicted"] = {
                "ms": prediction.time_ms,
                "read_bytes": prediction.read_bytes,
                "write_bytes": prediction.write_bytes,
            }
        return attrs

    # ------------------------------------------------------------------ after each trial

    def after_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        outcome = outcome_of(trial)
        self.refresh()
        self.free_streak = 0 if outcome.counted else self.free_streak + 1
        if self.progress is not None:
            self.progress(outcome)
        if self.stop_requested:
            self.stop_reason = f"interrupted ({termination.cause()})"
        elif self.remaining() <= 0:
            self.stop_reason = f"n_trials={self.settings.n_trials} reached"
        elif outcome.outcome == "interrupted":  # a deadline while waiting for a slot
            self.stop_reason = "stopped while waiting for a slot"
        elif not self.unevaluated():
            self.stop_reason = "every candidate within the traffic cutoff is evaluated"
            if self.shared.in_flight:
                self.stop_reason += " or being measured by another worker"
        elif (stopped := self.recorded_stop()) is not None:
            self.stopped_by_rule = stopped
            self.stop_reason = str(stopped.get("reason", "the stopping rule fired"))
        elif (verdict := self.verdict()) is not None and verdict.stop:
            self.stop_reason = self.record_stop(verdict, trial.number)
        elif self.free_streak >= FREE_STREAK_LIMIT:
            self.enqueue(self.unevaluated()[:1], "fallback: sampler repeated itself")
            self.free_streak = 0
        if self.stop_reason:
            study.stop()
        else:
            self.compile_upcoming()

    # ------------------------------------------------------------------ Ctrl-C

    def on_sigint(self, signum: int, frame: object) -> None:
        """Ctrl-C during a measurement interrupts it; otherwise the study stops after the
        trial in hand. Optuna's own bookkeeping is never cut in half: an interrupt in
        the middle of its storage writes can leave a trial it cannot finish."""
        if self.measuring or self.stop_requested:  # a second Ctrl-C: now
            self.stop_requested = True
            raise KeyboardInterrupt
        self.stop_requested = True

    @contextlib.contextmanager
    def sigint_deferred(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers belong to the main thread; leave Ctrl-C as it is
            return
        previous = signal.signal(signal.SIGINT, self.on_sigint)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)


def _fail_running(study: optuna.Study, numbers: list[int]) -> None:
    """Fail this run's trials that an interrupt left RUNNING (outside the objective)."""
    mine = set(numbers)
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if trial.number in mine:
            with contextlib.suppress(Exception):
                study.tell(trial.number, state=TrialState.FAIL)


def outcome_of(trial: FrozenTrial) -> TrialOutcome:
    """``TrialOutcome.from_trial``, except that a FAIL trial never counts: a worker that
    died between writing its outcome and finishing the trial left it measured-looking,
    and the heartbeat check failed it (it runs again as a retry)."""
    outcome = TrialOutcome.from_trial(trial)
    if trial.state == TrialState.FAIL and outcome.counted:
        return dataclasses.replace(outcome, outcome="interrupted", failure="WORKER_DIED")
    return outcome


def _retry_of(trial: optuna.Trial) -> int | None:
    """The number of the dead worker's trial that ``trial`` runs again, if it is a retry."""
    system_attrs = trial.storage.get_trial_system_attrs(trial._trial_id)
    number = system_attrs.get("failed_trial")
    return number if isinstance(number, int) else None


def _write(trial: optuna.Trial, attrs: Mapping[str, Any]) -> None:
    # Each user attribute is its own storage transaction (several ORM queries),
    # so a trial writes a handful: flat ones to filter and sort by in the
    # dashboard, and grouped dictionaries for the rest.
    for name, value in attrs.items():
        if value is not None and value != "" and value != {}:
            trial.set_user_attr(name, value)



def _measurement_attrs(measurement: Measurement) -> dict[str, Any]:
    timing = {
        "spread_ms": measurement.spread_ms,
        "tflops": measurement.tflops,
        "gbps": measurement.gbps,
        "max_abs_error": measurement.max_abs_error,
        "forward_ms": measurement.forward_ms,
    }
    return {
        "measured": measurement.measured,
        "median_ms": measurement.median_ms,
        "timing": {name: value for name, value in timing.items() if value is not None},
        "failure": None if measurement.failure is None else str(measurement.failure),
        "detail": measurement.detail,
    }


def run_search(
    space: StudySpace,
    backend: Backend,
    settings: SearchConfig,
    *,
    storage: BaseStorage | str,
    study_name: str,
    predictions: Mapping[str, Prediction],
    progress: Progress | None = None,
    on_start: Callable[[int, int], None] | None = None,
    worker: int = 0,
    parallel: bool = False,
    enqueue: bool = True,
    compile_ahead: CompileAhead | None = None,
) -> SearchResult:
    """Run (or continue) the study ``study_name`` until ``settings.n_trials`` count.

    ``on_start(done, n_trials)`` is called before the first new trial and
    ``progress(trial)`` after each. Returns every trial of the study. Ctrl-C
    ends it cleanly: the trial in flight is marked FAIL
    (``outcome=interrupted``), finished trials stay in the storage, and the
    result says ``interrupted``.

    Several workers: each calls this on the same storage and study name, with
    its own ``worker`` number (its sampler's seed is ``seed + worker``) and
    ``parallel=True``; ``enqueue=False`` where the study was prepared once with
    ``prepare_study`` (so the workers do not each queue the cost model's top).

    ``compile_ahead``: the plans are compiled a window ahead of the search, and
    each is judged by the compiler before it is measured (``tuner.precompile``);
    without it they were compiled and judged before (or the backend needs none).
    """
    if isinstance(storage, str):
        storage = open_storage(
            storage,
            heartbeat_interval_s=settings.heartbeat_interval_s,
            grace_period_s=settings.grace_period_s,
        )
    with _quiet_optuna():
        study = optuna.create_study(
            storage=storage,
            study_name=study_name,
            direction="minimize",
            sampler=make_sampler(
                settings.sampler,
                settings.seed + worker,
                space,
                parallel=parallel,
                ranked=allowed_plans(space, predictions, settings.traffic_cutoff),
                margin=settings.stop_margin,
            ),
            load_if_exists=True,
        )
        # Trials of a killed run: failed (and queued again) before anything is counted.
        claims.fail_stale(study)
        search = _Search(space, backend, settings, predictions, study, progress, compile_ahead)
        result = _empty_result(search, study_name, storage)
        search.record_rule()
        search.stop_reason = _nothing_left(search)
        if not search.stop_reason:
            if enqueue:
                result.enqueued = search.enqueue_top()
            search.compile_upcoming()
            if on_start is not None:
                on_start(search.counted, settings.n_trials)
            started = time.monotonic()
            if settings.timeout_s is not None:
                search.deadline = started + settings.timeout_s
            try:
                with search.sigint_deferred():
                    study.optimize(
                        search.objective,
                        timeout=settings.timeout_s,
                        catch=(_Unmeasured,),
                        callbacks=[search.after_trial],
                        gc_after_trial=False,
                    )
            except KeyboardInterrupt:
                search.stop_requested = True
                search.stop_reason = f"interrupted ({termination.cause()})"
                _fail_running(study, search.new_trials)
            result.interrupted = search.stop_requested
            if not search.stop_reason and settings.timeout_s is not None:
                elapsed = time.monotonic() - started
                search.stop_reason = f"timeout_s={settings.timeout_s:g} reached ({elapsed:.0f} s)"
        result.trials = [outcome_of(t) for t in study.get_trials(deepcopy=False)]
    result.new_trials = search.new_trials
    result.stop_reason = search.stop_reason
    result.stopped_by_rule = search.stopped_by_rule
    return result


def prepare_study(
    space: StudySpace,
    settings: SearchConfig,
    *,
    storage: BaseStorage,
    study_name: str,
    predictions: Mapping[str, Prediction],
) -> tuple[SearchResult, int]:
    """Create (or load) the study and queue the cost model's top once, before workers start.

    Returns the result so far (no trials yet; ``stop_reason`` set when there is
    nothing left to do) and the trials that count already.
    """
    with _quiet_optuna():
        study = optuna.create_study(
            storage=storage, study_name=study_name, direction="minimize", load_if_exists=True
        )
        claims.fail_stale(study)
        search = _Search(space, _NoBackend(), settings, predictions, study, None)
        result = _empty_result(search, study_name, storage)
        search.record_rule()
        result.stop_reason = _nothing_left(search)
        result.stopped_by_rule = search.stopped_by_rule
        if not result.stop_reason:
            result.enqueued = search.enqueue_top()
        return result, search.counted


def _empty_result(search: _Search, study_name: str, storage: BaseStorage) -> SearchResult:
    return SearchResult(
        study_name=study_name,
        storage_url=storage_url(storage),
        trials=[],
        over_cutoff=len(search.space.feasible) - len(search.allowed),
    )


def _nothing_left(search: _Search) -> str:
    """Why a study has nothing to do before it starts; "" when it has.

    A study the stopping rule ended stays ended under the same rule settings
    (whatever ``n_trials`` says: the cap did not end it); other settings judge
    the study afresh, and may end it at once.
    """
    if search.remaining() <= 0:
        return f"n_trials={search.settings.n_trials} already reached"
    if not search.unevaluated():
        return "every candidate within the traffic cutoff is evaluated"
    stopped = search.recorded_stop()
    if stopped is not None:
        search.stopped_by_rule = stopped
        return (
            f"the stopping rule ended this study earlier, {stopped.get('reason')}; other "
            "search.stop, stop_margin, stop_probability or min_trials settings go on"
        )
    verdict = search.verdict()
    if verdict is not None and verdict.stop:
        return search.record_stop(verdict, None)
    return ""


def study_trials(storage: BaseStorage, study_name: str) -> list[TrialOutcome]:
    """Every trial of the study, as values (what the workers left in the storage)."""
    with _quiet_optuna():
        study = optuna.load_study(study_name=study_name, storage=storage)
        return [outcome_of(t) for t in study.get_trials(deepcopy=False)]


class _NoBackend(Backend):
    name = "none"

    def measure(self, plan: KernelPlan, problem: Problem) -> Measurement:
        raise AssertionError("prepare_study measures nothing")
