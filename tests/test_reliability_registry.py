"""Registry writers killed with SIGKILL mid-write, while readers poll: nothing half-seen, nothing
committed lost.

Rounds of writer processes record plans into one SQLite registry as fast as they
can, each appending a plan's id (study name, trial number) to its own log only after
``record`` returned, that is after the commit; each writer is killed with SIGKILL
at a seeded random moment, so kills land inside transactions, between the commit
and the log line, anywhere. Reader processes poll the whole time, through the
API (``best()``, ``history()``) on read-only handles and through one raw read
transaction per poll, and check every plan they see against what its writer meant
to write (each plan's fields, shape and environment follow from its id):

* no partially written record: every plan row is exactly its intended record, with
  its problem and environment rows; no problem or environment row exists without
  a plan (they are written in the plan's transaction);
* the best pointer is consistent: one per problem x environment that has plans,
  pointing at a plan of that problem x environment, the fastest of them; ``best()``
  is never slower than the plans already seen and never gets slower over time.

Afterwards every plan whose id was logged is in the registry, intact, each best is
the true best, and ``PRAGMA integrity_check`` and ``foreign_key_check`` pass.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from db import PlanRecord, PlanRegistry, StoredPlan
from tuner.environment import Environment
from tuner.problem import Problem

ROUNDS = 4
WRITERS = 3
READERS = 2
SEED = 7
SHAPES = [Problem(256 * (1 + i), 64 * (1 + i % 2), batch=1 + i % 3) for i in range(4)]
ENVIRONMENTS = [
    Environment("NVIDIA H200", "9.0", 132, "570.86", "12.8", "12.8.61", "2025.1.2"),
    Environment("NVIDIA A100-SXM4-80GB", "8.0", 108, "550.54", "12.4", "12.4.131", "2025.1"),
]
SHAPE_INDEX = {shape: i for i, shape in enumerate(SHAPES)}
ENV_INDEX = {env: i for i, env in enumerate(ENVIRONMENTS)}


def intended(study: str, number: int) -> tuple[int, int, PlanRecord]:
    """(shape index, environment index, record) of a writer's plan: a function of its id."""
    rng = random.Random(f"{study}/{number}")
    shape, environment = rng.randrange(len(SHAPES)), rng.randrange(len(ENVIRONMENTS))
    median = round(rng.uniform(0.05, 5.0), 9)
    record = PlanRecord(
        family="tiled",
        params={
            "tile_size": rng.choice([16, 32, 64, 128]),
            "rows_per_block": rng.choice([16, 32, 64, 128]),
            "threads": rng.choice([64, 128, 256]),
        },
        source_hash="h",
        measured=True,
        median_ms=median,
        spread_ms=round(median * rng.uniform(0.001, 0.02), 9),
        tflops=round(rng.uniform(1, 60), 6),
        gbps=round(rng.uniform(10, 4000), 6),
        max_abs_error=rng.uniform(1e-8, 1e-4),
        predicted_ms=round(median * rng.uniform(0.5, 2), 9),
        predicted_read_bytes=rng.randrange(1 << 40),
        predicted_write_bytes=rng.randrange(1 << 30),
        study_name=study,
        trial_number=number,
    )
    return shape, environment, record


# ---------------------------------------------------------------- the processes


