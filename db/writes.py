"""The registry's one write: store a plan and keep the best pointer right.

Runs inside a write session from ``storage.session_scope`` (``BEGIN IMMEDIATE``
on SQLite); nothing here commits.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import TypeVar

from sqlalchemy import bindparam, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from db import ranking
from db.models import BestPlanRow, EnvironmentRow, PlanRow, ProblemRow
from db.reads import record_of
from db.records import PlanRecord, RecordOutcome, RecordStatus
from tuner.environment import Environment
from tuner.problem import Problem

_Row = TypeVar("_Row", EnvironmentRow, ProblemRow, BestPlanRow)


def _plan_row(
    record: PlanRecord, problem_id: int, environment_id: int, created_at: datetime
) -> PlanRow:
    return PlanRow(
        problem_id=problem_id,
        environment_id=environment_id,
        family=record.family,
        # Sorted keys: equal parameter sets are equal text, whatever the insertion order.
        params=json.dumps(record.params, sort_keys=True),
        source_hash=record.source_hash,
        measured=record.measured,
        median_ms=record.median_ms,
        spread_ms=record.spread_ms,
        tflops=record.tflops,
        gbps=record.gbps,
        max_abs_error=record.max_abs_error,
        predicted_ms=record.predicted_ms,
        predicted_read_bytes=record.predicted_read_bytes,
        predicted_write_bytes=record.predicted_write_bytes,
        study_name=record.study_name,
        trial_number=record.trial_number,
        created_at=created_at,
    )


def _get_or_insert(
    session: Session, find: Callable[[], _Row | None], make: Callable[[], _Row]
) -> tuple[_Row, bool]:
    """The row ``find`` returns, or a new one from ``make``; (row, created).

    On SQLite the write lock (BEGIN IMMEDIATE) already excludes other writers.
    On servers two writers may insert the same key at once; the loser's
    savepoint rolls back and it reads the winner's row.
    """
    existing = find()
    if existing is not None:
        return existing, False
    row = make()
    try:
        with session.begin_nested():
            session.add(row)
    except IntegrityError:
        winner = find()
        if winner is None:
            raise
        return winner, False
    return row, True


def environment_row(session: Session, environment: Environment) -> EnvironmentRow:
    row, _ = _get_or_insert(
        session,
        lambda: EnvironmentRow.find(session, environment),
        lambda: EnvironmentRow.from_environment(environment),
    )
    return row


def problem_row(session: Session, problem: Problem) -> ProblemRow:
    row, _ = _get_or_insert(
        session,
        lambda: ProblemRow.find(session, problem),
        lambda: ProblemRow.from_problem(problem),
    )
    return row


def resolve_ids(session: Session, problem: Problem, environment: Environment) -> tuple[int, int]:
    """(problem id, environment id), inserting either row when new."""
    return problem_row(session, problem).id, environment_row(session, environment).id


def record_plan(
    session: Session,
    problem: Problem,
    environment: Environment,
    record: PlanRecord,
    created_at: datetime,
    source_hashes: Mapping[str, str] | None,
) -> RecordOutcome:
    """Store ``record``, unless it is a trial's result stored already.

    A rerun of a finished study stores its best again: the same study, trial and
    evidence. That is one result, not a second one: no history row is added.
    """
    problem_id, environment_id = resolve_ids(session, problem, environment)
    existing = same_result(session, problem_id, environment_id, record)
    if existing is not None:
        pointer = session.get(BestPlanRow, (problem_id, environment_id))
        best = pointer.plan_id if pointer is not None else existing
        return RecordOutcome(RecordStatus.ALREADY_STORED, existing, best)
    return record_plan_at(session, problem_id, environment_id, record, created_at, source_hashes)


_SAME_TRIAL = select(PlanRow).where(
    PlanRow.problem_id == bindparam("problem_id"),
    PlanRow.environment_id == bindparam("environment_id"),
    PlanRow.study_name == bindparam("study_name"),
    PlanRow.trial_number == bindparam("trial_number"),
)


def same_result(
    session: Session, problem_id: int, environment_id: int, record: PlanRecord
) -> int | None:
    """The id of a stored plan that is ``record`` from the same study trial, if any.

    Only a record that names its study and trial can be recognised: two plans
    without them may be two measurements that happen to agree.
    """
    if record.study_name is None or record.trial_number is None:
        return None
    rows = session.scalars(
        _SAME_TRIAL,
        {
            "problem_id": problem_id,
            "environment_id": environment_id,
            "study_name": record.study_name,
            "trial_number": record.trial_number,
        },
    )
    return next((row.id for row in rows if record_of(row) == record), None)


def record_plan_at(
    session: Session,
    problem_id: int,
    environment_id: int,
    record: PlanRecord,
    created_at: datetime,
    source_hashes: Mapping[str, str] | None,
) -> RecordOutcome:
    """Store ``record`` as history and move the best pointer if it is better.

    The comparison reads the pointer inside the caller's write transaction
    (locked on servers by FOR UPDATE), so a concurrent writer cannot slip a
    better plan in between the read and the update.
    """
    plan = _plan_row(record, problem_id, environment_id, created_at)
    session.add(plan)
    session.flush()

    def find_pointer() -> BestPlanRow | None:
        return session.get(BestPlanRow, (problem_id, environment_id), with_for_update=True)

    pointer, created = _get_or_insert(
        session,
        find_pointer,
        lambda: BestPlanRow(problem_id=problem_id, environment_id=environment_id, plan_id=plan.id),
    )
    if created:
        return RecordOutcome(RecordStatus.STORED_NEW_BEST, plan.id, plan.id)
    incumbent = session.get_one(PlanRow, pointer.plan_id)
    if ranking.beats(record, record_of(incumbent), source_hashes):
        pointer.plan_id = plan.id
        session.flush()
        return RecordOutcome(RecordStatus.REPLACED_BEST, plan.id, plan.id)
    return RecordOutcome(RecordStatus.KEPT_PREVIOUS_BEST, plan.id, incumbent.id)


# Candidates for "already stored": same problem, environment, family, source and time.
_SAME_PLAN = select(PlanRow).where(
    PlanRow.problem_id == bindparam("problem_id"),
    PlanRow.environment_id == bindparam("environment_id"),
    PlanRow.family == bindparam("family"),
    PlanRow.source_hash == bindparam("source_hash"),
    PlanRow.created_at == bindparam("created_at"),
)


def is_duplicate(
    session: Session,
    problem_id: int,
    environment_id: int,
    record: PlanRecord,
    created_at: datetime,
) -> bool:
    """Whether a plan equal in every field is stored already (for idempotent import)."""
    candidates = session.scalars(
        _SAME_PLAN,
        {
            "problem_id": problem_id,
            "environment_id": environment_id,
            "family": record.family,
            "source_hash": record.source_hash,
            "created_at": created_at,
        },
    )
    return any(record_of(row) == record for row in candidates)


def disable_plan(
    session: Session, plan_id: int, reason: str, source_hashes: Mapping[str, str] | None
) -> int | None:
    """Take plan ``plan_id`` out of service with ``reason``; returns the plan now served for
    its problem x environment (None when every plan of it is disabled).

    The plan stays in the history. If it was the best pointer's, the pointer moves to the
    best plan left by the registry's rule (``db.ranking``; a tie keeps the older), or goes
    when none is left, so ``best()`` never serves a disabled plan.
    """
    if not reason:
        raise ValueError("a disabled plan needs a reason")
    row = session.get(PlanRow, plan_id)
    if row is None:
        raise LookupError(f"no plan #{plan_id} in the registry")
    row.disabled_reason = reason
    session.flush()
    key = (row.problem_id, row.environment_id)
    pointer = session.get(BestPlanRow, key, with_for_update=True)
    if pointer is None or pointer.plan_id != plan_id:
        return None if pointer is None else pointer.plan_id
    left = session.scalars(
        select(PlanRow).where(
            PlanRow.problem_id == row.problem_id,
            PlanRow.environment_id == row.environment_id,
            PlanRow.disabled_reason == "",
        )
    ).all()
    if not left:
        session.delete(pointer)
        session.flush()
        return None
    best = max(left, key=lambda r: (ranking.plan_rank(record_of(r), source_hashes), -r.id))
    pointer.plan_id = best.id
    session.flush()
    return best.id
