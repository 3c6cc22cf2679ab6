"""Bad input to ``python -m db``: one ``error:`` line naming the problem, a non-zero exit,
and nothing left behind (no file, no ``-wal``/``-shm``, no row changed).

Each case runs the real command (``db.cli.main``, in-process: what ``python -m db``
runs) in a directory holding a registry with plans and an Optuna study storage;
``verify`` is given the measuring it would get on this machine (none: no GPU).
Rows no tuner could produce are written into otherwise good exports, one fault
each, so the refusal names that fault.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import pytest

from db import PlanRecord, PlanRegistry
from db.cli import main
from tuner.environment import Environment
from tuner.problem import Problem

H200 = Environment("NVIDIA H200", "9.0", 132, "570.86", "12.8", "12.8.61", "2025.1.2")
TILED = {"threads": 128, "tile_size": 32, "rows_per_block": 32, "split_target": 4}


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("seeded")
    url = f"sqlite:///{directory / 'plans.sqlite'}"
    with PlanRegistry.open(url) as registry:
        registry.record(Problem(1024, 64), H200, PlanRecord("tiled", TILED, "t", True, 0.5))
        registry.record(
            Problem(1024, 64, dtype="bfloat16"), H200, PlanRecord("mma_f16", {}, "m", True, 0.1)
        )
        registry.export(directory / "good.json")
    storage = optuna.storages.RDBStorage(f"sqlite:///{directory / 'studies.sqlite'}")
    optuna.create_study(storage=storage, study_name="s").optimize(lambda t: 1.0, n_trials=1)
    storage.engine.dispose()
    (directory / "truncated.sqlite").write_bytes((directory / "plans.sqlite").read_bytes()[:3000])
    (directory / "notes.txt").write_text("not a database\n")
    (directory / "folder").mkdir()
    return directory


def bad_row(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    """A setup writing ``bad.json``: the good export with its first row changed."""

    def setup(directory: Path) -> None:
        document = json.loads((directory / "good.json").read_text())
        change(document["plans"][0])
        (directory / "bad.json").write_text(json.dumps(document))

    return setup


def problem(**values: Any) -> Callable[[Path], None]:
    return bad_row(lambda row: row["problem"].update(values))


def plan(**values: Any) -> Callable[[Path], None]:
    return bad_row(lambda row: row["plan"].update(values))


def environment(**values: Any) -> Callable[[Path], None]:
    return bad_row(lambda row: row["environment"].update(values))


def document(text: str) -> Callable[[Path], None]:
    def setup(directory: Path) -> None:
        (directory / "bad.json").write_text(text)

    return setup


@dataclass(frozen=True)
class Case:
    args: tuple[str, ...]  # {dir} is the case's directory, {url} its registry
    says: tuple[str, ...]  # what the one error line must contain
    setup: Callable[[Path], None] | None = None


IMPORT = ("import", "{dir}/bad.json", "--url", "{url}")
SHAPE = ("--seq-len", "1024", "--head-dim", "64", "--url", "{url}")
STUDY = "sqlite:///{dir}/studies.sqlite"

CASES: dict[str, Case] = {
    # -- export to where it cannot go -----------------------------------------------------
    "export to a directory": Case(
        ("export", "{dir}/folder", "--url", "{url}"), ("is a directory",)
    ),
    "export under a plain file": Case(
        ("export", "{dir}/notes.txt/plans.json", "--url", "{url}"), ("cannot write export",)
    ),
    "export of a study storage": Case(
        ("export", "{dir}/e.json", "--url", STUDY), ("Optuna study",)
    ),
    # -- rows no tuner could produce: the whole file is refused ---------------------------
    "import seq_len negative": Case(
        IMPORT, ("seq_len=-4096", "1..4294967295"), problem(seq_len=-4096)
    ),
    "import seq_len zero": Case(IMPORT, ("seq_len=0",), problem(seq_len=0)),
    "import seq_len text": Case(IMPORT, ("seq_len=4096",), problem(seq_len="4096")),
    "import head_dim zero": Case(IMPORT, ("head_dim=0",), problem(head_dim=0)),
    "import batch zero": Case(IMPORT, ("batch=0",), problem(batch=0)),
    "import heads negative": Case(IMPORT, ("heads=-1",), problem(heads=-1)),
    "import dtype int8": Case(
        IMPORT, ("dtype=int8", "bfloat16, float16, float32"), problem(dtype="int8")
    ),
    "import causal text": Case(IMPORT, ("causal=yes", "true or false"), problem(causal="yes")),
    "import kv_heads not dividing": Case(
        IMPORT, ("kv_heads=3", "must divide heads=1"), problem(kv_heads=3)
    ),
    "import causal kv shorter": Case(
        IMPORT, ("kv_len=10", "causal=true"), problem(causal=True, kv_len=10)
    ),
    "import precision unknown": Case(IMPORT, ("precision=tf16",), problem(precision="tf16")),
    "import seq_len over u32": Case(IMPORT, ("seq_len=4294967296",), problem(seq_len=2**32)),
    "import unknown family": Case(IMPORT, ("unknown kernel family 'warp9'",), plan(family="warp9")),
    "import family of another dtype": Case(
        IMPORT,
        ("family mma_f16 takes bfloat16/float16, not the problem's float32",),
        plan(family="mma_f16", params={}),
    ),
    "import unknown tunable": Case(IMPORT, ("no tunable 'warps'",), plan(params={"warps": 4})),
    "import tunable negative": Case(IMPORT, ("threads=-5",), plan(params=TILED | {"threads": -5})),
    "import tunable zero": Case(IMPORT, ("tile_size=0",), plan(params=TILED | {"tile_size": 0})),
    "import median negative": Case(IMPORT, ("median_ms=-1", "a number > 0"), plan(median_ms=-1)),
    "import median zero": Case(IMPORT, ("median_ms=0",), plan(median_ms=0)),
    "import predicted negative": Case(IMPORT, ("predicted_ms=-0.5",), plan(predicted_ms=-0.5)),
    "import spread negative": Case(IMPORT, ("spread_ms=-0.1", ">= 0"), plan(spread_ms=-0.1)),
    "import tflops negative": Case(IMPORT, ("tflops=-3",), plan(tflops=-3)),
    "import error negative": Case(IMPORT, ("max_abs_error=-1",), plan(max_abs_error=-1)),
    "import median not finite": Case(IMPORT, ("finite",), plan(median_ms=float("inf"))),
    "import measured without a time": Case(
        IMPORT, ("a measured plan needs median_ms",), plan(median_ms=None)
    ),
    "import measured on the model": Case(
        IMPORT, ("gpu_name 'model'", "cannot be measured"), environment(gpu_name="model")
    ),
    "import empty gpu name": Case(
        IMPORT, ("gpu_name must be a non-empty",), environment(gpu_name="")
    ),
    "import sm_count zero": Case(IMPORT, ("sm_count=0",), environment(sm_count=0)),
    "import unknown plan field": Case(IMPORT, ("unknown plan fields",), plan(colour="red")),
    "import naive timestamp": Case(
        IMPORT,
        ("created_at has no time zone",),
        bad_row(lambda row: row.update(created_at="2026-12-01T10:00:00")),
    ),
    "import another format": Case(IMPORT, ("not a plan registry export",), document('{"a": 1}')),
    "import a newer version": Case(
        IMPORT,
        ("export format version 2",),
        document('{"format": "flash-attention-tuner/plan-registry", "version": 2, "plans": []}'),
    ),
    "import plans not a list": Case(
        IMPORT,
        ("'plans' must be a list",),
        document('{"format": "flash-attention-tuner/plan-registry", "version": 1, "plans": 3}'),
    ),
    "import not JSON": Case(IMPORT, ("is not JSON",), document("plans, honest\n")),
    "import a directory": Case(("import", "{dir}/folder", "--url", "{url}"), ("Is a directory",)),
    "import into a study storage": Case(
        ("import", "{dir}/good.json", "--url", STUDY), ("is an Optuna study storage",)
    ),
    # -- registries that are not registries ------------------------------------------------
    "list of a study storage": Case(("list", "--url", STUDY), ("is an Optuna study storage",)),
    "best of a study storage": Case(("best", *SHAPE[:4], "--url", STUDY), ("Optuna study",)),
    "upgrade of a study storage": Case(("upgrade", "--url", STUDY), ("Optuna study storage",)),
    "list of a truncated registry": Case(
        ("list", "--url", "sqlite:///{dir}/truncated.sqlite"), ("not a readable plan registry",)
    ),
    "best of a truncated registry": Case(
        ("best", *SHAPE[:4], "--url", "sqlite:///{dir}/truncated.sqlite"), ("malformed",)
    ),
    "verify of a truncated registry": Case(
        ("verify", "--url", "sqlite:///{dir}/truncated.sqlite"), ("not a readable plan",)
    ),
    "history of a text file": Case(
        ("history", "--url", "sqlite:///{dir}/notes.txt"), ("not a readable plan registry",)
    ),
    "list of a directory": Case(("list", "--url", "sqlite:///{dir}/folder"), ("is a directory",)),
    "verify of a missing registry": Case(
        ("verify", "--url", "sqlite:///{dir}/none.sqlite"), ("does not exist",)
    ),
    # -- arguments refused (checked before, or without, a GPU) ----------------------------
    "verify without a GPU": Case(("verify", "--url", "{url}"), ("re-measures plans on a GPU",)),
    "verify threshold below 1": Case(
        ("verify", "--threshold", "0.5", "--url", "{url}"), ("--threshold", "above 1")
    ),
    "verify threshold text": Case(
        ("verify", "--threshold", "fast", "--url", "{url}"), ("'fast' is not a number",)
    ),
    "verify threshold infinite": Case(
        ("verify", "--threshold", "inf", "--url", "{url}"), ("finite",)
    ),
    "verify dtype": Case(("verify", "--dtype", "int8", "--url", "{url}"), ("invalid choice",)),
    "best kv_heads not dividing": Case(
        ("best", *SHAPE, "--heads", "4", "--kv-heads", "3"), ("kv_heads=3 must divide heads=4",)
    ),
    "best causal kv shorter": Case(
        ("best", *SHAPE, "--causal", "--kv-len", "10"), ("causal with seq_len=1024 > kv_len=10",)
    ),
    "best precision for bf16": Case(
        ("best", *SHAPE, "--precision", "tf32"), ("applies to --dtype float32 only",)
    ),
    "best batch zero": Case(("best", *SHAPE, "--batch", "0"), ("0 is not positive",)),
    "history limit zero": Case(("history", "--limit", "0", "--url", "{url}"), ("not positive",)),
    "list dtype float64": Case(("list", "--dtype", "float64", "--url", "{url}"), ("float64",)),
    "best source hash": Case(("best", *SHAPE, "--source-hash", "tiled"), ("FAMILY=HASH",)),
    "best without head_dim": Case(
        ("best", "--seq-len", "1024", "--url", "{url}"), ("both --seq-len and --head-dim",)
    ),
}


def snapshot(directory: Path) -> dict[str, str]:
    """Every file by content hash (rows of SQLite files by count): nothing may appear or change."""
    state = {}
    for path in sorted(directory.rglob("*")):
        if path.is_dir():
            state[str(path.relative_to(directory))] = "dir"
            continue
        data = path.read_bytes()
        if data.startswith(b"SQLite format 3\x00") and path.name != "truncated.sqlite":
            with sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True) as connection:
                tables = [
                    r[0]
                    for r in connection.execute(
                        "SELECT name FROM sqlite_master WHERE type='table' ORDER BY name"
                    )
                ]
                counts = [
                    connection.execute(f'SELECT COUNT(*) FROM "{t}"').fetchone()[0] for t in tables
                ]
            connection.close()
            state[str(path.relative_to(directory))] = json.dumps(
                dict(zip(tables, counts, strict=True))
            )
        else:
            state[str(path.relative_to(directory))] = hashlib.sha256(data).hexdigest()
    return state


def test_there_are_many_distinct_cases() -> None:
    assert len(CASES) >= 60
    assert len({(case.args, case.setup) for case in CASES.values()}) == len(CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_and_leaves_nothing(
    name: str, seeded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    case = CASES[name]
    directory = tmp_path / "case"
    shutil.copytree(seeded, directory)
    if case.setup is not None:
        case.setup(directory)
    before = snapshot(directory)
    fill = {"{dir}": str(directory), "{url}": f"sqlite:///{directory / 'plans.sqlite'}"}
    arguments = list(case.args)
    for placeholder, value in fill.items():
        arguments = [a.replace(placeholder, value) for a in arguments]
    try:
        status = main(arguments)
    except SystemExit as exit_:  # argparse's own refusals
        status = exit_.code
    captured = capsys.readouterr()
    assert status not in (0, None), captured
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("python -m db") and "error: " in lines[0]
    assert "Traceback" not in captured.err + captured.out
    for words in case.says:
        assert words in lines[0], lines[0]
    assert snapshot(directory) == before
    assert not [p for p in directory.rglob("*") if p.name.endswith(("-wal", "-shm", ".partial"))]
