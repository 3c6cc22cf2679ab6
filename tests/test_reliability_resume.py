"""A tune run killed with SIGKILL at random points, then run to the end, loses nothing.

The real CLI (``python -m tuner``) on the replay backend with the H200 recording
of 1x1x4096x128 (bench/data), over a space small enough to evaluate whole: the 21
tiled candidates with 64-key tiles, 64 or 128 rows per block and 128 or 256
threads (the recording's fastest plan among them), with the grid sampler and
``search.n_trials`` above 21, so every run ends when every candidate is evaluated,
and the answer does not depend on where the kills landed.

The test watches the study's storage (read-only) and, at a seeded random number of
finished trials plus a seeded random delay (so some kills land between trials,
some in the middle of one and some in the middle of its storage writes), kills the
process with SIGKILL, three times; then the same command runs to completion. The
trials finished before each kill are all still there, unchanged; no plan is
measured twice among the finished trials; the study ends with every candidate
evaluated; both databases pass ``PRAGMA integrity_check``; and the best plan in the
registry is the one an uninterrupted run with the same seed stores.
"""

from __future__ import annotations

import io
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from hydra import compose, initialize_config_dir

from db import PlanRegistry
from tuner.app import run
from tuner.config import typed_config, validate
from tuner.problem import Problem

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / "tuner" / "conf"
RECORDING = ROOT / "bench" / "data" / "h200_1x1x4096x128.json"
PROBLEM = Problem(4096, 128)
CANDIDATES = 21
KILLS = 3
SEED = 20261202
OVERRIDES = (
    "seq_len=4096",
    "head_dim=128",
    "dtype=float32",
    "backend=replay",
    f"backend.replay_path={RECORDING}",
    "search=grid",
    "search.families=[tiled]",
    "search.tile_sizes=[64]",
    "search.rows_per_block=[64,128]",
    "search.tiled_threads=[128,256]",
    f"search.n_trials={CANDIDATES + 9}",
    "search.seed=3",
)
COUNTED_SQL = """
SELECT t.number, t.state, v.value, o.value_json, k.value_json
FROM trials t
JOIN trial_user_attributes o ON o.trial_id = t.trial_id AND o.key = 'outcome'
JOIN trial_user_attributes k ON k.trial_id = t.trial_id AND k.key = 'plan_key'
LEFT JOIN trial_values v ON v.trial_id = t.trial_id
WHERE t.state IN ('COMPLETE', 'PRUNED') AND o.value_json IN ('"measured"', '"failed"')
"""

pytestmark = pytest.mark.skipif(not RECORDING.exists(), reason="no H200 recording in bench/data")

#: number -> (state, value, outcome, plan key) of a finished trial that counts
Finished = dict[int, tuple[str, float | None, str, str]]


def urls(directory: Path) -> list[str]:
    return [
        f"registry.url=sqlite:///{directory / 'registry.sqlite'}",
        f"search.storage=sqlite:///{directory / 'study.sqlite'}",
    ]


def finished(study: Path) -> Finished:
    """The counted finished trials, read through a read-only connection (WAL lets it
    read while the tuner writes; a database still being created reads as empty)."""
    if not study.exists():
        return {}
    try:
        connection = sqlite3.connect(f"file:{study}?mode=ro", uri=True, timeout=10)
        try:
            rows = connection.execute(COUNTED_SQL).fetchall()
        finally:
            connection.close()
    except sqlite3.OperationalError:
        return {}  # no tables yet
    return {number: (state, value, outcome, key) for number, state, value, outcome, key in rows}


def integrity(path: Path) -> str:
    connection = sqlite3.connect(path)
    try:
        return connection.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        connection.close()


