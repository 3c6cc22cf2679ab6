"""The registry keeps attention variants apart, and registries and exports from before them
read as plain attention.

A windowed, softcapped, ALiBi or sinks problem is its own row (migration 0006 adds the five
columns to the problems' unique key); the nearest-shape fallback never crosses variants; the
db CLI names, filters and lists them; exports carry them, and an export written before the
variants existed imports as no variant.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest
from sqlalchemy import create_engine

from db import PlanRecord, PlanRegistry, upgrade_registry
from db.cli import main
from db.ranking import same_family_of_shapes
from db.schema import HEAD_REVISION, alembic_config
from kernels.plan_choice import PlanChooser
from tuner.device import H200 as H200_PROFILE
from tuner.environment import Environment
from tuner.problem import Problem

FROZEN_0001 = Path(__file__).parent / "data" / "registry_0001.sqlite"
#: the revision before the variants (0006): the one constant to change when it is re-chained
PREVIOUS_REVISION = "0005"
H200 = Environment("NVIDIA H200", "9.0", 132, "580.159", "13.0", "13.0.88", "2026.1")
MMA = {
    "block_m": 64, "block_n": 64, "warps": 4, "stages": 2, "q_in_registers": 0, "s_groups": 1,
    "split_target": 1 << 16,
}


def shape(seq_len: int = 4096, **variants) -> Problem:
    return Problem(seq_len, 128, heads=32, kv_heads=8, causal=True, dtype="bfloat16", **variants)


DENSE = shape()
WINDOWED = shape(window_left=1024)
VARIANTS = [
    WINDOWED,
    shape(window_left=512),
    shape(window_left=1024, window_right=0),  # causal: the right bound is the diagonal
    shape(softcap=50.0),
    shape(softcap=30.0),
    shape(alibi=True),
    shape(sinks=True),
    shape(window_left=1024, softcap=50.0, alibi=True, sinks=True),
]


def record(median_ms: float) -> PlanRecord:
    return PlanRecord("mma_f16", MMA, "h", True, median_ms=median_ms, max_abs_error=1e-3)


@pytest.fixture
def registry(tmp_path: Path):
    with PlanRegistry.open(f"sqlite:///{tmp_path / 'plans.sqlite'}") as handle:
        yield handle


def test_each_variant_has_its_own_best_plan(registry: PlanRegistry) -> None:
    problems = [DENSE, *VARIANTS]
    assert len(set(problems)) == len(problems) - 1  # (1024, 0) is (1024, -1) under causal
    for index, problem in enumerate(problems):
        registry.record(problem, H200, record(1.0 + index))
    for index, problem in enumerate(problems):
        found = registry.best(problem, H200)
        assert found is not None and found.problem == problem
        # (1024, 0) recorded 4.0 for WINDOWED's row, whose 2.0 stays best
        assert found.record.median_ms == (2.0 if problem == WINDOWED else 1.0 + index)
    assert len(registry.list_best()) == len(problems) - 1


def test_the_nearest_shape_never_crosses_variants(registry: PlanRegistry) -> None:
    registry.record(shape(8192, window_left=1024), H200, record(2.0))
    registry.record(shape(8192, softcap=50.0), H200, record(3.0))
    assert registry.best(DENSE, H200, nearest=True) is None  # never a windowed or capped plan
    assert registry.best(shape(window_left=512), H200, nearest=True) is None  # another window
    assert registry.best(shape(softcap=30.0), H200, nearest=True) is None  # another cap
    assert registry.best(shape(alibi=True), H200, nearest=True) is None
    found = registry.best(WINDOWED, H200, nearest=True)
    assert found is not None and found.fallback and found.problem == shape(8192, window_left=1024)
    registry.record(shape(16384), H200, record(9.0))
    assert registry.best(WINDOWED, H200, nearest=True).record.median_ms == 2.0  # type: ignore[union-attr]
    dense = registry.best(DENSE, H200, nearest=True)
    assert dense is not None and dense.problem == shape(16384)  # a dense plan for dense only
    for problem in VARIANTS:
        assert not same_family_of_shapes(problem, DENSE)
        assert not same_family_of_shapes(DENSE, problem)
        assert same_family_of_shapes(problem, problem)


def test_the_chooser_refuses_a_plan_of_another_variant_from_a_handle_that_ignores_them(
    registry: PlanRegistry,
) -> None:
    registry.record(DENSE, H200, record(1.0))
    stored = registry.best(DENSE, H200)

    class IgnoresVariants:
        url = "test://ignores-variants"

        def cached_best(self, problem, environment, **_):
            return stored

    chooser = PlanChooser(
        IgnoresVariants(), H200, H200_PROFILE, source_hashes={}, check=lambda plan: plan
    )
    chosen = chooser.plan_for(WINDOWED)
    assert chosen.origin == "default"
    assert chosen.warnings[0].startswith(
        f"registry test://ignores-variants answered {WINDOWED.label()} with a plan stored for "
        "bfloat16; not used"
    )
    assert chooser.plan_for(DENSE).origin == "registry"


def test_a_registry_from_before_the_variants_upgrades_and_reads_them_as_none(
    tmp_path: Path,
) -> None:
    from alembic import command

    path = tmp_path / "registry_0005.sqlite"
    shutil.copy(FROZEN_0001, path)
    url = f"sqlite:///{path}"
    engine = create_engine(url)
    with engine.begin() as connection:
        config = alembic_config()
        config.attributes["connection"] = connection
        command.upgrade(config, PREVIOUS_REVISION)
    engine.dispose()
    connection = sqlite3.connect(path)
    columns = [row[1] for row in connection.execute("PRAGMA table_info(problems)")]
    assert "window_left" not in columns and "sinks" not in columns
    # A half-precision GQA shape beside the frozen float32 ones, as 0005 writes rows.
    connection.execute(
        "INSERT INTO problems (seq_len, head_dim, batch, heads, causal, dtype, kv_heads, kv_len,"
        " precision) VALUES (4096, 128, 1, 32, 1, 'bfloat16', 8, 4096, '')"
    )
    before = connection.execute("SELECT id FROM problems ORDER BY id").fetchall()
    connection.commit()
    connection.close()

    assert upgrade_registry(url) == (PREVIOUS_REVISION, HEAD_REVISION)
    connection = sqlite3.connect(path)
    rows = connection.execute(
        "SELECT id, window_left, window_right, softcap, alibi, sinks FROM problems ORDER BY id"
    ).fetchall()
    assert connection.execute("PRAGMA foreign_key_check").fetchall() == []
    connection.close()
    assert [row[0] for row in rows] == [row[0] for row in before]
    assert {row[1:] for row in rows} == {(-1, -1, 0.0, 0, 0)}

    h200_0001 = Environment("NVIDIA H200", "9.0", 132, "570.86", "12.8", "12.8.61", "")
    with PlanRegistry.open(url) as registry:
        best = registry.best(Problem(4096, 128), h200_0001)
        assert best is not None and best.record.median_ms == 0.8125
        assert not best.problem.has_variant
        windowed = Problem(4096, 128, window_left=256)
        assert registry.best(windowed, h200_0001) is None
        assert registry.best(windowed, h200_0001, nearest=True) is None
        # the same shape with a window is a new row beside the old one
        registry.record(windowed, h200_0001, record(0.3))
        assert registry.best(windowed, h200_0001).record.median_ms == 0.3  # type: ignore[union-attr]
        assert registry.best(Problem(4096, 128), h200_0001).record.median_ms == 0.8125  # type: ignore[union-attr]


# ---------------------------------------------------------------------------- CLI, export


def cli_shape(registry: PlanRegistry) -> list[str]:
    return [
        "--url", registry.url, "--seq-len", "4096", "--head-dim", "128", "--heads", "32",
        "--kv-heads", "8", "--causal",
    ]


def test_the_db_cli_names_filters_and_lists_variants(registry: PlanRegistry, capsys) -> None:
    for index, problem in enumerate([DENSE, *VARIANTS]):
        registry.record(problem, H200, record(1.0 + index))
    args = cli_shape(registry)
    every = ["--window-left", "1024", "--softcap", "50", "--alibi", "--sinks"]
    assert main(["best", *args, *every]) == 0
    out = capsys.readouterr().out
    assert "x128 bfloat16 causal window=1024 softcap=50 alibi sinks on NVIDIA H200: " in out
    assert main(["best", *args, "--window-left", "2048"]) == 3  # no such window stored
    assert "no plan for 1x32/8x4096x128 bfloat16 causal window=2048" in capsys.readouterr().out
    assert main(["best", *args, "--json"]) == 0
    problem = json.loads(capsys.readouterr().out)["problem"]
    assert (problem["window_left"], problem["softcap"], problem["alibi"]) == (-1, 0.0, False)

    def listed(*filters: str) -> list[str]:
        assert main(["list", "--url", registry.url, *filters]) == 0
        return capsys.readouterr().out.splitlines()

    assert len(listed()) == len(VARIANTS)  # every shape, dense included, (1024, 0) merged
    assert [line.split(": ")[0].split(" ", 1)[1] for line in listed("--plain")] == [
        "1x32/8x4096x128 bfloat16 causal on NVIDIA H200"
    ]
    windowed = listed("--window-left", "1024")
    assert len(windowed) == 2 and all("window=1024" in line for line in windowed)
    assert len(listed("--softcap", "50")) == 2
    assert len(listed("--alibi", "--sinks")) == 1
    assert listed("--window-left", "1024", "--softcap", "30") == []
    for bad in (["--window-left", "-2"], ["--softcap", "-1"], ["--softcap", "nan"]):
        with pytest.raises(SystemExit) as exited:
            main(["list", "--url", registry.url, *bad])
        assert exited.value.code == 2
        assert "error: argument" in capsys.readouterr().err


def test_exports_carry_the_variants_and_old_exports_import_as_none(
    registry: PlanRegistry, tmp_path: Path
) -> None:
    registry.record(DENSE, H200, record(1.0))
    registry.record(VARIANTS[-1], H200, record(2.0))
    exported = tmp_path / "plans.json"
    assert registry.export(exported) == 2
    document = json.loads(exported.read_text())
    assert {(p["problem"]["window_left"], p["problem"]["sinks"]) for p in document["plans"]} == {
        (-1, False), (1024, True)
    }
    with PlanRegistry.open(f"sqlite:///{tmp_path / 'copy.sqlite'}") as copy:
        assert copy.import_(exported).added == 2
        assert copy.best(VARIANTS[-1], H200).record.median_ms == 2.0  # type: ignore[union-attr]
        assert copy.best(DENSE, H200).record.median_ms == 1.0  # type: ignore[union-attr]

    # An export written before the variants existed: problems without the five fields.
    for entry in document["plans"]:
        for name in ("window_left", "window_right", "softcap", "alibi", "sinks"):
            entry["problem"].pop(name)
    old = tmp_path / "old.json"
    old.write_text(json.dumps(document))
    with PlanRegistry.open(f"sqlite:///{tmp_path / 'old.sqlite'}") as fresh:
        assert fresh.import_(old).added == 2
        (stored,) = fresh.list_best()  # both plans are the dense shape's now
        assert stored.problem == DENSE and stored.record.median_ms == 1.0
        assert fresh.best(VARIANTS[-1], H200) is None