def writer_main(url: str, study: str, log_path: str, ready: Any) -> None:
    """Record plans forever; log each id after its commit. Ends by SIGKILL."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    with PlanRegistry.open(url) as registry:
        ready.set()
        for number in range(1_000_000):
            shape, environment, record = intended(study, number)
            registry.record(SHAPES[shape], ENVIRONMENTS[environment], record)
            os.write(log, f"{study} {number}\n".encode())


def reader_main(url: str, path: str, stop: Any, result_path: str) -> None:
    """Poll until ``stop``; write the checks made and every violation seen as JSON."""
    problems: list[str] = []
    polls = plans_seen = 0
    best_ms: dict[tuple[int, int], float] = {}
    registry = PlanRegistry.open(url, readonly=True)
    try:
        while not stop.is_set():
            polls += 1
            if polls % 10 == 0:  # now and then a cold open, as a deployment does
                registry.close()
                registry = PlanRegistry.open(url, readonly=True)
            history = registry.history(limit=None)
            plans_seen = max(plans_seen, len(history))
            fastest_seen: dict[tuple[int, int], float] = {}
            for stored in history:
                problems += check_stored(stored)
                key = (SHAPE_INDEX[stored.problem], ENV_INDEX[stored.environment])
                fastest_seen[key] = min(fastest_seen.get(key, 1e9), stored.record.ranking_ms)
            for shape in SHAPES:
                for environment in ENVIRONMENTS:
                    key = (SHAPE_INDEX[shape], ENV_INDEX[environment])
                    best = registry.best(shape, environment)
                    if best is None:
                        if key in fastest_seen:
                            problems.append(f"{key}: plans seen but no best")
                        continue
                    problems += check_stored(best)
                    if (best.problem, best.environment) != (shape, environment):
                        problems.append(f"{key}: best() served another shape or environment")
                    ms = best.record.ranking_ms
                    if ms > fastest_seen.get(key, 1e9):
                        problems.append(f"{key}: best {ms} slower than a plan seen before")
                    if ms > best_ms.get(key, 1e9):
                        problems.append(f"{key}: best got slower, {best_ms[key]} -> {ms}")
                    best_ms[key] = ms
            problems += check_snapshot(path)
    except Exception as error:  # noqa: BLE001 - a reader that fails is a finding too
        problems.append(f"reader raised {type(error).__name__}: {error}")
    finally:
        registry.close()
    Path(result_path).write_text(
        json.dumps({"polls": polls, "plans_seen": plans_seen, "problems": problems[:50]})
    )


def check_stored(stored: StoredPlan) -> list[str]:
    record = stored.record
    if record.study_name is None or record.trial_number is None:
        return [f"plan {stored.plan_id} has no id"]
    shape, environment, expected = intended(record.study_name, record.trial_number)
    found = []
    if record != expected:
        found.append(f"plan {stored.plan_id} is not what was written: {record}")
    if (stored.problem, stored.environment) != (SHAPES[shape], ENVIRONMENTS[environment]):
        found.append(f"plan {stored.plan_id} has another plan's problem or environment")
    return found


def check_snapshot(path: str) -> list[str]:
    """One raw read transaction: the rows themselves, all consistent with each other."""
    connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    connection.isolation_level = None
    try:
        connection.execute("BEGIN")
        plans = connection.execute(
            "SELECT id, problem_id, environment_id, median_ms, study_name, trial_number, params "
            "FROM plans"
        ).fetchall()
        problem_rows = {
            row[0]: row[1:]
            for row in connection.execute(
                "SELECT id, seq_len, head_dim, batch, heads, causal, dtype FROM problems"
            )
        }
        environment_rows = {
            row[0]: row[1] for row in connection.execute("SELECT id, gpu_name FROM environments")
        }
        pointers = {
            (row[0], row[1]): row[2]
            for row in connection.execute(
                "SELECT problem_id, environment_id, plan_id FROM best_plans"
            )
        }
        connection.execute("COMMIT")
    finally:
        connection.close()
    found: list[str] = []
    by_id = {plan[0]: plan for plan in plans}
    fastest: dict[tuple[int, int], float] = {}
    for plan_id, problem_id, environment_id, median, study, number, params in plans:
        if problem_id not in problem_rows or environment_id not in environment_rows:
            found.append(f"plan {plan_id} without its problem or environment row")
            continue
        shape, environment, expected = intended(study, number)
        s = SHAPES[shape]
        identity = (s.seq_len, s.head_dim, s.batch, s.heads, int(s.causal), s.dtype)
        if tuple(problem_rows[problem_id]) != identity:
            found.append(f"plan {plan_id}: problem row {problem_rows[problem_id]} != {identity}")
        if environment_rows[environment_id] != ENVIRONMENTS[environment].gpu_name:
            found.append(f"plan {plan_id}: environment row of another GPU")
        if median != expected.median_ms or json.loads(params) != expected.params:
            found.append(f"plan {plan_id}: fields differ from what was written")
        key = (problem_id, environment_id)
        fastest[key] = min(fastest.get(key, 1e9), median)
    if set(pointers) != set(fastest):
        found.append(f"best pointers {sorted(pointers)} != pairs with plans {sorted(fastest)}")
    for key, plan_id in pointers.items():
        plan = by_id.get(plan_id)
        if plan is None or (plan[1], plan[2]) != key:
            found.append(f"best pointer {key} -> plan {plan_id} of another pair or none")
        elif plan[3] != fastest.get(key):
            found.append(f"best pointer {key} -> {plan[3]} ms, not the fastest {fastest[key]}")
    used_problems = {plan[1] for plan in plans}
    used_environments = {plan[2] for plan in plans}
    if set(problem_rows) - used_problems or set(environment_rows) - used_environments:
        found.append("a problem or environment row without any plan (a half transaction)")
    return found


# ---------------------------------------------------------------- the test


@pytest.fixture
def context() -> Iterator[Any]:
    # Forked, not spawned: a child starts in milliseconds with the modules loaded. The
    # test process holds no database connection when it forks (the registry it opens
    # to create the file is closed first).
    forked = multiprocessing.get_context("fork")
    yield forked
    for child in forked.active_children():  # only on failure: the test reaps its own
        child.kill()
        child.join()


def test_killed_writers_lose_no_commit_and_readers_never_see_half_a_plan(
    tmp_path: Path, context: Any
) -> None:
    path = tmp_path / "plans.sqlite"
    url = f"sqlite:///{path}"
    PlanRegistry.open(url).close()
    rng = random.Random(SEED)
    stop = context.Event()
    readers = [
        context.Process(
            target=reader_main, args=(url, str(path), stop, str(tmp_path / f"reader{i}.json"))
        )
        for i in range(READERS)
    ]
    for reader in readers:
        reader.start()
    logs: list[Path] = []
    for round_ in range(ROUNDS):
        writers = []
        for index in range(WRITERS):
            log = tmp_path / f"writer-{round_}-{index}.log"
            ready = context.Event()
            study = f"round{round_}-writer{index}"
            process = context.Process(target=writer_main, args=(url, study, str(log), ready))
            process.start()
            writers.append((process, ready))
            logs.append(log)
        for _, ready in writers:
            assert ready.wait(60), "a writer did not start"
        # Each writer dies at its own random moment, most of them mid-transaction.
        for process, _ in writers:
            time.sleep(rng.uniform(0.05, 0.4))
            os.kill(process.pid, signal.SIGKILL)
        for process, _ in writers:
            process.join(30)
            assert process.exitcode == -signal.SIGKILL
    time.sleep(0.3)  # the readers poll the final state too
    stop.set()
    for reader in readers:
        reader.join(60)
        assert reader.exitcode == 0

    committed = [
        line.split() for log in logs if log.exists() for line in log.read_text().split("\n") if line
    ]
    assert len(committed) >= ROUNDS * WRITERS  # the writers got going before they died
    with PlanRegistry.open(url, readonly=True) as registry:
        history = registry.history(limit=None)
        by_id = {(h.record.study_name, h.record.trial_number): h for h in history}
        for study, number in committed:
            stored = by_id.get((study, int(number)))
            assert stored is not None, f"committed plan {study} {number} is lost"
            assert check_stored(stored) == []
        # Plans committed but killed before their log line are there too, and intact.
        assert all(check_stored(h) == [] for h in history)
        for shape in SHAPES:
            for environment in ENVIRONMENTS:
                times = [
                    h.record.ranking_ms
                    for h in history
                    if (h.problem, h.environment) == (shape, environment)
                ]
                best = registry.best(shape, environment)
                assert (best is None) == (not times)
                if best is not None:
                    assert best.record.ranking_ms == min(times)
    assert check_snapshot(str(path)) == []
    connection = sqlite3.connect(path)
    try:
        assert connection.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert connection.execute("PRAGMA foreign_key_check").fetchall() == []
    finally:
        connection.close()

    for index in range(READERS):
        result = json.loads((tmp_path / f"reader{index}.json").read_text())
        assert result["problems"] == [], result["problems"]
        assert result["polls"] >= ROUNDS  # they read all along, not once
        assert 0 < result["plans_seen"] <= len(history)
