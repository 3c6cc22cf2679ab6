"""What callers hand the registry and what it hands back: plain frozen values."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

from tuner.environment import Environment
from tuner.problem import Problem


@dataclass(frozen=True)
class PlanRecord:
    """One plan and its evidence, as recorded.

    ``measured`` is True only for a real GPU timing; then ``median_ms`` is
    required. A predicted plan (cost model) needs ``median_ms`` or
    ``predicted_ms``; it is ranked by ``median_ms`` when given, else by
    ``predicted_ms`` (see ``ranking_ms``).
    """

    family: str
    params: dict[str, int]
    source_hash: str
    measured: bool
    median_ms: float | None = None
    spread_ms: float | None = None
    tflops: float | None = None
    gbps: float | None = None
    max_abs_error: float | None = None
    predicted_ms: float | None = None
    predicted_read_bytes: int | None = None
    predicted_write_bytes: int | None = None
    study_name: str | None = None
    trial_number: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.family, str) or not self.family:
            raise ValueError("plan family must be a non-empty string")
        if not isinstance(self.source_hash, str):
            raise ValueError("source_hash must be a string")
        if not isinstance(self.measured, bool):
            raise ValueError("measured must be a bool")
        if not isinstance(self.params, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
            for k, v in self.params.items()
        ):
            raise ValueError(f"params must map names to ints, got {self.params!r}")
        # A private copy: the record is frozen, its params must not change under it.
        object.__setattr__(self, "params", dict(self.params))
        for name in ("predicted_read_bytes", "predicted_write_bytes", "trial_number"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{name} must be an int, got {value!r}")
        for name in ("predicted_read_bytes", "predicted_write_bytes"):
            value = getattr(self, name)
            # The planner's figures are saturating u64: anything outside is a bug upstream.
            if value is not None and not 0 <= value < 1 << 64:
                raise ValueError(f"{name} must fit an unsigned 64-bit integer, got {value}")
        if self.measured and self.median_ms is None:
            raise ValueError("a measured plan needs median_ms")
        if self.median_ms is None and self.predicted_ms is None:
            raise ValueError("a plan needs median_ms or predicted_ms to be ranked")
        if not math.isfinite(self.ranking_ms):
            raise ValueError(f"plan time must be finite, got {self.ranking_ms}")

    @property
    def ranking_ms(self) -> float:
        """The time plans are compared by."""
        value = self.median_ms if self.median_ms is not None else self.predicted_ms
        assert value is not None  # guaranteed by __post_init__
        return value

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"params": dict(self.params)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PlanRecord:
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown plan fields: {sorted(unknown)}")
        return cls(**data)


@dataclass(frozen=True)
class StoredPlan:
    """A plan as read back from the registry.

    ``fallback``: served for a different (nearest) shape than the one asked.
    ``stale``: measured, but under a kernel source whose hash no longer matches
    the caller's; its timing says nothing about today's kernel, so it is not
    served as measured. ``disabled_reason``: set by ``python -m db verify``; a
    disabled plan is history only, never served (``best`` skips it).
    """

    plan_id: int
    record: PlanRecord
    problem: Problem
    environment: Environment
    created_at: datetime
    fallback: bool = False
    stale: bool = False
    #: why ``python -m db verify`` took it out of service; "" while it is served
    disabled_reason: str = ""

    @property
    def served_as_measured(self) -> bool:
        return self.record.measured and not self.stale


class RecordStatus(enum.StrEnum):
    STORED_NEW_BEST = "stored-new-best"  # first plan of its problem x environment
    REPLACED_BEST = "replaced-previous-best"
    KEPT_PREVIOUS_BEST = "kept-previous-best"  # stored as history only
    ALREADY_STORED = "already-stored"  # the same trial's result is there: nothing written


@dataclass(frozen=True, slots=True)
class RecordOutcome:
    status: RecordStatus
    plan_id: int  # the row just written (ALREADY_STORED: the row that was there)
    best_plan_id: int  # the best of its problem x environment after the write

    @property
    def is_best(self) -> bool:
        return self.plan_id == self.best_plan_id


@dataclass(frozen=True, slots=True)
class ImportSummary:
    added: int
    skipped: int  # already present (import is idempotent)
    outcomes: tuple[RecordOutcome, ...] = field(default=(), repr=False)
