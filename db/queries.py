"""The registry's SQL: lookups and the record-and-keep-the-best write, on a given session.

Every function here runs inside a session opened by ``storage.session_scope``;
none commits. The registry (``db.registry``) decides which session and what to
serve; this module only talks to the tables.
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


def to_record(row: PlanRow) -> PlanRecord:
    return PlanRecord(
        family=row.family,
        params=json.loads(row.params_json),
        source_hash=row.source_hash,
        measured=row.measured,
        median_ms=row.median_ms,
        spread_ms=row.spread_ms,
        tflops=row.tflops,
        gbps=row.gbps,
        max_abs_error=row.max_abs_error,
        predicted_ms=row.predicted_ms,
        predicted_read_bytes=row.predicted_read_bytes,
        predicted_write_bytes=row.predicted_write_bytes,
        study_name=row.study_name,
        trial_number=row.trial_number,
    )


def to_stored(
    triple: PlanTriple,
    *,
    fallback: bool = False,
    source_hashes: Mapping[str, str] | None = None,
) -> StoredPlan:
    plan, problem, environment = triple
    record = to_record(plan)
    return StoredPlan(
        plan_id=plan.id,
        record=record,
        problem=problem.to_problem(),
        environment=environment.to_environment(),
        created_at=plan.created_at,
        fallback=fallback,
        stale=ranking.is_stale(record, source_hashes),
    )


def _plan_row(
    record: PlanRecord, problem_id: int, environment_id: int, created_at: datetime
) -> PlanRow:
    return PlanRow(
        problem_id=problem_id,
        environment_id=environment_id,
        family=record.family,
        # Sorted keys: equal parameter sets are equal text, whatever the insertion order.
        params_json=json.dumps(record.params, sort_keys=True),
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
    if ranking.beats(record, to_record(incumbent), source_hashes):
        pointer.plan_id = plan.id
        session.flush()
        return RecordOutcome(RecordStatus.REPLACED_BEST, plan.id, plan.id)
    return RecordOutcome(RecordStatus.KEPT_PREVIOUS_BEST, plan.id, incumbent.id)


def find_duplicate(
    session: Session,
    problem: Problem,
    environment: Environment,
    record: PlanRecord,
    created_at: datetime,
) -> PlanRow | None:
    """A stored plan equal in every field to the one given (for idempotent import)."""
    stmt = (
        select(PlanRow)
        .join(ProblemRow, ProblemRow.id == PlanRow.problem_id)
        .join(EnvironmentRow, EnvironmentRow.id == PlanRow.environment_id)
        .where(*ProblemRow.identity(problem), *EnvironmentRow.identity(environment))
        .where(
            PlanRow.family == record.family,
            PlanRow.source_hash == record.source_hash,
            PlanRow.created_at == created_at,
        )
    )
    for row in session.scalars(stmt):
        if to_record(row) == record:
            return row
    return None


def _triples() -> Select[Any]:
    return (
        select(PlanRow, ProblemRow, EnvironmentRow)
        .join(ProblemRow, ProblemRow.id == PlanRow.problem_id)
        .join(EnvironmentRow, EnvironmentRow.id == PlanRow.environment_id)
    )


def best_triples(
    session: Session,
    problem_terms: Sequence[ColumnElement[bool]],
    environment: Environment | None,
) -> list[PlanTriple]:
    """The best-pointer plans of the problems matching ``problem_terms``."""
    stmt = _triples().join(BestPlanRow, BestPlanRow.plan_id == PlanRow.id).where(*problem_terms)
    if environment is not None:
        stmt = stmt.where(*EnvironmentRow.identity(environment))
    return [(p, q, e) for p, q, e in session.execute(stmt)]


def fastest_current_measured(
    session: Session, stale: PlanRow, source_hashes: Mapping[str, str]
) -> PlanRow | None:
    """The fastest measured plan of ``stale``'s problem x environment whose source is current."""
    current = or_(
        PlanRow.family.not_in(list(source_hashes)),
        *(
            and_(PlanRow.family == family, PlanRow.source_hash == digest)
            for family, digest in source_hashes.items()
        ),
    )
    stmt = (
        select(PlanRow)
        .where(
            PlanRow.problem_id == stale.problem_id,
            PlanRow.environment_id == stale.environment_id,
            PlanRow.measured.is_(True),
            current,
        )
        .order_by(PlanRow.median_ms, PlanRow.id)
        .limit(1)
    )
    return session.scalars(stmt).first()


def history_triples(
    session: Session,
    problem: Problem | None,
    environment: Environment | None,
    limit: int | None,
) -> list[PlanTriple]:
    """Recorded plans, newest first."""
    stmt = _triples()
    if problem is not None:
        stmt = stmt.where(*ProblemRow.identity(problem))
    if environment is not None:
        stmt = stmt.where(*EnvironmentRow.identity(environment))
    stmt = stmt.order_by(PlanRow.created_at.desc(), PlanRow.id.desc())
    if limit is not None:
        stmt = stmt.limit(limit)
    return [(p, q, e) for p, q, e in session.execute(stmt)]


def all_triples(session: Session) -> list[tuple[PlanTriple, bool]]:
    """Every plan, oldest first, with whether it is a best pointer."""
    stmt = (
        _triples()
        .add_columns(BestPlanRow.plan_id.is_not(None))
        .outerjoin(BestPlanRow, BestPlanRow.plan_id == PlanRow.id)
        .order_by(PlanRow.id)
    )
    return [((p, q, e), bool(is_best)) for p, q, e, is_best in session.execute(stmt)]


def list_best_triples(session: Session) -> list[PlanTriple]:
    stmt = (
        _triples()
        .join(BestPlanRow, BestPlanRow.plan_id == PlanRow.id)
        .order_by(
            ProblemRow.head_dim,
            ProblemRow.dtype,
            ProblemRow.causal,
            ProblemRow.seq_len,
            ProblemRow.batch,
            ProblemRow.heads,
            EnvironmentRow.id,
        )
    )
    return [(p, q, e) for p, q, e in session.execute(stmt)]
