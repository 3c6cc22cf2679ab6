"""More bad input at the real command line, next to an existing registry and study.

tests/test_cli_validation.py checks the first cases (shape values, unknown keys and
options, n_trials, a negative search timeout, a sampler, head_dim=4096, override
syntax) in empty directories. These add the rest: other keys' ranges, shapes with
no feasible plan for other reasons, replay files that cannot serve, and registry
and study databases that cannot be used. Each runs ``python -m tuner`` in a
directory that already holds a registry and a study with rows (made by a short
tune run of the same problem), with ``search.n_trials`` above what the study has,
so a run that went ahead would be seen writing. Each must end with one
``error:`` line on stderr naming the problem, exit status 1, no traceback, and
every database and file in the directory unchanged (rows counted per table before
and after; other files by content).

A missing directory for a SQLite registry or study is not an error: the run
creates it (``test_a_missing_directory_is_created_for_the_registry_and_study``).
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from db import PlanRegistry
from tuner.app import run
from tuner.config import typed_config, validate
from tuner.problem import Problem

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / "tuner" / "conf"
FROZEN_0001 = ROOT / "tests" / "data" / "registry_0001.sqlite"
REPLAY_FIXTURE = ROOT / "tests" / "data" / "replay_model_512x64.json"
PROBLEM = Problem(512, 64)
BASE = ("seq_len=512", "head_dim=64", "backend=model", "search.n_trials=6", "dtype=float32")
SEEDED_TRIALS = 3
SQLITE_MAGIC = b"SQLite format 3\x00"


def _plain_file(workdir: Path) -> None:
    (workdir / "plain.txt").write_text("not a database\n")


def _folder(workdir: Path) -> None:
    (workdir / "folder").mkdir()


def _newer_registry(workdir: Path) -> None:
    shutil.copy(workdir / "r.sqlite", workdir / "newer.sqlite")
    with sqlite3.connect(workdir / "newer.sqlite") as connection:
        connection.execute("UPDATE alembic_version SET version_num = '0099'")
    connection.close()


def _older_registry(workdir: Path) -> None:
    shutil.copy(FROZEN_0001, workdir / "older.sqlite")


def _replay_files(workdir: Path) -> None:
    (workdir / "not.json").write_text("recorded timings, honest\n")
    (workdir / "other.json").write_text('{"recordings": []}\n')


def _other_stores(workdir: Path) -> None:
    shutil.copy(workdir / "r.sqlite", workdir / "another_registry.sqlite")
    shutil.copy(workdir / "s.sqlite", workdir / "another_study.sqlite")
    (workdir / "truncated.sqlite").write_bytes((workdir / "r.sqlite").read_bytes()[:3000])


RECORDING_FLOAT32 = ROOT / "bench" / "data" / "h200_1x1x4096x128.json"


@dataclass(frozen=True)
class Case:
    #: overrides after BASE; ``{dir}`` is the case's directory
    overrides: tuple[str, ...]
    #: texts the error line must contain (the key or thing at fault, and what is wrong)
    says: tuple[str, ...]
    setup: Callable[[Path], None] | None = None


CASES: dict[str, Case] = {
    # -- values out of range, keys not covered by test_cli_validation ---------------------
    "trial timeout negative": Case(
        ("search.trial_timeout_s=-1",), ("search.trial_timeout_s=-1", "a number > 0")
    ),
    "trial timeout zero": Case(
        ("search.trial_timeout_s=0",), ("search.trial_timeout_s=0", "a number > 0")
    ),
    "search timeout zero": Case(("search.timeout_s=0",), ("search.timeout_s=0", "> 0 or null")),
    "traffic cutoff below 1": Case(
        ("search.traffic_cutoff=0.5",), ("search.traffic_cutoff=0.5", "a number >= 1")
    ),
    "enqueue_top negative": Case(
        ("search.enqueue_top=-1",), ("search.enqueue_top=-1", "an integer >= 0")
    ),
    "seed negative": Case(("search.seed=-1",), ("search.seed=-1", "0..4294967295")),
    "unknown family": Case(
        ("search.families=[foo]",), ("search.families=[foo]", "scalar_online, tiled")
    ),
    "empty tile list": Case(
        ("search.tile_sizes=[]",), ("search.tile_sizes=[]", "a non-empty list of integers")
    ),
    "repetitions zero": Case(
        ("backend.repetitions=0",), ("backend.repetitions=0", "an integer >= 1")
    ),
    "warmup negative": Case(("backend.warmup=-1",), ("backend.warmup=-1", "an integer >= 0")),
    "isolate not a bool": Case(("backend.isolate=maybe",), ("backend.isolate=maybe", "true or")),
    "heads zero": Case(("heads=0",), ("heads=0", "1..4294967295")),
    "head_dim negative": Case(("head_dim=-64",), ("head_dim=-64", "1..4294967295")),
    "device limit zero": Case(("device.sm_count=0",), ("device.sm_count=0", "an integer >= 1")),
    "plan_rows negative": Case(("plan_rows=-1",), ("plan_rows=-1", "an integer >= 0")),
    "empty study name": Case(
        ("search.study_name=''",), ("search.study_name=''", "a non-empty string")
    ),
    "malformed registry URL": Case(
        ("registry.url=not-a-url",), ("registry.url=not-a-url", "a SQLAlchemy URL")
    ),
    "malformed storage URL": Case(
        ("search.storage=://nowhere",), ("search.storage=://nowhere", "a SQLAlchemy URL")
    ),
    # -- no feasible plan, for reasons other than a huge head_dim -------------------------
    "head_dim the tiled kernel cannot take": Case(
        ("head_dim=6", "search.families=[tiled]"),
        ("head_dim=6", "no candidate plan is feasible", "not a multiple of 4"),
    ),
    "device with too little shared memory": Case(
        ("device.max_shared_memory_per_block_optin=16",),
        ("no candidate plan is feasible", "opt-in limit 16 B"),
    ),
    # -- replay files that cannot serve ----------------------------------------------------
    "replay without a file": Case(
        ("backend=replay",), ("backend.replay_path=null", "backend=replay needs")
    ),
    "replay file missing": Case(
        ("backend=replay", "backend.replay_path={dir}/absent.json"),
        ("{dir}/absent.json", "No such file"),
    ),
    "replay file not JSON": Case(
        ("backend=replay", "backend.replay_path={dir}/not.json"),
        ("{dir}/not.json", "is not JSON"),
        _replay_files,
    ),
    "replay file of another format": Case(
        ("backend=replay", "backend.replay_path={dir}/other.json"),
        ("{dir}/other.json", "is malformed"),
        _replay_files,
    ),
    "replay path a directory": Case(
        ("backend=replay", "backend.replay_path={dir}"), ("{dir}", "Is a directory")
    ),
    # -- registries that cannot take the result -------------------------------------------
    "registry without a driver": Case(
        ("registry.url=nosuchdb://host/plans",),
        ("nosuchdb://host/plans", "no database driver"),
    ),
    "registry under a plain file": Case(
        # Fails for root too (unlike a chmod 000 directory): a file cannot hold a folder.
        ("registry.url=sqlite:///{dir}/plain.txt/r.sqlite",),
        ("cannot create directory {dir}/plain.txt", "plan registry"),
        _plain_file,
    ),
    "registry that is not a database": Case(
        ("registry.url=sqlite:///{dir}/plain.txt",),
        ("{dir}/plain.txt", "is not a readable plan registry database"),
        _plain_file,
    ),
    "registry that is a directory": Case(
        ("registry.url=sqlite:///{dir}/folder",),
        ("registry path {dir}/folder is a directory",),
        _folder,
    ),
    "registry of a newer schema": Case(
        ("registry.url=sqlite:///{dir}/newer.sqlite",),
        ("'0099'", "python -m db upgrade --url sqlite:///{dir}/newer.sqlite"),
        _newer_registry,
    ),
    "registry of an older schema": Case(
        ("registry.url=sqlite:///{dir}/older.sqlite",),
        ("python -m db upgrade --url sqlite:///{dir}/older.sqlite",),
        _older_registry,
    ),
    # -- study storages that cannot be opened ---------------------------------------------
    "study storage under a plain file": Case(
        ("search.storage=sqlite:///{dir}/plain.txt/s.sqlite",),
        ("search.storage=sqlite:///{dir}/plain.txt/s.sqlite",),
        _plain_file,
    ),
    "study storage that is a plan registry": Case(
        ("search.storage=sqlite:///{dir}/another_registry.sqlite",),
        ("search.storage=sqlite:///{dir}/another_registry.sqlite", "is a plan registry"),
        _other_stores,
    ),
    "registry that is a study storage": Case(
        ("registry.url=sqlite:///{dir}/another_study.sqlite",),
        ("{dir}/another_study.sqlite is an Optuna study storage",),
        _other_stores,
    ),
    "registry truncated": Case(
        ("registry.url=sqlite:///{dir}/truncated.sqlite",),
        ("{dir}/truncated.sqlite is not a readable plan registry",),
        _other_stores,
    ),
    "replay of another dtype": Case(
        (
            "seq_len=4096",
            "head_dim=128",
            "dtype=bfloat16",
            "backend=replay",
            f"backend.replay_path={RECORDING_FLOAT32}",
        ),
        ("in float32, but the problem asks for dtype=bfloat16", "replay it with dtype=float32"),
    ),
    "study storage that is not a database": Case(
        ("search.storage=sqlite:///{dir}/plain.txt",),
        ("search.storage=sqlite:///{dir}/plain.txt cannot be opened", "not a database"),
        _plain_file,
    ),
}


# ---------------------------------------------------------------- the existing databases


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A registry and a study with rows, from a short tune run of the cases' problem."""
    directory = tmp_path_factory.mktemp("seeded")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=[
                *BASE[:3],
                "dtype=float32",
                f"search.n_trials={SEEDED_TRIALS}",
                *urls(directory),
            ],
        )
    status = run(validate(typed_config(cfg)), out=io.StringIO())
    assert status == 0
    for name in ("r.sqlite", "s.sqlite"):
        assert not Path(f"{directory / name}-wal").exists()  # checkpointed on close
        counts = table_counts(directory / name)
        assert counts and any(counts.values())
    return directory


