"""The trials of a study as plain values: what the report, the plots and the registry read.

Built from Optuna's ``FrozenTrial`` and the user attributes ``tuner.search``
writes (see its module doc for their meaning), so a study from an earlier run
reads back the same as this run's trials.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from optuna.trial import FrozenTrial

COUNTED_OUTCOMES = ("measured", "failed")


@dataclass(frozen=True, slots=True)
class TrialOutcome:
    """One trial of the study, as the report, the plots and the registry need it."""

    number: int
    state: str
    outcome: str
    key: str
    params: dict[str, Any]
    predicted_ms: float | None = None
    predicted_read_bytes: int | None = None
    predicted_write_bytes: int | None = None
    measured: bool = False
    median_ms: float | None = None
    spread_ms: float | None = None
    tflops: float | None = None
    gbps: float | None = None
    max_abs_error: float | None = None
    #: backward trials: the median time of the forward they ran on
    forward_ms: float | None = None
    failure: str | None = None
    detail: str = ""
    duplicate_of: int | None = None

    @property
    def counted(self) -> bool:
        return self.outcome in COUNTED_OUTCOMES

    @property
    def timed(self) -> bool:
        """Evaluated by the backend with a time (measured or predicted)."""
        return self.outcome == "measured" and self.median_ms is not None

    @classmethod
    def from_trial(cls, trial: FrozenTrial) -> TrialOutcome:
        attrs = trial.user_attrs
        predicted = attrs.get("predicted", {})
        timing = attrs.get("timing", {})
        # A trial still RUNNING has not counted yet, whatever it wrote: its worker may
        # have been killed between writing its outcome and finishing it (the heartbeat
        # check then fails it, and it runs again).
        if trial.state.is_finished():
            outcome = str(attrs.get("outcome", "interrupted"))
        else:
            outcome = "running"
        return cls(
            number=trial.number,
            state=trial.state.name,
            outcome=outcome,
            key=str(attrs.get("plan_key", "")),
            params=dict(attrs.get("params", {})),
            predicted_ms=predicted.get("ms"),
            predicted_read_bytes=predicted.get("read_bytes"),
            predicted_write_bytes=predicted.get("write_bytes"),
            measured=bool(attrs.get("measured", False)),
            median_ms=attrs.get("median_ms"),
            spread_ms=timing.get("spread_ms"),
            tflops=timing.get("tflops"),
            gbps=timing.get("gbps"),
            max_abs_error=timing.get("max_abs_error"),
            forward_ms=timing.get("forward_ms"),
            failure=attrs.get("failure"),
            detail=str(attrs.get("detail", "")),
            duplicate_of=attrs.get("duplicate_of"),
        )


@dataclass
class SearchResult:
    study_name: str
    storage_url: str
    #: every trial of the study (earlier runs included), by number
    trials: list[TrialOutcome]
    #: trial numbers run by this call
    new_trials: list[int] = field(default_factory=list)
    stop_reason: str = ""
    interrupted: bool = False
    #: feasible candidates never measured because of the traffic cutoff
    over_cutoff: int = 0
    enqueued: list[str] = field(default_factory=list)
    #: the stopping rule's record (``tuner.search.STOPPED_ATTR``) where it ended the search
    stopped_by_rule: dict[str, Any] | None = None

    @property
    def new_measurements(self) -> int:
        numbers = set(self.new_trials)
        return sum(1 for t in self.trials if t.number in numbers and t.counted)

    @property
    def counted(self) -> int:
        return sum(1 for t in self.trials if t.counted)

    def ranked(self) -> list[TrialOutcome]:
        """Distinct candidates with a time, fastest first (first trial of each plan)."""
        seen: dict[str, TrialOutcome] = {}
        for trial in self.trials:
            if trial.timed and trial.key not in seen:
                seen[trial.key] = trial
        return sorted(seen.values(), key=lambda t: (t.median_ms, t.number))

    @property
    def best(self) -> TrialOutcome | None:
        ranked = self.ranked()
        return ranked[0] if ranked else None
