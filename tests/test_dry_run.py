"""``mode=plan``: the candidate space printed without a GPU or a database."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tuner.config import TunerConfig, validate
from tuner.costmodel import predict_time_ms
from tuner.device import H200
from tuner.dry_run import print_plan_space, rank_by_prediction
from tuner.planner.space import CandidateSpace, candidate_space
from tuner.problem import Problem

TABLE_ROW = re.compile(r"^\s+\d+\s+[a-z0-9_]+/\S+\s+\d+x\d+x\d+\s")


def run_plan(workdir: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tuner",
            "mode=plan",
            *arguments,
            f"registry.url=sqlite:///{workdir}/r.sqlite",
            f"search.storage=sqlite:///{workdir}/s.sqlite",
        ],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("seq_len", "head_dim"),
    [(4096, 128), (7, 32)],
)
def test_plan_mode_prints_feasible_candidates_and_rejections(
    tmp_path: Path, seq_len: int, head_dim: int
) -> None:
    result = run_plan(tmp_path, f"seq_len={seq_len}", f"head_dim={head_dim}", "dtype=float32")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    out = result.stdout
    assert f"problem: 1x1x{seq_len}x{head_dim} float32 full" in out
    assert "device:  NVIDIA H200 (profile h200, sm_90, 132 SMs" in out
    space = candidate_space(Problem(seq_len, head_dim), H200)
    assert f"{len(space.feasible)} feasible, {len(space.rejected)} rejected" in out
    rows = [line for line in out.splitlines() if TABLE_ROW.match(line)]
    assert len(rows) == min(20, len(space.feasible)) > 0
    assert f"rejected: {len(space.rejected)}" in out
    for kind, count in space.rejection_counts().items():
        assert re.search(rf"^\s+{count}\s+{re.escape(kind)}\s", out, re.MULTILINE), kind
    assert not list(tmp_path.rglob("*.sqlite"))


def test_rejection_kinds_read_as_sentences_with_numbers_as_n() -> None:
    space = candidate_space(Problem(4096, 128), H200)
    kinds = set(space.rejection_counts())
    assert "shared memory N B exceeds the device's per-block opt-in limit N B" in kinds
    assert (
        "no thread layout: N threads cannot split N rows x N keys x N columns evenly "
        "into row groups of at most a warp"
    ) in kinds
    for plan in space.rejected:  # each kind is its reasons with the numbers as N
        (kind,) = CandidateSpace(feasible=(), rejected=(plan,)).rejection_counts()
        assert kind == re.sub(r"\b\d+\b", "N", plan.reason)


def test_plan_rows_limits_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    for rows, expected in [(3, 3), (0, None)]:
        validated = validate(
            TunerConfig(seq_len=1024, head_dim=64, dtype="float32", mode="plan", plan_rows=rows)
        )
        print_plan_space(validated)
        out = capsys.readouterr().out
        feasible = candidate_space(validated.problem, validated.device).feasible
        shown = [line for line in out.splitlines() if TABLE_ROW.match(line)]
        assert len(shown) == (expected or len(feasible))


def test_table_is_ranked_by_predicted_time(capsys: pytest.CaptureFixture[str]) -> None:
    validated = validate(
        TunerConfig(seq_len=2048, head_dim=128, dtype="float32", mode="plan", plan_rows=5)
    )
    print_plan_space(validated)
    keys = [
        line.split()[1] for line in capsys.readouterr().out.splitlines() if TABLE_ROW.match(line)
    ]
    feasible = candidate_space(validated.problem, validated.device).feasible
    ranked = rank_by_prediction(feasible, validated.device)
    assert keys == [plan.key() for plan, _ in ranked[:5]]
    times = [predict_time_ms(plan, validated.device) for plan, _ in ranked]
    assert times == sorted(times)
