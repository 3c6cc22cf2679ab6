"""The registry keeps forward and backward plans apart, and a registry from before the
direction column (revision 0006) upgrades with every row read as a forward problem."""

from __future__ import annotations

import dataclasses
import json
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
#: the revision before direction (0006): the one constant to change when it is re-chained
PREVIOUS_REVISION = "0005"
H200 = Environment("NVIDIA H200", "9.0", 132, "580.159", "13.0", "13.0.88", "2026.1")
FORWARD = Problem(4096, 128, batch=4, heads=16, causal=True, dtype="bfloat16")
BACKWARD = dataclasses.replace(FORWARD, direction="backward")
FORWARD_PARAMS = {"block_m": 128, "block_n": 64, "warps": 4, "stages": 2,
                  "q_in_registers": 0, "s_groups": 1, "split_target": 1 << 16}  # fmt: skip
BACKWARD_PARAMS = {"block_m": 64, "block_n": 128, "warps": 8, "stages": 2, "q_chunk": 16,
                   "deterministic": 0, "group_split": 1}  # fmt: skip


def record(family: str, params: dict[str, int], median_ms: float) -> PlanRecord:
    return PlanRecord(family, params, "h", True, median_ms=median_ms, max_abs_error=1e-3)


@pytest.fixture
def registry(tmp_path: Path):
    with PlanRegistry.open(f"sqlite:///{tmp_path / 'plans.sqlite'}") as handle:
        yield handle


def test_each_direction_has_its_own_best_plan(registry: PlanRegistry) -> None:
    registry.record(FORWARD, H200, record("mma_f16", FORWARD_PARAMS, 2.0))
    registry.record(BACKWARD, H200, record("mma_f16_bwd", BACKWARD_PARAMS, 5.0))
    forward, backward = registry.best(FORWARD, H200), registry.best(BACKWARD, H200)
    assert forward is not None and forward.record.family == "mma_f16"
    assert forward.problem.direction == "forward"
    assert backward is not None and backward.record.family == "mma_f16_bwd"
    assert backward.problem == BACKWARD


def test_a_backward_plan_is_never_served_for_a_forward_problem(registry: PlanRegistry) -> None:
    registry.record(BACKWARD, H200, record("mma_f16_bwd", BACKWARD_PARAMS, 5.0))
    assert registry.best(FORWARD, H200) is None
    assert registry.best(FORWARD, H200, nearest=True) is None
    near = dataclasses.replace(BACKWARD, seq_len=8192, kv_len=8192)
    found = registry.best(near, H200, nearest=True)
    assert found is not None and found.fallback and found.problem == BACKWARD


def test_the_chooser_serves_a_backward_problem_only_a_backward_plan(
    registry: PlanRegistry,
) -> None:
    """A handle that ignored the direction would still not get a forward plan run for a
    backward problem: the chooser compares directions and falls back to the backward default."""
    registry.record(FORWARD, H200, record("mma_f16", FORWARD_PARAMS, 2.0))
    stored = registry.best(FORWARD, H200)

    class IgnoresDirection:
        url = "test://ignores-direction"

        def cached_best(self, problem, environment, **_):
            return stored

    chooser = PlanChooser(
        IgnoresDirection(), H200, H200_PROFILE, source_hashes={}, check=lambda plan: plan
    )
    chosen = chooser.plan_for(BACKWARD)
    # (the backward default on the H200: the Hopper backward)
    assert chosen.origin == "default" and chosen.plan.family == "wgmma_f16_bwd"
    assert chosen.plan.kernel_family.direction == "backward"
    assert any("stored for bfloat16 forward; not used" in note for note in chosen.warnings)
    assert chooser.plan_for(FORWARD).plan.family == "mma_f16"