def urls(directory: Path) -> list[str]:
    return [
        f"registry.url=sqlite:///{directory / 'r.sqlite'}",
        f"search.storage=sqlite:///{directory / 's.sqlite'}",
    ]


def table_counts(path: Path) -> dict[str, int]:
    """Rows per table, read from a copy (database and WAL), so reading changes nothing."""
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch) / "copy.sqlite"
        shutil.copy(path, copy)
        if Path(f"{path}-wal").exists():
            shutil.copy(f"{path}-wal", f"{copy}-wal")
        connection = sqlite3.connect(copy)
        try:
            names = [
                row[0]
                for row in connection.execute("SELECT name FROM sqlite_master WHERE type='table'")
            ]
            return {
                name: connection.execute(f'SELECT COUNT(*) FROM "{name}"').fetchone()[0]
                for name in names
            }
        finally:
            connection.close()


def snapshot(workdir: Path) -> dict[str, object]:
    """Every file under ``workdir`` but Hydra's run directory: row counts for SQLite
    databases (their -wal/-shm files fold into those), a content hash for the rest."""
    state: dict[str, object] = {}
    for path in sorted(workdir.rglob("*")):
        relative = path.relative_to(workdir)
        if relative.parts[0] == "run" or path.is_dir():
            continue
        if path.name.endswith(("-wal", "-shm", "-journal")):
            continue
        head = path.read_bytes()[: len(SQLITE_MAGIC)]
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        try:
            state[str(relative)] = table_counts(path) if head == SQLITE_MAGIC else digest
        except sqlite3.DatabaseError:  # a damaged database (a case's own): by content
            state[str(relative)] = digest
    return state


