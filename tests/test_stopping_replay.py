"""bench/stopping_replay.py and bench/tuning_time.py: their arithmetic, and one real grid."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import search_efficiency as se  # noqa: E402
import stopping_replay as sr  # noqa: E402
import tuning_time  # noqa: E402

from tuner.trials import TrialOutcome  # noqa: E402

GRID = BENCH / "data" / "h200_mma_f16_wgmma_f16_4x16x4096x128_bf16.json"


def trial(number: int, key: str, ms: float | None) -> TrialOutcome:
    outcome = "measured" if ms is not None else "failed"
    return TrialOutcome(number, "COMPLETE", outcome, key, {}, median_ms=ms)


def test_a_pair_knows_its_prefix_its_savings_and_its_ratio():
    full = [trial(0, "a", 2.0), trial(1, "b", None), trial(2, "c", 1.0), trial(3, "d", 3.0)]
    pair = sr.RunPair(full[:2], full, "stopped")
    assert pair.is_prefix and pair.used == 2
    assert [t.key for t in pair.saved_trials()] == ["c", "d"]
    assert pair.best_ms(pair.stopped) / pair.best_ms(pair.full) == 2.0
    # 34 launches of 1 ms and of 3 ms
    assert sr.kernel_seconds(pair.saved_trials()) == pytest.approx(34 * 4.0 / 1000)
    other = sr.RunPair([trial(0, "x", 1.0)], full, "stopped")
    assert not other.is_prefix and other.saved_trials() == []


def test_one_recorded_grid_stops_early_on_what_forty_trials_store():
    (place,) = se.recorded_problems([GRID])
    setup = se.setup_problem(*place, held_out=True)
    pair = sr.run_pair(setup, seed=0, cap=40)
    assert pair.is_prefix and pair.used < 40 == len(pair.full)
    entry = sr.grid_entry(setup, [pair], overhead_s=0.2)
    assert entry["worst_stored_over_full"] <= sr.TARGET_RATIO and entry["within_target"]
    assert entry["trials_saved"] == [40 - pair.used]
    assert entry["seconds_saved"][0] == pytest.approx(
        entry["kernel_seconds_saved"][0] + 0.2 * (40 - pair.used)
    )
    total = sr.summary([entry])
    assert total["grids_within_target"] == 1 and total["all_prefixes"]
    assert total["trials_saved_fraction"] == pytest.approx(1 - pair.used / 40)


def test_the_time_line_is_read_back_phase_by_phase():
    output = (
        "registry: ...\n"
        "time: 9.5 s: 1.2 s start-up, 1.9 s backend start, 0.3 s planning, 0.2 s study, "
        "4.9 s search (9 trials, 0.54 s each; 12 kernels compiled ahead, 0 cached), "
        "1.0 s report\n"
    )
    line = tuning_time.parse_time_line(output)
    assert line is not None and line["total"] == 9.5
    assert line["phases"] == {
        "start-up": 1.2,
        "backend start": 1.9,
        "planning": 0.3,
        "study": 0.2,
        "search": 4.9,
        "report": 1.0,
    }
    assert line["notes"]["search"].startswith("9 trials, 0.54 s each; 12 kernels")
    assert tuning_time.parse_time_line("no such line") is None
