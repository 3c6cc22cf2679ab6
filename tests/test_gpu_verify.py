"""``python -m db verify`` on a real GPU: a small registry tuned here, then verified.

A plan measured moments ago verifies (drift near 1, exit 0); the same plan with its
stored time made ten times faster than it really is (as if the GPU had got slower
since) is disabled, and the command exits 1. Skipped where pycuda is missing or no
CUDA device answers.
"""

from __future__ import annotations

import importlib.util
import io
import sqlite3
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from db import PlanRegistry
from db.cli import main
from kernels.backends import detect_cuda
from tuner.app import run
from tuner.config import typed_config, validate
from tuner.problem import Problem

pytestmark = pytest.mark.gpu

CONF_DIR = Path(__file__).resolve().parents[1] / "tuner" / "conf"
PROBLEM = Problem(512, 64, dtype="float32")


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if importlib.util.find_spec("pycuda") is None:
        pytest.skip("pycuda is not installed")
    missing = detect_cuda()
    if missing is not None:
        pytest.skip(f"no CUDA device answers: {missing}")
    directory = tmp_path_factory.mktemp("verify")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=[
                "seq_len=512",
                "head_dim=64",
                "dtype=float32",
                "backend=pycuda",
                "search.n_trials=6",
                f"registry.url=sqlite:///{directory / 'plans.sqlite'}",
                f"search.storage=sqlite:///{directory / 'studies.sqlite'}",
            ],
        )
    assert run(validate(typed_config(cfg)), output_dir=directory / "run", out=io.StringIO()) == 0
    return directory / "plans.sqlite"


def test_a_fresh_plan_verifies_and_a_stale_time_is_disabled(
    tuned: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tuned}"
    with PlanRegistry.open(url, readonly=True) as registry:
        (stored,) = registry.list_best()
    assert stored.record.measured
    assert main(["verify", "--url", url, "--threshold", "1.5"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"#{stored.plan_id}" in out and out.rstrip().endswith("ok")

    with sqlite3.connect(tuned) as connection:
        connection.execute(
            "UPDATE plans SET median_ms = median_ms / 10 WHERE id = ?", (stored.plan_id,)
        )
    connection.close()
    assert main(["verify", "--url", url]) == 1
    captured = capsys.readouterr()
    assert "SLOWER: disabled" in captured.out
    assert "plans disabled on" in captured.err
    with PlanRegistry.open(url, readonly=True) as registry:
        assert registry.best(PROBLEM, stored.environment) is None
        (history,) = registry.history(PROBLEM, stored.environment)
    assert history.disabled_reason.startswith("db verify: ")