# ---------------------------------------------------------------- the runs


def arguments(case: Case, workdir: Path) -> list[str]:
    overrides = [o.replace("{dir}", str(workdir)) for o in case.overrides]
    given = {o.partition("=")[0] for o in overrides}
    base = [o for o in (*BASE, *urls(workdir)) if o.partition("=")[0] not in given]
    return [*base, *overrides, f"hydra.run.dir={workdir / 'run'}"]


def run_cli(workdir: Path, args: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("HYDRA_FULL_ERROR", None)  # a developer's own would bring tracebacks back
    return subprocess.run(
        [sys.executable, "-m", "tuner", *args],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


@dataclass(frozen=True)
class Outcome:
    workdir: Path
    before: dict[str, object]
    after: dict[str, object]
    done: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def outcomes(seeded: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    prepared: dict[str, tuple[Path, dict[str, object]]] = {}
    for name, case in CASES.items():
        workdir = tmp_path_factory.mktemp("bad")
        for database in ("r.sqlite", "s.sqlite"):
            shutil.copy(seeded / database, workdir / database)
        if case.setup is not None:
            case.setup(workdir)
        prepared[name] = (workdir, snapshot(workdir))

    def one(name: str) -> Outcome:
        workdir, before = prepared[name]
        done = run_cli(workdir, arguments(CASES[name], workdir))
        return Outcome(workdir, before, snapshot(workdir), done)

    with ThreadPoolExecutor(max_workers=max(2, min(6, os.cpu_count() or 1))) as pool:
        return dict(zip(CASES, pool.map(one, CASES), strict=True))


def test_there_are_at_least_25_cases() -> None:
    assert len(CASES) >= 25


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_error_line_naming_the_problem(
    name: str, outcomes: dict[str, Outcome]
) -> None:
    outcome = outcomes[name]
    done = outcome.done
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: ")
    for words in CASES[name].says:
        assert words.replace("{dir}", str(outcome.workdir)) in lines[0]
    assert "HYDRA_FULL_ERROR" not in done.stderr


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_writes_nothing(name: str, outcomes: dict[str, Outcome]) -> None:
    outcome = outcomes[name]
    assert outcome.done.returncode != 0
    assert outcome.after == outcome.before
    # Nor a -wal/-shm beside a database it refused, nor a run directory.
    made = [p.name for p in outcome.workdir.iterdir() if p.name.endswith(("-wal", "-shm"))]
    assert made == [] and not (outcome.workdir / "run").exists()


def test_a_missing_directory_is_created_for_the_registry_and_study(tmp_path: Path) -> None:
    """A SQLite registry or study in a directory that does not exist yet: created, not an
    error (a first run on a fresh machine). In-process: the same app the CLI runs."""
    registry = tmp_path / "not" / "yet" / "plans.sqlite"
    study = tmp_path / "nor" / "this" / "studies.sqlite"
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=[
                *BASE[:3],
                "dtype=float32",
                "search.n_trials=2",
                f"registry.url=sqlite:///{registry}",
                f"search.storage=sqlite:///{study}",
            ],
        )
    assert run(validate(typed_config(cfg)), out=io.StringIO()) == 0
    with PlanRegistry.open(f"sqlite:///{registry}", readonly=True) as opened:
        assert opened.best(PROBLEM) is not None
    assert table_counts(study)["trials"] >= 2
