"""``python -m db verify`` and disabled plans, without a GPU: the measuring backend is injected.

The backend here answers per plan key from a script (a time, or a failure): the
verification logic (drift, disabling, verifying what is served next, filters, the
table and the exit status) and the registry's rules for disabled plans (never
served by ``best``/``cached_best`` or ``kernels.plan_choice``; the next best plan
is) are the real ones. ``tests/test_gpu_verify.py`` runs it on a GPU.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest
from sqlalchemy import create_engine

from db import PlanRecord, PlanRegistry
from db.cli import main
from db.registry import upgrade_registry
from db.schema import HEAD_REVISION, alembic_config
from db.verification import Measuring, verify
from kernels import plan_choice
from kernels.backends.base import Backend, Failure, Measurement
from tuner.device import H200
from tuner.environment import Environment
from tuner.planner.params import KernelParams
from tuner.planner.tunable import KernelPlan, plan_kernel
from tuner.problem import Problem

FROZEN_0001 = Path(__file__).parent / "data" / "registry_0001.sqlite"
#: where the plans were tuned, and the same GPU model after a driver update
TUNED = Environment("NVIDIA H200", "9.0", 132, "570.86", "12.8", "12.8.61", "2025.1.2")
NOW = Environment("NVIDIA H200", "9.0", 132, "580.159", "13.0", "13.0.88", "2026.1")
OTHER_GPU = Environment("NVIDIA A100-SXM4-80GB", "8.0", 108, "570.86", "12.8")
FLOAT = Problem(1000, 64, batch=2, heads=4, causal=True)
HALF = Problem(1000, 64, batch=2, heads=4, causal=True, dtype="bfloat16")
TILED = {"threads": 128, "tile_size": 32, "rows_per_block": 32, "split_target": 4}


def tiled(tile_size: int, median_ms: float, **fields: object) -> PlanRecord:
    values = {"source_hash": "t", "measured": True, "median_ms": median_ms} | fields
    return PlanRecord("tiled", TILED | {"tile_size": tile_size}, **values)  # type: ignore[arg-type]


def key_of(problem: Problem, record: PlanRecord) -> str:
    return plan_kernel(problem, KernelParams.from_stored(record.family, record.params), H200).key()


class ScriptedBackend(Backend):
    """Answers each plan key from ``script``: a time in ms, or a failure; records the keys."""

    name = "scripted"

    def __init__(self, script: dict[str, float | Failure]) -> None:
        self.script = script
        self.asked: list[str] = []
        self.closed = False

    def measure(self, plan: KernelPlan, problem: Problem) -> Measurement:
        self.asked.append(plan.key())
        answer = self.script[plan.key()]
        if isinstance(answer, Failure):
            return Measurement.failed(answer, "max |error| 0.5 > 0.001 against the reference")
        return Measurement(measured=True, median_ms=answer, spread_ms=0.0, max_abs_error=1e-7)

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'plans.sqlite'}"
    with PlanRegistry.open(url) as registry:
        for tile, ms in ((32, 0.50), (64, 0.60), (16, 0.70)):
            registry.record(FLOAT, TUNED, tiled(tile, ms))
        registry.record(FLOAT, OTHER_GPU, tiled(32, 0.9))
        half = PlanRecord("mma_f16", {}, "m", True, median_ms=0.2)
        registry.record(HALF, TUNED, half)
    return url


def keys() -> dict[str, str]:
    return {
        "fast": key_of(FLOAT, tiled(32, 0.5)),
        "next": key_of(FLOAT, tiled(64, 0.6)),
        "slow": key_of(FLOAT, tiled(16, 0.7)),
        "half": key_of(HALF, PlanRecord("mma_f16", {}, "m", True, median_ms=0.2)),
    }


def measuring(backend: Backend) -> Measuring:
    return Measuring(backend, H200, NOW)


def served(url: str, problem: Problem, environment: Environment = TUNED) -> PlanRecord | None:
    with PlanRegistry.open(url, readonly=True) as registry:
        found = registry.best(problem, environment)
    return None if found is None else found.record


def test_plans_within_the_threshold_stay_served_and_the_exit_is_0(url, capsys) -> None:
    k = keys()
    backend = ScriptedBackend({k["fast"]: 0.55, k["half"]: 0.21})
    assert main(["verify", "--url", url], measuring=lambda: measuring(backend)) == 0
    assert sorted(backend.asked) == sorted([k["half"], k["fast"]])
    assert backend.closed
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:7] == ["plan", "problem", "kernel", "plan", "stored", "ms", "now"]
    assert any("1.10x" in line and line.endswith("ok") for line in out)
    assert served(url, FLOAT).median_ms == 0.5  # type: ignore[union-attr]


def test_a_slower_plan_is_disabled_and_the_next_best_verified_and_served(url, capsys) -> None:
    k = keys()
    backend = ScriptedBackend({k["fast"]: 0.9, k["next"]: 0.62, k["half"]: 0.2})
    arguments = ["verify", "--url", url, "--dtype", "float32"]
    status = main(arguments, measuring=lambda: measuring(backend))
    assert status == 1
    assert backend.asked == [k["fast"], k["next"]]  # --dtype: the bfloat16 plan is left alone
    captured = capsys.readouterr()
    assert "1.80x" in captured.out and "SLOWER: disabled" in captured.out
    assert captured.err == "python -m db verify: 1 of 2 plans disabled on NVIDIA H200\n"
    assert served(url, FLOAT).median_ms == 0.6  # type: ignore[union-attr]
    with PlanRegistry.open(url, readonly=True) as registry:
        (disabled,) = [p for p in registry.history(FLOAT, TUNED) if p.disabled_reason]
        assert disabled.record.median_ms == 0.5
        assert disabled.disabled_reason.startswith("db verify: 0.9 ms now, 0.5 ms stored: 1.80x")
        assert registry.cached_best(FLOAT, TUNED).record.median_ms == 0.6  # type: ignore[union-attr]
        # Another GPU's plans are not this GPU's to judge.
        assert registry.best(FLOAT, OTHER_GPU).disabled_reason == ""  # type: ignore[union-attr]


def test_a_wrong_answer_is_disabled_and_every_plan_may_go(url) -> None:
    k = keys()
    backend = ScriptedBackend(
        {k["fast"]: Failure.WRONG_ANSWER, k["next"]: Failure.WRONG_ANSWER, k["slow"]: 5.0}
    )
    with PlanRegistry.open(url) as registry:
        verdicts = verify(registry, backend, H200, NOW, dtype="float32")
    assert [v.key for v in verdicts] == [k["fast"], k["next"], k["slow"]]
    assert all(not v.ok for v in verdicts)
    assert verdicts[0].failure.startswith("WRONG_ANSWER: max |error| 0.5")
    assert verdicts[2].drift == pytest.approx(5.0 / 0.7)
    # Nothing of this GPU is served for the shape now; the other GPU's plan still is.
    assert served(url, FLOAT) is None
    assert served(url, FLOAT, OTHER_GPU).median_ms == 0.9  # type: ignore[union-attr]
    assert served(url, FLOAT, NOW) is None


def test_the_threshold_is_an_option(url) -> None:
    k = keys()
    backend = ScriptedBackend({k["fast"]: 0.9, k["half"]: 0.2})
    arguments = ["verify", "--url", url, "--threshold", "2"]
    assert main(arguments, measuring=lambda: measuring(backend)) == 0
    assert served(url, FLOAT).median_ms == 0.5  # type: ignore[union-attr]


def test_json_output(url, capsys) -> None:
    k = keys()
    backend = ScriptedBackend({k["fast"]: 0.5, k["half"]: Failure.COMPILE})
    assert main(["verify", "--url", url, "--json"], measuring=lambda: measuring(backend)) == 1
    answer = {row["plan"]: row for row in json.loads(capsys.readouterr().out)}
    assert answer[k["fast"]]["drift"] == 1.0 and answer[k["fast"]]["disabled"] == ""
    assert answer[k["half"]]["disabled"].startswith("db verify: COMPILE")
    assert served(url, HALF) is None


def test_plan_choice_falls_to_the_next_best_measured_plan(url) -> None:
    k = keys()
    with PlanRegistry.open(url) as registry:
        chooser = plan_choice.PlanChooser(registry, TUNED, H200, source_hashes={})
        assert chooser.plan_for(FLOAT).plan.key() == k["fast"]
        verify(
            registry, ScriptedBackend({k["fast"]: 2.0, k["next"]: 0.6}), H200, NOW, dtype="float32"
        )
    with PlanRegistry.open(url, readonly=True) as registry:
        chooser = plan_choice.PlanChooser(registry, TUNED, H200, source_hashes={})
        chosen = chooser.plan_for(FLOAT)
    assert chosen.origin == "registry" and chosen.plan.key() == k["next"]
    assert chosen.stored is not None and chosen.stored.disabled_reason == ""


def test_a_new_plan_after_every_plan_was_disabled_is_served(url) -> None:
    with PlanRegistry.open(url) as registry:
        for plan in registry.history(FLOAT, TUNED):
            registry.disable(plan.plan_id, "db verify: test")
        assert registry.best(FLOAT, TUNED) is None
        registry.record(FLOAT, TUNED, tiled(64, 0.65))
        assert registry.best(FLOAT, TUNED).record.median_ms == 0.65  # type: ignore[union-attr]


def test_without_a_gpu_it_is_one_error_line_and_writes_nothing(url, tmp_path, capsys) -> None:
    before = sorted(p.name for p in tmp_path.iterdir())
    status = main(["verify", "--url", url])
    assert status == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("python -m db verify: error: db verify re-measures")
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert served(url, FLOAT).median_ms == 0.5  # type: ignore[union-attr]


def test_a_registry_from_revision_0006_upgrades_and_its_plans_are_served(tmp_path) -> None:
    from alembic import command

    path = tmp_path / "before.sqlite"
    shutil.copy(FROZEN_0001, path)
    url = f"sqlite:///{path}"
    engine = create_engine(url)
    with engine.begin() as connection:
        config = alembic_config()
        config.attributes["connection"] = connection
        command.upgrade(config, "0006")
    engine.dispose()
    with sqlite3.connect(path) as connection:
        columns = [row[1] for row in connection.execute("PRAGMA table_info(plans)")]
    connection.close()
    assert "disabled_reason" not in columns
    assert upgrade_registry(url) == ("0006", HEAD_REVISION)
    with sqlite3.connect(path) as connection:
        reasons = connection.execute("SELECT DISTINCT disabled_reason FROM plans").fetchall()
    connection.close()
    assert reasons == [("",)]
    h200_0001 = Environment("NVIDIA H200", "9.0", 132, "570.86", "12.8", "12.8.61", "")
    with PlanRegistry.open(url, readonly=True) as registry:
        best = registry.best(Problem(4096, 128), h200_0001)
    assert best is not None and best.record.median_ms == 0.8125 and best.disabled_reason == ""
