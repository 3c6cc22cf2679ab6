"""The plan registry on real SQLite files: storage, best-plan rules, schema, transfer."""

from __future__ import annotations

import json
import shutil
import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, event

from db import (
    BestPlanCache,
    PlanRecord,
    PlanRegistry,
    RecordStatus,
    upgrade_registry,
)
from db import schema as registry_schema
from db.models import Base
from tuner.environment import Environment
from tuner.errors import RegistryError
from tuner.problem import Problem

FROZEN_0001 = Path(__file__).parent / "data" / "registry_0001.sqlite"

H200 = Environment("NVIDIA H200", "9.0", 132, "570.86", "12.8", "12.8.61", "2025.1.2")
A100 = Environment("NVIDIA A100-SXM4-80GB", "8.0", 108, "550.54", "12.4", "12.4.131", "2025.1")
SHAPE = Problem(seq_len=4096, head_dim=128, batch=2, heads=8)


def measured(
    median_ms: float, *, family: str = "tiled", source_hash: str = "h1", **kw
) -> PlanRecord:
    params = kw.pop("params", {"tile_size": 64, "rows_per_block": 64})
    return PlanRecord(family, params, source_hash, True, median_ms=median_ms, **kw)


def predicted(predicted_ms: float, *, family: str = "tiled", source_hash: str = "h1") -> PlanRecord:
    return PlanRecord(family, {"tile_size": 32}, source_hash, False, predicted_ms=predicted_ms)


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'registry' / 'plans.sqlite'}"


@pytest.fixture
def registry(url: str):
    with PlanRegistry.open(url) as handle:
        yield handle


def one_line(error: BaseException) -> str:
    text = str(error)
    assert "\n" not in text and text
    return text


# -- storage: fields, files, handles ---------------------------------------------------------


def test_every_field_round_trips_exactly(registry: PlanRegistry) -> None:
    full = PlanRecord(
        family="tiled",
        params={"tile_size": 64, "rows_per_block": 32, "sequence_splits": 4, "threads": 256},
        source_hash="sha256:" + "ab" * 32,
        measured=True,
        median_ms=0.1 + 0.2,  # not representable in short decimal: must come back bit-exact
        spread_ms=1e-9,
        tflops=123.456789012345,
        gbps=4321.000000001,
        max_abs_error=2.220446049250313e-16,
        predicted_ms=0.29999999999999993,
        predicted_read_bytes=2**64 - 1,  # the planner's saturated u64
        predicted_write_bytes=2**63,
        study_name="fa-4096x128-causal",
        trial_number=4711,
    )
    sparse = PlanRecord("scalar_online", {}, "", False, predicted_ms=7.25)
    registry.record(SHAPE, H200, full)
    registry.record(replace(SHAPE, causal=True), Environment("model", "9.0", 132), sparse)

    stored = {s.record.family: s for s in registry.history()}
    assert stored["tiled"].record == full
    assert stored["tiled"].problem == SHAPE and stored["tiled"].environment == H200
    assert stored["scalar_online"].record == sparse
    assert stored["tiled"].created_at.tzinfo is not None
    assert not stored["tiled"].fallback and not stored["tiled"].stale


