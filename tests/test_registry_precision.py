"""The registry keeps float32 precisions apart, and a registry from before precision upgrades.

A plan tuned under ``tf32`` (one-pass TF32 allowed) is never served to a caller
who asked for ``tf32x3``, not even as the nearest shape; rows from before the
precision column existed read as ``tf32x3``.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest
from sqlalchemy import create_engine

from db import PlanRecord, PlanRegistry, upgrade_registry
from db.schema import HEAD_REVISION, alembic_config
from kernels.plan_choice import PlanChooser
from tuner.device import H200 as H200_PROFILE
from tuner.environment import Environment
from tuner.problem import Problem

FROZEN_0001 = Path(__file__).parent / "data" / "registry_0001.sqlite"
#: the revision before precision (0005): the one constant to change when it is re-chained
PREVIOUS_REVISION = "0004"
H200 = Environment("NVIDIA H200", "9.0", 132, "580.159", "13.0", "13.0.88", "2026.1")
ACCURATE = Problem(4096, 128, batch=4, heads=16)
FAST = Problem(4096, 128, batch=4, heads=16, precision="tf32")
ONE_PASS = {
    "block_m": 64,
    "block_n": 64,
    "warps": 4,
    "stages": 2,
    "passes": 1,
    "split_target": 1 << 16,
}
THREE_PASS = ONE_PASS | {"passes": 3}


def record(median_ms: float, params: dict[str, int]) -> PlanRecord:
    return PlanRecord("mma_tf32", params, "h", True, median_ms=median_ms, max_abs_error=1e-6)


@pytest.fixture
def registry(tmp_path: Path):
    with PlanRegistry.open(f"sqlite:///{tmp_path / 'plans.sqlite'}") as handle:
        yield handle


def test_each_precision_has_its_own_best_plan(registry: PlanRegistry) -> None:
    registry.record(FAST, H200, record(3.0, ONE_PASS))
    registry.record(ACCURATE, H200, record(9.0, THREE_PASS))
    fast, accurate = registry.best(FAST, H200), registry.best(ACCURATE, H200)
    assert fast is not None and fast.record.params["passes"] == 1
    assert fast.problem.precision == "tf32"
    assert accurate is not None and accurate.record.params["passes"] == 3
    assert accurate.problem.precision == "tf32x3"


def test_a_tf32_plan_is_never_served_for_tf32x3(registry: PlanRegistry) -> None:
    registry.record(FAST, H200, record(3.0, ONE_PASS))
    assert registry.best(ACCURATE, H200) is None
    assert registry.best(ACCURATE, H200, nearest=True) is None
    near = Problem(8192, 128, batch=4, heads=16)
    assert registry.best(near, H200, nearest=True) is None
    fast_near = Problem(8192, 128, batch=4, heads=16, precision="tf32")
    found = registry.best(fast_near, H200, nearest=True)
    assert found is not None and found.fallback and found.problem == FAST


def test_the_chooser_falls_back_rather_than_serve_one_pass_for_tf32x3(
    registry: PlanRegistry,
) -> None:
    """A registry handle that ignored precision would still not get a one-pass plan served:
    the chooser compares precisions and re-planning refuses passes=1 for tf32x3."""
    registry.record(FAST, H200, record(3.0, ONE_PASS))
    stored = registry.best(FAST, H200)

    class IgnoresPrecision:
        url = "test://ignores-precision"

        def cached_best(self, problem, environment, **_):
            return stored

    chooser = PlanChooser(
        IgnoresPrecision(), H200, H200_PROFILE, source_hashes={}, check=lambda plan: plan
    )
    chosen = chooser.plan_for(ACCURATE)
    assert chosen.origin == "default"
    assert any("float32-tf32; not used" in note for note in chosen.warnings)
    assert chosen.plan.params.family != "mma_tf32" or chosen.plan.params.passes == 3
    assert chooser.plan_for(FAST).plan.params.passes == 1


def test_a_registry_from_before_precision_upgrades_and_reads_float32_as_tf32x3(
    tmp_path: Path,
) -> None:
    from alembic import command

    path = tmp_path / "registry_before.sqlite"
    shutil.copy(FROZEN_0001, path)
    url = f"sqlite:///{path}"
    engine = create_engine(url)
    with engine.begin() as connection:
        config = alembic_config()
        config.attributes["connection"] = connection
        command.upgrade(config, PREVIOUS_REVISION)
    engine.dispose()
    connection = sqlite3.connect(path)
    # A half-precision shape beside the frozen float32 ones.
    connection.execute(
        "INSERT INTO problems (seq_len, head_dim, batch, heads, causal, dtype, kv_heads, kv_len) "
        "VALUES (1024, 64, 1, 1, 0, 'bfloat16', 1, 1024)"
    )
    connection.commit()
    connection.close()

    assert upgrade_registry(url) == (PREVIOUS_REVISION, HEAD_REVISION)
    connection = sqlite3.connect(path)
    rows = connection.execute("SELECT dtype, precision FROM problems ORDER BY id").fetchall()
    connection.close()
    assert set(rows) == {("float32", "tf32x3"), ("bfloat16", "")}

    h200_0001 = Environment("NVIDIA H200", "9.0", 132, "570.86", "12.8", "12.8.61", "")
    with PlanRegistry.open(url) as registry:
        best = registry.best(Problem(4096, 128), h200_0001)
        assert best is not None and best.record.median_ms == 0.8125
        assert best.problem.precision == "tf32x3"
        assert registry.best(Problem(4096, 128, precision="tf32"), h200_0001) is None
        # the same shape under tf32 is a new row beside the old one
        registry.record(Problem(4096, 128, precision="tf32"), h200_0001, record(0.3, ONE_PASS))
        assert registry.best(Problem(4096, 128), h200_0001).record.median_ms == 0.8125  # type: ignore[union-attr]


def test_the_db_cli_names_a_problem_by_precision(registry: PlanRegistry, capsys) -> None:
    from db.cli import main

    registry.record(FAST, H200, record(3.0, ONE_PASS))
    shape = [
        "--url",
        registry.url,
        "--seq-len",
        "4096",
        "--head-dim",
        "128",
        "--batch",
        "4",
        "--heads",
        "16",
        "--dtype",
        "float32",
    ]
    assert main(["best", *shape, "--precision", "tf32"]) == 0
    assert "float32-tf32" in capsys.readouterr().out
    assert main(["best", *shape]) != 0  # tf32x3, the default: no plan
    assert "no plan for 4x16x4096x128 float32 full" in capsys.readouterr().out
    shape[-1] = "bfloat16"
    assert main(["best", *shape, "--precision", "tf32"]) != 0
    assert "applies to --dtype float32 only" in capsys.readouterr().err