def test_a_registry_from_before_direction_upgrades_and_reads_forward(tmp_path: Path) -> None:
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
    columns = [row[1] for row in connection.execute("PRAGMA table_info(problems)")]
    assert "direction" not in columns
    before = connection.execute("SELECT id FROM problems ORDER BY id").fetchall()
    connection.close()
    assert before

    assert upgrade_registry(url) == (PREVIOUS_REVISION, HEAD_REVISION)
    connection = sqlite3.connect(path)
    after = connection.execute("SELECT id, direction FROM problems ORDER BY id").fetchall()
    connection.close()
    assert after == [(row_id, "forward") for (row_id,) in before]

    h200_0001 = Environment("NVIDIA H200", "9.0", 132, "570.86", "12.8", "12.8.61", "")
    with PlanRegistry.open(url) as registry:
        best = registry.best(Problem(4096, 128), h200_0001)
        assert best is not None and best.record.median_ms == 0.8125
        assert best.problem.direction == "forward"
        backward = Problem(4096, 128, dtype="bfloat16", direction="backward")
        assert registry.best(backward, h200_0001) is None
        registry.record(backward, h200_0001, record("mma_f16_bwd", BACKWARD_PARAMS, 9.0))
        served = registry.best(backward, h200_0001)
        assert served is not None and served.record.median_ms == 9.0
        assert registry.best(Problem(4096, 128), h200_0001).record.median_ms == 0.8125  # type: ignore[union-attr]


def test_export_import_keeps_the_direction_and_old_exports_read_forward(
    registry: PlanRegistry, tmp_path: Path
) -> None:
    registry.record(BACKWARD, H200, record("mma_f16_bwd", BACKWARD_PARAMS, 5.0))
    registry.record(FORWARD, H200, record("mma_f16", FORWARD_PARAMS, 2.0))
    export = tmp_path / "plans.json"
    registry.export(export)
    document = json.loads(export.read_text())
    for entry in document["plans"]:
        if entry["problem"]["direction"] == "forward":
            del entry["problem"]["direction"]  # what an export from before 0006 holds
    export.write_text(json.dumps(document))
    with PlanRegistry.open(f"sqlite:///{tmp_path / 'fresh.sqlite'}") as fresh:
        assert fresh.import_(export).added == 2
        assert fresh.best(BACKWARD, H200).record.family == "mma_f16_bwd"  # type: ignore[union-attr]
        assert fresh.best(FORWARD, H200).record.family == "mma_f16"  # type: ignore[union-attr]


def test_the_db_cli_names_a_problem_by_direction(registry: PlanRegistry, capsys) -> None:
    from db.cli import main

    registry.record(BACKWARD, H200, record("mma_f16_bwd", BACKWARD_PARAMS, 5.0))
    shape = ["--url", registry.url, "--seq-len", "4096", "--head-dim", "128", "--batch", "4",
             "--heads", "16", "--causal"]  # fmt: skip
    assert main(["best", *shape, "--direction", "backward"]) == 0
    assert "mma_f16_bwd" in capsys.readouterr().out
    assert main(["best", *shape]) != 0  # forward, the default: no plan
    assert "no plan for 4x16x4096x128 bfloat16 causal" in capsys.readouterr().out


def test_a_plan_stored_before_a_tunable_existed_is_served_with_what_it_ran(
    registry: PlanRegistry,
) -> None:
    """A wgmma_f16 row written before the ping-pong tunable (H200 suite, 2026-12-04: the
    chooser refused it as lacking ``pingpong``) is served with pingpong=0, the kernel it ran;
    a row lacking a tunable that declares no such value is still refused."""
    old = {"consumers": 2, "block_n": 128, "stages": 3, "blocks_per_sm": 1, "overlap": 1,
           "split_target": 1 << 16}  # fmt: skip
    registry.record(FORWARD, H200, record("wgmma_f16", old, 1.0))
    chooser = PlanChooser(registry, H200, H200_PROFILE, source_hashes={}, check=lambda p: p)
    chosen = chooser.plan_for(FORWARD)
    assert chosen.origin == "registry", chosen.warnings
    assert chosen.plan.key() == "wgmma_f16/c2/n128/st3/b1/o1/s1"
    assert chosen.plan.params.pingpong == 0

    other = dataclasses.replace(FORWARD, seq_len=2048, kv_len=2048)
    lacking = {k: v for k, v in FORWARD_PARAMS.items() if k != "s_groups"}
    registry.record(other, H200, record("mma_f16", lacking, 1.0))
    refused = chooser.plan_for(other)
    assert refused.origin == "default"
    assert any("lacks tunables s_groups" in note for note in refused.warnings)
