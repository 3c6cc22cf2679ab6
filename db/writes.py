"""The registry's one write: store a plan and keep the best pointer right.

Runs inside a write session from ``storage.session_scope`` (``BEGIN IMMEDIATE``
on SQLite); nothing here commits.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import ColumnElement, Select, and_, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from db import ranking
from db.models import BestPlanRow, EnvironmentRow, PlanRow, ProblemRow
from db.records import PlanRecord, RecordOutcome, RecordStatus, StoredPlan
from tuner.environment import Environment
from tuner.problem import Problem

PlanTriple = tuple[PlanRow, ProblemRow, EnvironmentRow]
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


def record_plan(
    session: Session,
    problem: Problem,
    environment: Environment,
    record: PlanRecord,
    created_at: datetime,
    source_hashes: Mapping[str, str] | None,
) -> RecordOutcome:
    """Store ``record`` as history and move the best pointer if it is better.

    The comparison reads the pointer inside the caller's write transaction
    (locked on servers by FOR UPDATE), so a concurrent writer cannot slip a
    better plan in between the read and the update.
    """
    problem_id = problem_row(session, problem).id
    environment_id = environment_row(session, environment).id
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
