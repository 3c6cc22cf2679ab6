"""The registry's read queries, as plain SQL over the model tables.

Why text and not ORM selects: a deployment opens the registry once and asks
for one plan, and SQLAlchemy compiles each statement afresh for every new
engine. The ORM form of the three-table best lookup took 3-6 ms to compile on
the benchmark machine, more than the whole cold-open budget (5 ms); the same
query as text compiles in well under a millisecond. The select list and the
result types come from the model tables, so a schema change still has one
source of truth (and the tests exercise every query).

Every function runs on a connection from ``storage.read_scope``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

from sqlalchemy import Boolean, Connection, Row, TextClause, TypeDecorator, text

from db import ranking
from db.models import EnvironmentRow, PlanRow, ProblemRow
from db.records import PlanRecord, StoredPlan
from tuner.environment import Environment
from tuner.problem import Problem

_PLAN = PlanRow.__table__
_PROBLEM = ProblemRow.__table__
_ENVIRONMENT = EnvironmentRow.__table__
_PARTS = (("p", _PLAN), ("q", _PROBLEM), ("e", _ENVIRONMENT))
_NAMES = {alias: [column.name for column in table.columns] for alias, table in _PARTS}
_SELECT_LIST = ", ".join(f"{a}.{name} AS {a}_{name}" for a, _ in _PARTS for name in _NAMES[a])
# Only columns whose Python value differs from what the driver returns need a
# result type (booleans, and the models' own decorated types: UTC timestamps,
# u64); typing all 33 columns doubled the cost of a process's first lookup.
_RESULT_TYPES = {
    f"{a}_{c.name}": c.type
    for a, table in _PARTS
    for c in table.columns
    if isinstance(c.type, Boolean | TypeDecorator)
}
_FROM = (
    "plans AS p JOIN problems AS q ON q.id = p.problem_id"
    " JOIN environments AS e ON e.id = p.environment_id"
)
_RECORD_FIELDS = [f.name for f in fields(PlanRecord)]
_ENVIRONMENT_FIELDS = [f.name for f in fields(Environment)]

#: what a plan may stand in for another shape only if it shares: the variants included, so a
#: windowed problem is never served a dense plan (nor one of another window) or the reverse
SHAPE_FAMILY_TERMS = (
    "q.head_dim = :head_dim",
    "q.dtype = :dtype",
    "q.precision = :precision",
    "q.direction = :direction",
    "q.causal = :causal",
    "q.heads = q.kv_heads * :group",
    "q.window_left = :window_left",
    "q.window_right = :window_right",
    "q.softcap = :softcap",
    "q.alibi = :alibi",
    "q.sinks = :sinks",
    "q.page_size = :page_size",
)
EXACT_SHAPE_TERMS = (
    *SHAPE_FAMILY_TERMS,
    "q.seq_len = :seq_len",
    "q.batch = :batch",
    "q.heads = :heads",
    "q.kv_heads = :kv_heads",
    "q.kv_len = :kv_len",
    "q.lengths = :lengths",
)


@dataclass(frozen=True, slots=True)
class FoundPlan:
    """A plan row with its problem and environment, as read."""

    plan_id: int
    problem_id: int
    environment_id: int
    record: PlanRecord
    problem: Problem
    environment: Environment
    created_at: datetime
    disabled_reason: str = ""

    def stored(
        self, *, fallback: bool = False, source_hashes: Mapping[str, str] | None = None
    ) -> StoredPlan:
        return StoredPlan(
            plan_id=self.plan_id,
            record=self.record,
            problem=self.problem,
            environment=self.environment,
            created_at=self.created_at,
            fallback=fallback,
            stale=ranking.is_stale(self.record, source_hashes),
            disabled_reason=self.disabled_reason,
        )


def record_from_values(values: Mapping[str, Any]) -> PlanRecord:
    """A ``PlanRecord`` from plan column values (a row mapping or ``vars`` of a row)."""
    fields_ = {name: values[name] for name in _RECORD_FIELDS}
    fields_["params"] = json.loads(values["params"])
    return PlanRecord(**fields_)


def record_of(row: PlanRow) -> PlanRecord:
    return record_from_values({name: getattr(row, name) for name in _RECORD_FIELDS})


def _found(row: Row[Any]) -> FoundPlan:
    values = row._mapping
    plan = {name: values[f"p_{name}"] for name in _NAMES["p"]}
    return FoundPlan(
        plan_id=plan["id"],
        problem_id=plan["problem_id"],
        environment_id=plan["environment_id"],
        record=record_from_values(plan),
        problem=Problem(**{name: values[f"q_{name}"] for name in _NAMES["q"] if name != "id"}),
        environment=Environment(**{name: values[f"e_{name}"] for name in _ENVIRONMENT_FIELDS}),
        created_at=plan["created_at"],
        disabled_reason=plan["disabled_reason"],
    )


@functools.cache
def _statement(
    where: tuple[str, ...], join_best: str = "", order_by: str = "", limited: bool = False
) -> TextClause:
    """A read over plans x problems x environments; memoised, so built once per shape of query."""
    sql = f"SELECT {_SELECT_LIST}"
    if join_best == "left":
        sql += ", b.plan_id IS NOT NULL AS is_best"
    sql += f" FROM {_FROM}"
    # Joining on the pointer's key (problem, environment) lets SQLite reach it
    # through the primary key instead of scanning every pointer for plan_id.
    on_pointer = "b.problem_id = q.id AND b.environment_id = e.id AND b.plan_id = p.id"
    if join_best == "inner":
        sql += f" JOIN best_plans AS b ON {on_pointer}"
    elif join_best == "left":
        sql += f" LEFT JOIN best_plans AS b ON {on_pointer}"
    if where:
        sql += " WHERE " + " AND ".join(where)
    if order_by:
        sql += f" ORDER BY {order_by}"
    if limited:
        sql += " LIMIT :limit"
    return text(sql).columns(**_RESULT_TYPES)


def _problem_params(problem: Problem, *, exact: bool = True) -> dict[str, Any]:
    params: dict[str, Any] = {
        "head_dim": problem.head_dim,
        "dtype": problem.dtype,
        "precision": problem.precision,
        "direction": problem.direction,
        "causal": problem.causal,
        "group": problem.group,
        "window_left": problem.window_left,
        "window_right": problem.window_right,
        "softcap": problem.softcap,
        "alibi": problem.alibi,
        "sinks": problem.sinks,
        "page_size": problem.page_size or 0,
    }
    if exact:
        params |= {
            "seq_len": problem.seq_len,
            "batch": problem.batch,
            "heads": problem.heads,
            "kv_heads": problem.kv_heads,
            "kv_len": problem.kv_len,
            "lengths": problem.lengths,
        }
    return params


#: an environment to match: all of it, or only some of its fields (``{"gpu_name": ...}``,
#: or as hashable ``(field, value)`` pairs, which the LRU of ``cached_best`` can key on)
EnvironmentMatch = Environment | Mapping[str, Any] | tuple[tuple[str, Any], ...]


def _environment_filter(environment: EnvironmentMatch) -> tuple[tuple[str, ...], dict[str, Any]]:
    """The WHERE terms and parameters matching ``environment`` (a partial one on its fields)."""
    values = environment.as_dict() if isinstance(environment, Environment) else dict(environment)
    unknown = set(values) - set(_ENVIRONMENT_FIELDS)
    if unknown:
        raise ValueError(f"unknown environment fields: {sorted(unknown)}")
    names = [name for name in _ENVIRONMENT_FIELDS if name in values]
    terms = tuple(f"e.{name} = :env_{name}" for name in names)
    return terms, {f"env_{name}": values[name] for name in names}


def best_pointers(
    connection: Connection, problem: Problem, environment: EnvironmentMatch | None, *, exact: bool
) -> list[FoundPlan]:
    """The best-pointer plans of ``problem`` (exact) or of its shape family (same
    head_dim, dtype, precision, direction, causal, group and variants), in the environment(s)
    ``environment`` matches or in any."""
    where = EXACT_SHAPE_TERMS if exact else SHAPE_FAMILY_TERMS
    params = _problem_params(problem, exact=exact)
    if environment is not None:
        terms, values = _environment_filter(environment)
        where = (*where, *terms)
        params |= values
    rows = connection.execute(_statement(where, join_best="inner"), params)
    return [_found(row) for row in rows]


def fastest_current_measured(
    connection: Connection, stale: FoundPlan, source_hashes: Mapping[str, str]
) -> FoundPlan | None:
    """The fastest measured plan of ``stale``'s problem x environment whose source is current."""
    families = sorted(source_hashes)
    params: dict[str, Any] = {
        "problem_id": stale.problem_id,
        "environment_id": stale.environment_id,
        "measured": True,
    }
    # A family the caller gave no hash for counts as current (see db.ranking).
    current = [f"p.family NOT IN ({', '.join(f':family_{i}' for i in range(len(families)))})"]
    for index, family in enumerate(families):
        params |= {f"family_{index}": family, f"hash_{index}": source_hashes[family]}
        current.append(f"(p.family = :family_{index} AND p.source_hash = :hash_{index})")
    where = (
        "p.problem_id = :problem_id",
        "p.environment_id = :environment_id",
        "p.measured = :measured",
        "p.disabled_reason = ''",
        "(" + " OR ".join(current) + ")",
    )
    stmt = _statement(where, order_by="p.median_ms, p.id", limited=True)
    row = connection.execute(stmt, params | {"limit": 1}).first()
    return _found(row) if row is not None else None


