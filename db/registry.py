"""The plan registry: record tuned plans, serve the best one per problem x environment.

    with PlanRegistry.open("sqlite:///db/plans.sqlite") as registry:
        registry.record(problem, environment, plan)            # a tuning run

    registry = PlanRegistry.open(url, readonly=True)             # a deployment
    stored = registry.cached_best(problem, environment, nearest=True,
                                  source_hashes={"tiled": tiled_hash})

Rules (``db.ranking`` has them in full): measured beats predicted, a stale
measured plan (kernel source changed) is never served as measured, then the
lower time wins. ``best`` looks for the exact problem first and, with
``nearest=True``, falls back to the nearest tuned shape of the same head_dim,
dtype and causality, preferring shapes with a current measured plan.

Schema policy (``db.schema``): a writer creates an empty database; a database
at an older revision is refused until ``python -m db upgrade --url URL`` is run;
one at an unknown (newer) revision is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import TypeVar

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from db import queries, ranking, schema, storage, transfer
from db.cache import BestPlanCache
from db.models import ProblemRow
from db.records import ImportSummary, PlanRecord, RecordOutcome, StoredPlan
from tuner.environment import Environment
from tuner.errors import RegistryError
from tuner.problem import Problem

_T = TypeVar("_T")
DEFAULT_HISTORY_LIMIT = 100


class PlanRegistry:
    """A handle on one registry database. Open with ``PlanRegistry.open``."""

    def __init__(self, engine: Engine, label: str, *, readonly: bool) -> None:
        self._engine: Engine | None = engine
        self._label = label
        self._readonly = readonly
        self._cache = BestPlanCache(self.best)

    @classmethod
    def open(cls, url: str = storage.DEFAULT_URL, readonly: bool = False) -> PlanRegistry:
        """Open (a writer creates when missing) and check the schema revision."""
        parsed = storage.parse_url(url)
        label = storage.describe(parsed)
        engine = storage.create_registry_engine(parsed, readonly=readonly)
        try:
            schema.verify(engine, label, create=not readonly)
        except BaseException:
            engine.dispose()
            raise
        return cls(engine, label, readonly=readonly)

    @property
    def url(self) -> str:
        """The URL, password hidden."""
        return self._label

    @property
    def readonly(self) -> bool:
        return self._readonly

    def close(self) -> None:
        if self._engine is not None:
            # Closing the pooled connections lets SQLite checkpoint the WAL into the file.
            self._engine.dispose()
            self._engine = None
        self._cache.clear()

    def __enter__(self) -> PlanRegistry:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # -- writing -------------------------------------------------------------

    def record(
        self,
        problem: Problem,
        environment: Environment,
        plan: PlanRecord,
        *,
        source_hashes: Mapping[str, str] | None = None,
    ) -> RecordOutcome:
        """Keep ``plan`` as history; make it the best if it beats the current best.

        ``source_hashes`` (kernel family -> current source hash) lets a current
        measured plan beat a faster one measured under an older source.
        """
        created_at = datetime.now(UTC)
        return self._write(
            lambda session: queries.record_plan(
                session, problem, environment, plan, created_at, source_hashes
            ),
            "record a plan",
        )

    def import_(
        self, path: str | Path, *, source_hashes: Mapping[str, str] | None = None
    ) -> ImportSummary:
        """Add the plans of an export, all or nothing; plans already present are skipped.

        Each added plan goes through the same best rule as ``record``.
        """
        entries = transfer.read_export(Path(path))

        def run(session: Session) -> ImportSummary:
            outcomes = []
            for entry in entries:
                duplicate = queries.find_duplicate(
                    session, entry.problem, entry.environment, entry.record, entry.created_at
                )
                if duplicate is None:
                    outcomes.append(
                        queries.record_plan(
                            session,
                            entry.problem,
                            entry.environment,
                            entry.record,
                            entry.created_at,
                            source_hashes,
                        )
                    )
            return ImportSummary(len(outcomes), len(entries) - len(outcomes), tuple(outcomes))

        return self._write(run, f"import {path}")

    # -- reading -------------------------------------------------------------

    def best(
        self,
        problem: Problem,
        environment: Environment | None = None,
        *,
        nearest: bool = False,
        source_hashes: Mapping[str, str] | None = None,
    ) -> StoredPlan | None:
        """The plan to launch for ``problem``, or None when nothing fits.

        ``environment=None`` considers every environment. The exact problem is
        served when tuned; else, with ``nearest``, the nearest tuned shape
        (``fallback=True``). See the module doc for the order.
        """
        with self._read() as session:
            exact = queries.best_triples(session, ProblemRow.identity(problem), environment)
            if exact:
                served = [self._serve(session, t, source_hashes, fallback=False) for t in exact]
                return min(served, key=_serve_order)
            if not nearest:
                return None
            family_terms = (
                ProblemRow.head_dim == problem.head_dim,
                ProblemRow.dtype == problem.dtype,
                ProblemRow.causal == problem.causal,
            )
            candidates = queries.best_triples(session, family_terms, environment)
            if not candidates:
                return None
            served = [self._serve(session, t, source_hashes, fallback=True) for t in candidates]
            return min(
                served,
                key=lambda s: (
                    not s.served_as_measured,
                    ranking.shape_distance(problem, s.problem),
                    *_serve_order(s),
                ),
            )

    def cached_best(
        self,
        problem: Problem,
        environment: Environment | None = None,
        *,
        nearest: bool = False,
        source_hashes: Mapping[str, str] | None = None,
    ) -> StoredPlan | None:
        """``best()`` through this handle's LRU: for the deploy path, one query per shape.

        Writes through this handle clear it; writes by other processes are seen
        after ``clear_cache()`` (or by a fresh handle).
        """
        return self._cache.get(problem, environment, nearest=nearest, source_hashes=source_hashes)

    def clear_cache(self) -> None:
        self._cache.clear()

    def history(
        self,
        problem: Problem | None = None,
        environment: Environment | None = None,
        *,
        limit: int | None = DEFAULT_HISTORY_LIMIT,
        source_hashes: Mapping[str, str] | None = None,
    ) -> list[StoredPlan]:
        """Recorded plans, newest first, optionally for one problem and/or environment."""
        with self._read() as session:
            triples = queries.history_triples(session, problem, environment, limit)
            return [queries.to_stored(t, source_hashes=source_hashes) for t in triples]

    def list_best(self, *, source_hashes: Mapping[str, str] | None = None) -> list[StoredPlan]:
        """The best pointer of every problem x environment, by shape."""
        with self._read() as session:
            triples = queries.list_best_triples(session)
            return [queries.to_stored(t, source_hashes=source_hashes) for t in triples]

    def export(self, path: str | Path) -> int:
        """Write every plan (history included) as JSON; returns how many."""
        with self._read() as session:
            rows = queries.all_triples(session)
            plans = [
                transfer.ExportedPlan(
                    problem=q.to_problem(),
                    environment=e.to_environment(),
                    record=queries.to_record(p),
                    created_at=p.created_at,
                    best=is_best,
                )
                for (p, q, e), is_best in rows
            ]
        transfer.write_export(Path(path), plans)
        return len(plans)

    # -- internals -----------------------------------------------------------

    def _serve(
        self,
        session: Session,
        triple: queries.PlanTriple,
        source_hashes: Mapping[str, str] | None,
        *,
        fallback: bool,
    ) -> StoredPlan:
        """The pointer plan, or a current measured one when the pointer's source is stale."""
        stored = queries.to_stored(triple, fallback=fallback, source_hashes=source_hashes)
        if stored.stale and source_hashes:
            current = queries.fastest_current_measured(session, triple[0], source_hashes)
            if current is not None:
                return queries.to_stored(
                    (current, triple[1], triple[2]), fallback=fallback, source_hashes=source_hashes
                )
        return stored

    def _live_engine(self) -> Engine:
        if self._engine is None:
            raise RegistryError(f"registry {self._label} is closed")
        return self._engine

    @contextmanager
    def _read(self) -> Iterator[Session]:
        with storage.session_scope(self._live_engine(), self._label, write=False) as session:
            yield session

    def _write(self, work: Callable[[Session], _T], what: str) -> _T:
        if self._readonly:
            raise RegistryError(f"cannot {what}: registry {self._label} was opened read-only")
        try:
            with storage.session_scope(self._live_engine(), self._label, write=True) as session:
                return work(session)
        finally:
            # The cache must never outlive a change made through this handle;
            # clearing after a failed write only costs a re-query.
            self._cache.clear()


def _serve_order(stored: StoredPlan) -> tuple[int, float, int]:
    """Sort key among plans of one shape: better tier, then faster, then older."""
    if stored.served_as_measured:
        tier = ranking.TIER_MEASURED
    elif stored.record.measured:
        tier = ranking.TIER_STALE
    else:
        tier = ranking.TIER_PREDICTED
    return -tier, stored.record.ranking_ms, stored.plan_id


def upgrade_registry(url: str = storage.DEFAULT_URL) -> tuple[str | None, str]:
    """Create or upgrade the database at ``url`` to the newest schema revision.

    Returns (revision before or None for a new database, revision after).
    """
    parsed = storage.parse_url(url)
    engine = storage.create_registry_engine(parsed, readonly=False)
    try:
        return schema.upgrade(engine, storage.describe(parsed))
    finally:
        engine.dispose()