def test_writer_creates_parent_directory_and_wal_file(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "plans.sqlite"
    with PlanRegistry.open(f"sqlite:///{path}") as registry:
        registry.record(SHAPE, H200, measured(1.0))
    connection = sqlite3.connect(path)
    assert connection.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    connection.close()


def test_writes_take_the_lock_up_front_and_connections_are_configured(
    registry: PlanRegistry,
) -> None:
    engine = registry._live_engine()
    statements: list[str] = []

    def capture(_conn, _cursor, statement, _params, _context, _many) -> None:
        statements.append(statement)

    event.listen(engine, "before_cursor_execute", capture)
    try:
        registry.record(SHAPE, H200, measured(1.0))
        assert statements[0] == "BEGIN IMMEDIATE"  # before the first read of the write
        statements.clear()
        registry.best(SHAPE, H200)
        assert statements[0] == "BEGIN DEFERRED"
    finally:
        event.remove(engine, "before_cursor_execute", capture)
    with engine.connect() as connection:
        pragma = connection.exec_driver_sql
        assert pragma("PRAGMA busy_timeout").scalar() == 30_000
        assert pragma("PRAGMA foreign_keys").scalar() == 1
        assert pragma("PRAGMA journal_mode").scalar() == "wal"


def test_an_empty_file_is_created_by_a_writer_and_refused_by_a_reader(tmp_path: Path) -> None:
    path = tmp_path / "empty.sqlite"
    path.touch()
    url = f"sqlite:///{path}"
    with pytest.raises(RegistryError, match="is empty"):
        PlanRegistry.open(url, readonly=True)
    PlanRegistry.open(url).close()
    PlanRegistry.open(url, readonly=True).close()


def test_an_in_memory_registry_works() -> None:
    with PlanRegistry.open("sqlite://") as registry:
        registry.record(SHAPE, H200, measured(1.0))
        assert registry.best(SHAPE) is not None


def test_writer_refuses_a_path_it_cannot_create(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where a directory should be")
    with pytest.raises(RegistryError) as caught:
        PlanRegistry.open(f"sqlite:///{blocker / 'plans.sqlite'}")
    assert "cannot create directory" in one_line(caught.value)


def test_readonly_handle_refuses_writes_and_creates_nothing(url: str, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "plans.sqlite"
    with pytest.raises(RegistryError) as caught:
        PlanRegistry.open(f"sqlite:///{missing}", readonly=True)
    assert "no plan registry" in one_line(caught.value)
    assert not missing.parent.exists()

    with PlanRegistry.open(url) as writer:
        writer.record(SHAPE, H200, measured(1.0))
    with PlanRegistry.open(url, readonly=True) as reader:
        assert reader.best(SHAPE, H200) is not None
        with pytest.raises(RegistryError, match="read-only"):
            reader.record(SHAPE, H200, measured(0.5))
        export = tmp_path / "export.json"
        reader.export(export)
        with pytest.raises(RegistryError, match="read-only"):
            reader.import_(export)
        # SQLite itself refuses too: the handle is a mode=ro connection, not just a flag.
        engine = reader._live_engine()
        with engine.connect() as connection, pytest.raises(Exception, match="readonly"):
            connection.exec_driver_sql("DELETE FROM best_plans")


def test_closed_handle_raises(url: str) -> None:
    registry = PlanRegistry.open(url)
    registry.close()
    with pytest.raises(RegistryError, match="closed"):
        registry.best(SHAPE)


@pytest.mark.parametrize("kind", ["text", "corrupted"])
def test_a_file_that_is_not_a_registry_database_is_refused(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "plans.sqlite"
    if kind == "text":
        path.write_text("seq_len,head_dim,median_ms\n4096,128,0.81\n" * 200)
    else:
        with PlanRegistry.open(f"sqlite:///{path}") as registry:
            for index in range(50):
                registry.record(replace(SHAPE, seq_len=64 + index), H200, measured(1.0 + index))
        data = bytearray(path.read_bytes())
        data[100:] = bytes(range(256)) * ((len(data) - 100) // 256) + b"\0" * (
            (len(data) - 100) % 256
        )
        path.write_bytes(bytes(data))
    for readonly in (False, True):
        with (
            pytest.raises(RegistryError) as caught,
            PlanRegistry.open(f"sqlite:///{path}", readonly=readonly) as registry,
        ):
            registry.list_best()
        assert "not a readable plan registry database" in one_line(caught.value)
        assert caught.value.__cause__ is not None


def test_a_foreign_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.sqlite"
    connection = sqlite3.connect(path)
    connection.execute("CREATE TABLE trials (id INTEGER PRIMARY KEY)")
    connection.commit()
    connection.close()
    with pytest.raises(RegistryError, match="not a plan registry"):
        PlanRegistry.open(f"sqlite:///{path}")


# -- the best rule ---------------------------------------------------------------------------


def test_better_plan_replaces_worse_is_kept_as_history_only(registry: PlanRegistry) -> None:
    first = registry.record(SHAPE, H200, measured(2.0))
    assert first.status is RecordStatus.STORED_NEW_BEST and first.is_best
    better = registry.record(SHAPE, H200, measured(1.5, params={"tile_size": 128}))
    assert better.status is RecordStatus.REPLACED_BEST and better.best_plan_id == better.plan_id
    worse = registry.record(SHAPE, H200, measured(1.7))
    assert worse.status is RecordStatus.KEPT_PREVIOUS_BEST
    assert worse.best_plan_id == better.plan_id and not worse.is_best
    tie = registry.record(SHAPE, H200, measured(1.5, params={"tile_size": 16}))
    assert tie.status is RecordStatus.KEPT_PREVIOUS_BEST  # a tie keeps the incumbent

    best = registry.best(SHAPE, H200)
    assert best is not None and best.plan_id == better.plan_id
    assert best.record.params == {"tile_size": 128}
    assert [s.record.median_ms for s in registry.history(SHAPE, H200)] == [1.5, 1.7, 1.5, 2.0]
    assert len(registry.list_best()) == 1


def test_predicted_never_beats_measured(registry: PlanRegistry) -> None:
    registry.record(SHAPE, H200, predicted(0.01))
    slow_but_measured = registry.record(SHAPE, H200, measured(50.0))
    assert slow_but_measured.status is RecordStatus.REPLACED_BEST
    even_faster_prediction = registry.record(SHAPE, H200, predicted(0.001))
    assert even_faster_prediction.status is RecordStatus.KEPT_PREVIOUS_BEST
    best = registry.best(SHAPE, H200)
    assert best is not None and best.served_as_measured and best.record.median_ms == 50.0


def test_best_across_environments_prefers_measured_then_fastest(registry: PlanRegistry) -> None:
    model = Environment("model", "9.0", 132)
    registry.record(SHAPE, model, predicted(0.001))
    registry.record(SHAPE, A100, measured(3.0))
    registry.record(SHAPE, H200, measured(1.0))
    best = registry.best(SHAPE)
    assert best is not None and best.environment == H200
    assert registry.best(SHAPE, A100).record.median_ms == 3.0  # type: ignore[union-attr]
    unknown = Environment("NVIDIA B200", "10.0", 148)
    assert registry.best(SHAPE, unknown) is None
    assert registry.best(SHAPE, unknown, nearest=True) is None


def test_stale_measured_plan_is_never_served_as_measured(registry: PlanRegistry) -> None:
    registry.record(SHAPE, H200, measured(1.0, source_hash="old"))
    registry.record(SHAPE, H200, predicted(0.5, source_hash="new"))

    only_stale = registry.best(SHAPE, H200, source_hashes={"tiled": "new"})
    assert only_stale is not None and only_stale.stale and not only_stale.served_as_measured
    assert only_stale.record.measured  # the record says what happened; the flag says how to use it
    fresh = registry.best(SHAPE, H200, source_hashes={"tiled": "old"})
    assert fresh is not None and fresh.served_as_measured and not fresh.stale
    unrelated = registry.best(SHAPE, H200, source_hashes={"scalar_online": "x"})
    assert unrelated is not None and unrelated.served_as_measured  # unknown family: current

    # A current measured plan is served over a faster stale one, even when the
    # pointer still names the stale one (recorded without hashes, it lost on time).
    slower_current = registry.record(SHAPE, H200, measured(4.0, source_hash="new"))
    assert slower_current.status is RecordStatus.KEPT_PREVIOUS_BEST
    served = registry.best(SHAPE, H200, source_hashes={"tiled": "new"})
    assert served is not None and served.plan_id == slower_current.plan_id
    assert served.served_as_measured


def test_record_with_current_hashes_replaces_a_stale_best(registry: PlanRegistry) -> None:
    registry.record(SHAPE, H200, measured(1.0, source_hash="old"))
    outcome = registry.record(
        SHAPE, H200, measured(9.0, source_hash="new"), source_hashes={"tiled": "new"}
    )
    assert outcome.status is RecordStatus.REPLACED_BEST
    stale_again = registry.record(
        SHAPE, H200, measured(0.1, source_hash="old"), source_hashes={"tiled": "new"}
    )
    assert stale_again.status is RecordStatus.KEPT_PREVIOUS_BEST
    listed = registry.list_best(source_hashes={"tiled": "new"})
    assert [s.record.median_ms for s in listed] == [9.0] and not listed[0].stale


# -- nearest shape ---------------------------------------------------------------------------


def shape(seq_len: int, batch: int = 1, heads: int = 1, **kw) -> Problem:
    return Problem(seq_len=seq_len, head_dim=64, batch=batch, heads=heads, **kw)


def test_nearest_shape_rule(registry: PlanRegistry) -> None:
    for seq_len in (1024, 4096):
        registry.record(shape(seq_len), H200, measured(seq_len / 1000))
    registry.record(shape(2048, batch=4, heads=8), H200, measured(9.0))
    registry.record(shape(2048, batch=1, heads=4), H200, measured(8.0))
    registry.record(shape(3000, causal=True), H200, measured(0.1))  # other causality
    registry.record(Problem(3000, 128), H200, measured(0.1))  # other head_dim

    def nearest(asked: Problem) -> Problem:
        stored = registry.best(asked, H200, nearest=True)
        assert stored is not None and stored.fallback
        return stored.problem

    assert registry.best(shape(1500), H200) is None  # nearest is opt-in
    assert nearest(shape(1100)) == shape(1024)
    assert nearest(shape(3000)) == shape(4096)  # |log2| 0.45 beats 2048's 0.55
    # Same seq_len: the nearest batch*heads decides (4 = 4 here, 32 is 3 octaves away).
    assert nearest(shape(2048, batch=2, heads=2)) == shape(2048, batch=1, heads=4)
    assert nearest(shape(2048, batch=4, heads=4)) == shape(2048, batch=4, heads=8)
    exact = registry.best(shape(1024), H200, nearest=True)
    assert exact is not None and not exact.fallback
    assert registry.best(Problem(2000, 32), H200, nearest=True) is None


def test_nearest_ties_go_to_the_larger_seq_len(registry: PlanRegistry) -> None:
    registry.record(shape(1024), H200, measured(1.0))
    registry.record(shape(4096), H200, measured(1.0))
    stored = registry.best(shape(2048), H200, nearest=True)
    assert stored is not None and stored.problem.seq_len == 4096


def test_nearest_prefers_a_measured_shape_to_a_nearer_predicted_one(
    registry: PlanRegistry,
) -> None:
    registry.record(shape(2048), H200, predicted(0.2))
    registry.record(shape(8192), H200, measured(3.0))
    stored = registry.best(shape(1900), H200, nearest=True)
    assert stored is not None and stored.problem.seq_len == 8192 and stored.served_as_measured
    # ...and a stale measured shape counts as not measured.
    stale = registry.best(shape(1900), H200, nearest=True, source_hashes={"tiled": "h2"})
    assert stale is not None and stale.problem.seq_len == 2048 and not stale.served_as_measured


# -- cache -----------------------------------------------------------------------------------


def test_cached_best_is_served_from_the_lru_and_cleared_by_writes(registry: PlanRegistry) -> None:
    registry.record(SHAPE, H200, measured(2.0))
    first = registry.cached_best(SHAPE, H200)
    assert first is not None and registry.cached_best(SHAPE, H200) is first
    registry.record(SHAPE, H200, measured(1.0))
    second = registry.cached_best(SHAPE, H200)
    assert second is not None and second.record.median_ms == 1.0


def test_best_plan_cache_is_an_lru_keyed_by_every_argument() -> None:
    calls: list[tuple] = []

    def lookup(problem, environment=None, *, nearest=False, source_hashes=None):
        calls.append((problem, environment, nearest, source_hashes))
        return None

    cache = BestPlanCache(lookup, maxsize=2)
    cache.get(SHAPE)
    cache.get(SHAPE)
    cache.get(SHAPE, nearest=True)
    cache.get(SHAPE, source_hashes={"tiled": "a"})  # evicts (SHAPE, None, False, None)
    cache.get(SHAPE, source_hashes={"tiled": "a"})
    cache.get(SHAPE)
    assert len(calls) == 4 and len(cache) == 2 and cache.hits == 2


# -- schema revisions ------------------------------------------------------------------------


def test_known_revisions_match_the_packaged_migrations() -> None:
    scripts = ScriptDirectory.from_config(registry_schema.alembic_config())
    oldest_first = [s.revision for s in reversed(list(scripts.walk_revisions()))]
    assert tuple(oldest_first) == registry_schema.KNOWN_REVISIONS
    assert scripts.get_current_head() == registry_schema.HEAD_REVISION


def test_migrations_build_exactly_the_models(url: str) -> None:
    PlanRegistry.open(url).close()
    engine = create_engine(url)
    with engine.connect() as connection:
        context = MigrationContext.configure(
            connection, opts={"compare_type": True, "compare_server_default": False}
        )
        assert compare_metadata(context, Base.metadata) == []
    engine.dispose()


def test_frozen_0001_database_is_refused_then_upgraded(tmp_path: Path) -> None:
    path = tmp_path / "registry_0001.sqlite"
    shutil.copy(FROZEN_0001, path)
    url = f"sqlite:///{path}"
    for readonly in (True, False):
        with pytest.raises(RegistryError) as caught:
            PlanRegistry.open(url, readonly=readonly)
        assert f"python -m db upgrade --url {url}" in one_line(caught.value)

    assert upgrade_registry(url) == ("0001", registry_schema.HEAD_REVISION)
    assert upgrade_registry(url) == (registry_schema.HEAD_REVISION,) * 2  # idempotent

    with PlanRegistry.open(url) as registry:
        h200_0001 = Environment("NVIDIA H200", "9.0", 132, "570.86", "12.8", "12.8.61", "")
        best = registry.best(Problem(4096, 128), h200_0001)
        assert best is not None and best.record.median_ms == 0.8125
        assert best.record.params == {"rows_per_block": 64, "tile_size": 64}
        assert best.record.predicted_read_bytes == 67108864 and best.record.trial_number == 17
        assert best.created_at.microsecond == 1
        assert len(registry.history()) == 3 and len(registry.list_best()) == 2
        # The new identity column works: same GPU, different PyCUDA, separate environment.
        newer_pycuda = replace(h200_0001, pycuda_version="2025.1.2")
        outcome = registry.record(Problem(4096, 128), newer_pycuda, measured(0.5))
        assert outcome.status is RecordStatus.STORED_NEW_BEST
        assert registry.best(Problem(4096, 128), h200_0001).record.median_ms == 0.8125  # type: ignore[union-attr]

    connection = sqlite3.connect(path)
    assert connection.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    assert connection.execute("PRAGMA foreign_key_check").fetchall() == []
    connection.close()


def test_newer_schema_is_refused_with_the_upgrade_command(url: str) -> None:
    PlanRegistry.open(url).close()
    path = url.removeprefix("sqlite:///")
    connection = sqlite3.connect(path)
    connection.execute("UPDATE alembic_version SET version_num = '0099'")
    connection.commit()
    connection.close()
    for readonly in (True, False):
        with pytest.raises(RegistryError) as caught:
            PlanRegistry.open(url, readonly=readonly)
        message = one_line(caught.value)
        assert "'0099'" in message and f"python -m db upgrade --url {url}" in message
    with pytest.raises(RegistryError, match="0099"):
        upgrade_registry(url)


def test_foreign_keys_are_enforced_after_open(registry: PlanRegistry) -> None:
    registry.record(SHAPE, H200, measured(1.0))
    with pytest.raises(RegistryError, match="FOREIGN KEY"):
        registry._write(
            lambda session: session.connection().exec_driver_sql(
                "INSERT INTO best_plans VALUES (999, 999, 999)"
            ),
            "break a foreign key",
        )


# -- export / import -------------------------------------------------------------------------


def populate(registry: PlanRegistry) -> None:
    registry.record(SHAPE, H200, measured(2.0, tflops=10.5, study_name="s", trial_number=1))
    registry.record(SHAPE, H200, measured(1.0, gbps=99.0, predicted_read_bytes=2**64 - 1))
    registry.record(SHAPE, A100, predicted(0.3))
    registry.record(shape(512, causal=True), H200, measured(0.25, family="scalar_online"))


def rows(registry: PlanRegistry) -> list[tuple]:
    return sorted(
        (
            s.created_at,
            repr(s.problem),
            repr(s.environment),
            json.dumps(s.record.as_dict(), sort_keys=True),
        )
        for s in registry.history(limit=None)
    )


def test_export_then_import_gives_the_same_rows(registry: PlanRegistry, tmp_path: Path) -> None:
    populate(registry)
    export = tmp_path / "out" / "plans.json"
    assert registry.export(export) == 4
    with PlanRegistry.open(f"sqlite:///{tmp_path / 'fresh.sqlite'}") as fresh:
        summary = fresh.import_(export)
        assert (summary.added, summary.skipped) == (4, 0)
        assert rows(fresh) == rows(registry)
        assert [(s.problem, s.environment, s.record) for s in fresh.list_best()] == [
            (s.problem, s.environment, s.record) for s in registry.list_best()
        ]
        again = fresh.import_(export)
        assert (again.added, again.skipped) == (0, 4)
        assert len(fresh.history(limit=None)) == 4


def test_import_merges_by_the_best_rule(registry: PlanRegistry, tmp_path: Path) -> None:
    populate(registry)
    export = tmp_path / "plans.json"
    registry.export(export)
    with PlanRegistry.open(f"sqlite:///{tmp_path / 'other.sqlite'}") as other:
        other.record(SHAPE, H200, measured(0.5))  # already better than anything imported
        other.import_(export)
        best = other.best(SHAPE, H200)
        assert best is not None and best.record.median_ms == 0.5


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json", "not JSON"),
        ('{"format": "something-else", "version": 1, "plans": []}', "not a plan registry export"),
        ('{"format": "flash-attention-tuner/plan-registry", "version": 99}', "version 99"),
        (
            '{"format": "flash-attention-tuner/plan-registry", "version": 1, '
            '"plans": [{"problem": {}}]}',
            "plan #0 is malformed",
        ),
    ],
)
def test_import_refuses_a_bad_export(
    registry: PlanRegistry, tmp_path: Path, content: str, message: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(RegistryError, match=message):
        registry.import_(path)


# -- values ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"family": "", "measured": True, "median_ms": 1.0},
        {"measured": True},  # measured without a timing
        {"measured": False},  # nothing to rank by
        {"measured": True, "median_ms": float("nan")},
        {"measured": True, "median_ms": 1.0, "params": {"tile_size": "64"}},
        {"measured": 1, "median_ms": 1.0},
        {"measured": True, "median_ms": 1.0, "predicted_read_bytes": -1},
        {"measured": True, "median_ms": 1.0, "predicted_write_bytes": 1 << 64},
        {"measured": True, "median_ms": 1.0, "trial_number": 1.5},
    ],
)
def test_plan_record_rejects_invalid_values(kwargs: dict) -> None:
    base = {"family": "tiled", "params": {}, "source_hash": "h"}
    with pytest.raises(ValueError):
        PlanRecord(**(base | kwargs))


def test_a_0002_database_with_a_row_upgrades_to_0003_and_reads_as_float32(tmp_path: Path) -> None:
    """A registry at 0002 (the frozen 0001 file upgraded to 0002 only) with a problem row
    written without a dtype upgrades, and its plan is served for the float32 problem."""
    from alembic import command

    from db.schema import alembic_config

    path = tmp_path / "registry_0002.sqlite"
    shutil.copy(FROZEN_0001, path)
    url = f"sqlite:///{path}"
    engine = create_engine(url)
    with engine.begin() as connection:
        config = alembic_config()
        config.attributes["connection"] = connection
        command.upgrade(config, "0002")
    engine.dispose()
    connection = sqlite3.connect(path)
    assert connection.execute("SELECT version_num FROM alembic_version").fetchall() == [("0002",)]
    # A writer that left dtype empty (the column had no default before 0003).
    connection.execute("UPDATE problems SET dtype = '' WHERE seq_len = 4096")
    connection.commit()
    connection.close()

    assert upgrade_registry(url) == ("0002", registry_schema.HEAD_REVISION)
    h200_0001 = Environment("NVIDIA H200", "9.0", 132, "570.86", "12.8", "12.8.61", "")
    with PlanRegistry.open(url, readonly=True) as registry:
        best = registry.best(Problem(4096, 128, dtype="float32"), h200_0001)
        assert best is not None and best.record.median_ms == 0.8125
        assert registry.best(Problem(4096, 128, dtype="bfloat16"), h200_0001) is None
    connection = sqlite3.connect(path)
    assert connection.execute("SELECT DISTINCT dtype FROM problems").fetchall() == [("float32",)]
    connection.close()


def test_a_0003_database_with_a_row_upgrades_to_the_head_as_self_attention(tmp_path: Path) -> None:
    """A registry at 0003 holding a plan upgrades; its problem reads kv_heads = heads and
    kv_len = seq_len, the plan is served for the same self-attention problem, and GQA and
    KV-cache problems of the same shape are new rows beside it."""
    from alembic import command

    from db.schema import alembic_config

    path = tmp_path / "registry_0003.sqlite"
    shutil.copy(FROZEN_0001, path)
    url = f"sqlite:///{path}"
    engine = create_engine(url)
    with engine.begin() as connection:
        config = alembic_config()
        config.attributes["connection"] = connection
        command.upgrade(config, "0003")
    engine.dispose()
    connection = sqlite3.connect(path)
    assert connection.execute("SELECT version_num FROM alembic_version").fetchall() == [("0003",)]
    columns = [row[1] for row in connection.execute("PRAGMA table_info(problems)")]
    assert "kv_heads" not in columns and "kv_len" not in columns
    rows_before = connection.execute("SELECT id, heads, seq_len FROM problems").fetchall()
    connection.close()
    assert rows_before

    assert upgrade_registry(url) == ("0003", registry_schema.HEAD_REVISION)
    connection = sqlite3.connect(path)
    after = connection.execute("SELECT id, kv_heads, kv_len FROM problems").fetchall()
    connection.close()
    assert sorted(after) == sorted(rows_before)  # kv_heads = heads, kv_len = seq_len, per row

    h200_0001 = Environment("NVIDIA H200", "9.0", 132, "570.86", "12.8", "12.8.61", "")
    with PlanRegistry.open(url) as registry:
        best = registry.best(Problem(4096, 128), h200_0001)
        assert best is not None and best.record.median_ms == 0.8125
        assert best.problem == Problem(4096, 128, kv_heads=1, kv_len=4096)
        assert registry.best(Problem(4096, 128, kv_len=8192), h200_0001) is None
        registry.record(Problem(4096, 128, kv_len=8192), h200_0001, measured(0.25))
        served = registry.best(Problem(4096, 128, kv_len=8192), h200_0001)
        assert served is not None and served.record.median_ms == 0.25
        # the self-attention row is untouched by the KV-cache row beside it
        best = registry.best(Problem(4096, 128), h200_0001)
        assert best is not None and best.record.median_ms == 0.8125


def test_the_same_trial_s_result_is_stored_once(tmp_path) -> None:
    """A rerun of a finished study stores its best again: one result, one row."""
    url = f"sqlite:///{tmp_path / 'plans.sqlite'}"
    problem, environment = Problem(1024, 64), Environment("NVIDIA H200", "9.0", 132)
    trial = PlanRecord(
        "tiled", {"tile_size": 32}, "h", True, median_ms=0.5, study_name="s", trial_number=3
    )
    with PlanRegistry.open(url) as registry:
        first = registry.record(problem, environment, trial)
        again = registry.record(problem, environment, trial)
        assert again.status is RecordStatus.ALREADY_STORED
        assert again.plan_id == first.plan_id == again.best_plan_id
        # Another trial with equal numbers, and a record naming no trial, are new rows.
        other = replace(trial, trial_number=4)
        assert registry.record(problem, environment, other).status is not (
            RecordStatus.ALREADY_STORED
        )
        anonymous = replace(trial, study_name=None, trial_number=None)
        registry.record(problem, environment, anonymous)
        registry.record(problem, environment, anonymous)
        assert len(registry.history(limit=None)) == 4
