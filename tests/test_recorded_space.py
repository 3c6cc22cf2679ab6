"""A replay searches the space its recording was made in (``tuner.recorded_space``): plans of
a tunable added since, at a value the recording's plans never ran, are ruled out with the
reason, not tried and failed one by one."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from kernels.backends.replay import load_recordings
from tuner.app import run
from tuner.config import typed_config, validate
from tuner.device import H200
from tuner.planner import KernelParams, plan_kernel
from tuner.problem import Problem
from tuner.recorded_space import (
    choice_added_since,
    recorded_tunables,
    unrecorded_reason,
    within_recording,
)

ROOT = Path(__file__).resolve().parent.parent
#: recorded before the Hopper ping-pong and staged epilogue existed
GRID = ROOT / "bench" / "data" / "h200_mma_f16_wgmma_f16_4x16x4096x128_bf16.json"
PROBLEM = Problem(4096, 128, batch=4, heads=16, dtype="bfloat16")


@pytest.fixture(scope="module")
def hydra_conf() -> Iterator[None]:
    with initialize_config_dir(config_dir=str(ROOT / "tuner" / "conf"), version_base="1.3"):
        yield


def wgmma(**tunables: int):
    return plan_kernel(PROBLEM, KernelParams("wgmma_f16", consumers=2, overlap=1, stages=3,
                                             **tunables), H200)


def replayed_search(tmp_path: Path, trials: int) -> str:
    """The tuner's report of a replayed search of the recorded grid's problem (it succeeds)."""
    cfg = compose(config_name="config", overrides=[
        "seq_len=4096", "head_dim=128", "batch=4", "heads=16", "dtype=bfloat16",
        "backend=replay", f"backend.replay_path={GRID}", f"search.n_trials={trials}",
        f"registry.url=sqlite:///{tmp_path / 'plans.sqlite'}",
        f"search.storage=sqlite:///{tmp_path / 'studies.sqlite'}",
    ])  # fmt: skip
    out = io.StringIO()
    status = run(validate(typed_config(cfg)), output_dir=tmp_path / "run", out=out)
    text = out.getvalue()
    assert status == 0, text
    return text


def test_a_tunable_added_since_is_in_the_space_only_at_the_value_its_plans_ran():
    (recording,) = load_recordings(GRID)
    known = recorded_tunables(recording)
    assert "overlap" in known and "pingpong" not in known and "staged_store" not in known
    assert unrecorded_reason(wgmma(), known) == ""
    assert unrecorded_reason(wgmma(pingpong=1), known) == (
        "wgmma_f16 pingpong=1 is not in the recording (recorded before pingpong existed: its "
        "plans ran pingpong=0)"
    )
    assert "staged_store=1 is not in the recording" in unrecorded_reason(
        wgmma(staged_store=1), known
    )
    # a recording that knows the tunable holds all of its values
    assert unrecorded_reason(wgmma(pingpong=1), known | {"pingpong", "staged_store"}) == ""


def test_a_choice_added_since_is_named():
    (recording,) = load_recordings(GRID)
    assert choice_added_since(wgmma(block_n=176, late_pack=1), recording) == "block_n=176"
    # a recorded plan ran every value it has
    entry = next(e for e in recording.entries.values() if e.params["family"] == "wgmma_f16")
    recorded = plan_kernel(PROBLEM, KernelParams.from_stored("wgmma_f16", entry.params), H200)
    assert choice_added_since(recorded, recording) == ""
    (plan,) = within_recording([wgmma(block_n=176)], recording)[1]
    assert plan.reason.endswith("block_n=176 was added since"), plan.reason


def test_a_replay_rules_out_a_choice_added_since(tmp_path, hydra_conf):
    # the grid was recorded when key tiles were 64 or 128: the 176-key plans of today's
    # planner lie outside it, ruled out before the search rather than failed in it
    (recording,) = load_recordings(GRID)
    assert {entry.params["block_n"] for entry in recording.entries.values()
            if entry.params["family"] == "wgmma_f16"} == {64, 128}  # fmt: skip
    text = replayed_search(tmp_path, trials=40)
    assert "/n176/" not in text and "0 failed" in text, text


def test_a_replay_rules_out_unrecorded_plans_and_measures_only_recorded_ones(
    tmp_path, hydra_conf
):
    text = replayed_search(tmp_path, trials=12)
    assert "/p1/" not in text and "/ss/" not in text
    assert "0 failed" in text, text