def kill_at(directory: Path, target: int, delay_s: float) -> tuple[Finished, str]:
    """Start the CLI, SIGKILL it ``delay_s`` after ``target`` counted trials have finished;
    the trials finished when it died, and its stderr."""
    log = directory / f"killed-at-{target}.log"
    with log.open("w") as stream:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tuner",
                *OVERRIDES,
                *urls(directory),
                f"hydra.run.dir={directory / 'run'}",
            ],
            cwd=directory,
            stdout=stream,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 120
            while len(finished(directory / "study.sqlite")) < target:
                assert process.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "the tuner finished too few trials"
                time.sleep(0.02)
            time.sleep(delay_s)
            process.send_signal(signal.SIGKILL)
            assert process.wait(timeout=30) == -signal.SIGKILL, log.read_text()
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    return finished(directory / "study.sqlite"), log.read_text()


def test_killed_three_times_then_resumed_loses_and_repeats_nothing(tmp_path: Path) -> None:
    reference = tmp_path / "uninterrupted"
    reference.mkdir()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*OVERRIDES, *urls(reference)])
    out = io.StringIO()
    assert run(validate(typed_config(cfg)), out=out) == 0
    assert "every candidate within the traffic cutoff is evaluated" in out.getvalue()
    expected = finished(reference / "study.sqlite")
    assert len(expected) == CANDIDATES

    killed = tmp_path / "killed"
    killed.mkdir()
    rng = random.Random(SEED)
    kept: Finished = {}
    for _ in range(KILLS):
        # 1 to 4 more finished trials, then 0 to 150 ms (about two trials) more.
        target = len(kept) + rng.randint(1, 4)
        seen, log = kill_at(killed, target, delay_s=rng.uniform(0.0, 0.15))
        assert "Traceback" not in log
        # Completed trials are kept, as they were; each run got somewhere.
        assert {n: seen[n] for n in kept} == kept
        assert len(seen) > len(kept) and len(seen) < CANDIDATES
        kept = seen

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tuner",
            *OVERRIDES,
            *urls(killed),
            f"hydra.run.dir={killed / 'run'}",
        ],
        cwd=killed,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "stopped: every candidate within the traffic cutoff is evaluated" in done.stdout
    resumed = finished(killed / "study.sqlite")
    assert {n: resumed[n] for n in kept} == kept
    # Nothing measured twice: one finished measured trial per candidate, the same
    # candidates as the uninterrupted run, and this last run measured only the rest.
    keys = [key for _, _, _, key in resumed.values()]
    assert len(keys) == len(set(keys)) == CANDIDATES
    assert set(keys) == {key for _, _, _, key in expected.values()}
    assert f"{CANDIDATES - len(kept)} in this run" in done.stdout
    # Trials a kill cut short stay unfinished (their heartbeat fails them later); none
    # of them counts, and no finished trial repeats a plan.
    storage = f"sqlite:///{killed / 'study.sqlite'}"
    (name,) = optuna.get_all_study_names(storage)
    trials = optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
    measured = [t for t in trials if t.user_attrs.get("measured") is True]
    unfinished = [t for t in measured if not t.state.is_finished()]
    assert len(unfinished) <= KILLS
    assert len(measured) - len(unfinished) == CANDIDATES + sum(
        t.user_attrs.get("outcome") == "duplicate" for t in measured if t.state.is_finished()
    )

    for directory in (reference, killed):
        assert integrity(directory / "registry.sqlite") == "ok"
        assert integrity(directory / "study.sqlite") == "ok"
    with (
        PlanRegistry.open(f"sqlite:///{reference / 'registry.sqlite'}", readonly=True) as first,
        PlanRegistry.open(f"sqlite:///{killed / 'registry.sqlite'}", readonly=True) as second,
    ):
        uninterrupted, after_kills = first.best(PROBLEM), second.best(PROBLEM)
        assert len(second.history(limit=None)) == 1  # only the run that finished stored
    assert uninterrupted is not None and after_kills is not None
    assert not after_kills.record.measured  # replayed timings are stored as predicted
    assert (after_kills.record.family, after_kills.record.params) == (
        uninterrupted.record.family,
        uninterrupted.record.params,
    )
    assert after_kills.record.median_ms == uninterrupted.record.median_ms
    assert after_kills.environment == uninterrupted.environment
