"""Several processes recording into one SQLite registry at once lose nothing.

``run_writers`` and ``check_every_plan_and_the_true_best`` are shared with the
PostgreSQL test (tests/test_registry_postgres.py).
"""

from __future__ import annotations

import multiprocessing
import random
import sqlite3
from pathlib import Path

from db import PlanRecord, PlanRegistry
from tuner.environment import Environment
from tuner.problem import Problem

WORKERS = 4
PLANS_PER_WORKER = 500
SHAPES = [Problem(seq_len=256 * (1 + i % 8), head_dim=64 * (1 + i // 8)) for i in range(16)]
ENVIRONMENTS = [
    Environment("NVIDIA H200", "9.0", 132, "570.86", "12.8", "12.8.61", "2025.1.2"),
    Environment("model", "9.0", 132),
]


def planned(worker: int, count: int = PLANS_PER_WORKER) -> list[tuple[int, int, PlanRecord]]:
    """Worker ``worker``'s plans: (shape index, environment index, plan), deterministic."""
    rng = random.Random(worker)
    plans = []
    for trial in range(count):
        record = PlanRecord(
            family="tiled",
            params={"tile_size": rng.choice([16, 32, 64]), "worker": worker},
            source_hash="h",
            measured=rng.random() < 0.8,
            median_ms=rng.uniform(0.1, 10.0),
            study_name=f"worker-{worker}",
            trial_number=trial,
        )
        plans.append((rng.randrange(len(SHAPES)), rng.randrange(len(ENVIRONMENTS)), record))
    return plans


def record_all(
    url: str,
    worker: int,
    start: multiprocessing.synchronize.Barrier,
    count: int = PLANS_PER_WORKER,
) -> None:
    with PlanRegistry.open(url) as registry:
        start.wait()  # every worker holds an open handle before anyone writes
        for shape, environment, record in planned(worker, count):
            registry.record(SHAPES[shape], ENVIRONMENTS[environment], record)


def run_writers(url: str, count: int = PLANS_PER_WORKER) -> None:
    """``WORKERS`` processes, each recording ``count`` plans into ``url`` at once."""
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(WORKERS)
    processes = [
        context.Process(target=record_all, args=(url, worker, start, count))
        for worker in range(WORKERS)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
    assert [p.exitcode for p in processes] == [0] * WORKERS


def check_every_plan_and_the_true_best(url: str, count: int = PLANS_PER_WORKER) -> None:
    """Every worker's plan is stored intact, with exactly one true best per problem x env."""
    expected = [(s, e, r) for worker in range(WORKERS) for s, e, r in planned(worker, count)]
    with PlanRegistry.open(url, readonly=True) as registry:
        history = registry.history(limit=None)
        assert len(history) == WORKERS * count
        stored = {(h.record.study_name, h.record.trial_number): h for h in history}
        for shape, environment, record in expected:
            found = stored[(record.study_name, record.trial_number)]
            assert found.record == record
            assert (found.problem, found.environment) == (
                SHAPES[shape],
                ENVIRONMENTS[environment],
            )

        best = registry.list_best()
        keys = [(b.problem, b.environment) for b in best]
        assert len(keys) == len(set(keys))  # exactly one best per problem x environment
        for key in {(SHAPES[s], ENVIRONMENTS[e]) for s, e, _ in expected}:
            candidates = [r for s, e, r in expected if (SHAPES[s], ENVIRONMENTS[e]) == key]
            measured = [r for r in candidates if r.measured]
            pool = measured or candidates  # measured always beats predicted
            true_best = min(r.ranking_ms for r in pool)
            served = registry.best(*key)
            assert served is not None and served.record.ranking_ms == true_best
            assert served.record.measured == bool(measured)
        assert len(best) == len({(SHAPES[s], ENVIRONMENTS[e]) for s, e, _ in expected})


def test_four_processes_writing_at_once_keep_every_plan_and_the_true_best(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'plans.sqlite'}"
    run_writers(url)
    check_every_plan_and_the_true_best(url)

    connection = sqlite3.connect(tmp_path / "plans.sqlite")
    assert connection.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    assert connection.execute("PRAGMA foreign_key_check").fetchall() == []
    connection.close()
