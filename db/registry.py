"""The plan registry: record tuned plans, serve the best one per problem x environment.

    with PlanRegistry.open("sqlite:////srv/tuning/plans.sqlite") as registry:
        registry.record(problem, environment, plan)            # a tuning run

    registry = PlanRegistry.open(url, readonly=True)             # a deployment
    stored = registry.cached_best(problem, environment, nearest=True,
                                  source_hashes={"tiled": tiled_hash})

Rules (``db.ranking`` has them in full): measured beats predicted, a stale
measured plan (kernel source changed) is never served as measured, then the
lower time wins. A plan ``disable``d (by ``python -m db verify``) is never served:
the next best plan of its problem x environment is. ``best`` looks for the exact
problem first and, with
``nearest=True``, falls back to the nearest tuned shape of the same head_dim,
dtype and causality, preferring shapes with a current measured plan.

Schema policy (``db.schema``): a writer creates an empty database; a database
at an older revision is refused until ``python -m db upgrade --url URL`` is run;
one at an unknown (newer) revision is refused.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session

from db import ranking, reads, schema, storage, transfer, writes
from db.cache import BestPlanCache
from db.records import ImportSummary, PlanRecord, RecordOutcome, StoredPlan
from tuner.data_dir import default_registry_url
from tuner.environment import Environment
from tuner.errors import RegistryError
from tuner.problem import Problem

_T = TypeVar("_T")
DEFAULT_HISTORY_LIMIT = 100
# A write that loses a deadlock or serialization conflict (PostgreSQL) was rolled
# back whole, so it runs again; a handful of tries, with jittered backoff so the
# same writers do not collide again in lockstep.
WRITE_ATTEMPTS = 8
RETRY_BACKOFF_S = 0.01


class PlanRegistry:
    """A handle on one registry database. Open with ``PlanRegistry.open``."""

    def __init__(
        self,
        engine: Engine,
        label: str,
        *,
        readonly: bool,
        tidy: Callable[[], None] = lambda: None,
    ) -> None:
        self._engine: Engine | None = engine
        self._label = label
        self._readonly = readonly
        self._tidy = tidy
        self._cache = BestPlanCache(self.best)

    @classmethod
    def open(cls, url: str | None = None, readonly: bool = False) -> PlanRegistry:
        """Open (a writer creates when missing) and check the schema revision.

        ``url=None``: ``plans.sqlite`` in the per-user data directory (``tuner.data_dir``).
        """
        parsed = storage.parse_url(url or default_registry_url())
        label = storage.describe(parsed)
        tidy = storage.SidecarTidy(parsed)
        engine = storage.create_registry_engine(parsed, readonly=readonly)
        try:
            schema.verify(engine, label, create=not readonly)
        except BaseException:
            engine.dispose()
            tidy()  # a refused file keeps no -wal/-shm of ours
            raise
        return cls(engine, label, readonly=readonly, tidy=tidy)

    @classmethod
    def check_writable(cls, url: str | None = None) -> None:
        """Refuse now what ``open(url)`` and a write would refuse later, creating nothing.

        A missing SQLite file is not created (a run that fails before it has a
        plan must leave no empty registry behind): its directory must be
        creatable and writable. An existing file, or a server, is opened and its
        schema checked (read-only for a file).
        """
        parsed = storage.parse_url(url or default_registry_url())
        path = storage.sqlite_file(parsed) if storage.is_sqlite(parsed) else None
        if path is not None and not path.exists():
            storage.check_creatable(path)
            return
        if path is not None:
            storage.check_writable_file(path)
        cls.open(url or default_registry_url(), readonly=path is not None).close()

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
            self._tidy()
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
            lambda session: writes.record_plan(
                session, problem, environment, plan, created_at, source_hashes
            ),
            "record a plan",
        )

    def import_(
        self,
        path: str | Path,
        *,
        source_hashes: Mapping[str, str] | None = None,
        entries: list[transfer.ExportedPlan] | None = None,
    ) -> ImportSummary:
        """Add the plans of an export, all or nothing; plans already present are skipped.

        Each added plan goes through the same best rule as ``record``. ``entries``:
        the export already read from ``path`` (``transfer.read_export``).
        """
        if entries is None:
            entries = transfer.read_export(Path(path))

        def run(session: Session) -> ImportSummary:
            outcomes = []
            ids: dict[tuple[Problem, Environment], tuple[int, int]] = {}
            for entry in entries:
                key = (entry.problem, entry.environment)
                if key not in ids:
                    ids[key] = writes.resolve_ids(session, entry.problem, entry.environment)
                if writes.is_duplicate(session, *ids[key], entry.record, entry.created_at):
                    continue
                outcomes.append(
                    writes.record_plan_at(
                        session, *ids[key], entry.record, entry.created_at, source_hashes
                    )
                )
            return ImportSummary(len(outcomes), len(entries) - len(outcomes), tuple(outcomes))

        return self._write(run, f"import {path}")

    def disable(
        self, plan_id: int, reason: str, *, source_hashes: Mapping[str, str] | None = None
    ) -> int | None:
        """Take a plan out of service (``python -m db verify``); the plan id now served for
        its problem x environment, or None when none is left. See ``writes.disable_plan``."""

        def run(session: Session) -> int | None:
            try:
                return writes.disable_plan(session, plan_id, reason, source_hashes)
            except LookupError as error:
                raise RegistryError(f"registry {self._label}: {error}") from error

        return self._write(run, f"disable plan #{plan_id}")

    # -- reading -------------------------------------------------------------

    def best(
        self,
        problem: Problem,
        environment: reads.EnvironmentMatch | None = None,
        *,
        nearest: bool = False,
        source_hashes: Mapping[str, str] | None = None,
    ) -> StoredPlan | None:
        """The plan to launch for ``problem``, or None when nothing fits.

        ``environment=None`` considers every environment; a mapping of some of an
        ``Environment``'s fields (``{"gpu_name": "NVIDIA H200"}``) every environment
        that has those values. The exact problem is
        served when tuned; else, with ``nearest``, the nearest tuned shape
        (``fallback=True``). See the module doc for the order.
        """
        with self._read() as connection:
            exact = reads.best_pointers(connection, problem, environment, exact=True)
            if exact:
                served = [
                    _serve(connection, found, source_hashes, fallback=False) for found in exact
                ]
                return min(served, key=_serve_order)
            if not nearest:
                return None
            candidates = reads.best_pointers(connection, problem, environment, exact=False)
            if not candidates:
                return None
            served = [
                _serve(connection, found, source_hashes, fallback=True) for found in candidates
            ]
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
        environment: Environment | tuple[tuple[str, Any], ...] | None = None,
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
        environment: reads.EnvironmentMatch | None = None,
        *,
        limit: int | None = DEFAULT_HISTORY_LIMIT,
        source_hashes: Mapping[str, str] | None = None,
    ) -> list[StoredPlan]:
        """Recorded plans, newest first, optionally for one problem and/or environment."""
        with self._read() as connection:
            found = reads.history(connection, problem, environment, limit)
            return [plan.stored(source_hashes=source_hashes) for plan in found]

    def list_best(self, *, source_hashes: Mapping[str, str] | None = None) -> list[StoredPlan]:
        """The best pointer of every problem x environment, by shape."""
        with self._read() as connection:
            return [
                plan.stored(source_hashes=source_hashes) for plan in reads.every_best(connection)
            ]

    def export(self, path: str | Path) -> int:
        """Write every plan (history included) as JSON; returns how many. ``path`` may be
        ``-`` (standard output) or a link (its target is written); see ``db.export_target``."""
        with self._read() as connection:
            plans = [
                transfer.ExportedPlan(
                    plan.problem, plan.environment, plan.record, plan.created_at, is_best
                )
                for plan, is_best in reads.every_plan(connection)
            ]
        transfer.write_export(path, plans)
        return len(plans)

    # -- internals -----------------------------------------------------------

    def _live_engine(self) -> Engine:
        if self._engine is None:
            raise RegistryError(f"registry {self._label} is closed")
        return self._engine

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        with storage.read_scope(self._live_engine(), self._label) as connection:
            yield connection

    def _write(self, work: Callable[[Session], _T], what: str) -> _T:
        if self._readonly:
            raise RegistryError(f"cannot {what}: registry {self._label} was opened read-only")
        try:
            for attempt in range(1, WRITE_ATTEMPTS + 1):
                try:
                    with storage.session_scope(
                        self._live_engine(), self._label, write=True
                    ) as session:
                        return work(session)
                except storage.WriteConflict:
                    if attempt == WRITE_ATTEMPTS:
                        raise
                    time.sleep(random.uniform(0.5, 1.5) * RETRY_BACKOFF_S * attempt)
            raise AssertionError("unreachable: the last attempt returns or raises")
        finally:
            # The cache must never outlive a change made through this handle;
            # clearing after a failed write only costs a re-query.
            self._cache.clear()


def _serve(
    connection: Connection,
    pointer: reads.FoundPlan,
    source_hashes: Mapping[str, str] | None,
    *,
    fallback: bool,
) -> StoredPlan:
    """The pointer's plan, or a current measured one when the pointer's source is stale."""
    stored = pointer.stored(fallback=fallback, source_hashes=source_hashes)
    if stored.stale and source_hashes:
        current = reads.fastest_current_measured(connection, pointer, source_hashes)
        if current is not None:
            return current.stored(fallback=fallback, source_hashes=source_hashes)
    return stored


def _serve_order(stored: StoredPlan) -> tuple[int, float, int]:
    """Sort key among plans of one shape: better tier, then faster, then older."""
    if stored.served_as_measured:
        tier = ranking.TIER_MEASURED
    elif stored.record.measured:
        tier = ranking.TIER_STALE
    else:
        tier = ranking.TIER_PREDICTED
    return -tier, stored.record.ranking_ms, stored.plan_id


def upgrade_registry(url: str | None = None) -> tuple[str | None, str]:
    """Create or upgrade the database at ``url`` (None: the default) to the newest revision.

    Returns (revision before or None for a new database, revision after).
    """
    parsed = storage.parse_url(url or default_registry_url())
    tidy = storage.SidecarTidy(parsed)
    engine = storage.create_registry_engine(parsed, readonly=False)
    try:
        return schema.upgrade(engine, storage.describe(parsed))
    finally:
        engine.dispose()
        tidy()