def history(
    connection: Connection,
    problem: Problem | None,
    environment: EnvironmentMatch | None,
    limit: int | None,
) -> list[FoundPlan]:
    """Recorded plans, newest first."""
    where: tuple[str, ...] = ()
    params: dict[str, Any] = {}
    if problem is not None:
        where += EXACT_SHAPE_TERMS
        params |= _problem_params(problem)
    if environment is not None:
        terms, values = _environment_filter(environment)
        where += terms
        params |= values
    if limit is not None:
        params["limit"] = limit
    stmt = _statement(where, order_by="p.created_at DESC, p.id DESC", limited=limit is not None)
    return [_found(row) for row in connection.execute(stmt, params)]


def served_plans(connection: Connection, problem_id: int, environment_id: int) -> list[FoundPlan]:
    """The plans of one problem x environment that are not disabled, oldest first."""
    where = (
        "p.problem_id = :problem_id",
        "p.environment_id = :environment_id",
        "p.disabled_reason = ''",
    )
    params = {"problem_id": problem_id, "environment_id": environment_id}
    return [_found(row) for row in connection.execute(_statement(where, order_by="p.id"), params)]


def every_plan(connection: Connection) -> list[tuple[FoundPlan, bool]]:
    """Every plan, oldest first, with whether it is a best pointer."""
    rows = connection.execute(_statement((), join_best="left", order_by="p.id"))
    return [(_found(row), bool(row._mapping["is_best"])) for row in rows]


def every_best(connection: Connection) -> list[FoundPlan]:
    order = (
        "q.head_dim, q.dtype, q.precision, q.direction, q.causal, q.seq_len, q.batch, q.heads,"
        " q.kv_heads, q.kv_len, q.window_left, q.window_right, q.softcap, q.alibi, q.sinks,"
        " q.page_size, q.lengths, e.id"
    )
    return [_found(row) for row in connection.execute(_statement((), "inner", order))]
