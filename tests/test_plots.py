"""The run's plots: what is predicted is shown as predicted, and a plot without information
is left out (a machine without a GPU gets the search history only)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tuner import plots
from tuner.report import best_table
from tuner.trials import SearchResult, TrialOutcome

pytestmark = pytest.mark.skipif(not plots.available(), reason="matplotlib is not installed")


def tiled(number: int, tile: int, rows: int, ms: float, *, measured: bool) -> TrialOutcome:
    return TrialOutcome(
        number=number,
        state="COMPLETE",
        outcome="measured",
        key=f"tiled/b{tile}/r{rows}/t128/s1",
        params={"family": "tiled", "tile_size": tile, "rows_per_block": rows, "threads": 128},
        predicted_ms=ms * 1.1,
        measured=measured,
        median_ms=ms if measured else ms * 1.1,
        spread_ms=0.01 if measured else None,
    )


def result(trials: list[TrialOutcome]) -> SearchResult:
    return SearchResult(study_name="s", storage_url="sqlite://", trials=trials)


GRID = [(32, 32), (32, 64), (64, 32), (64, 64)]


def test_gpu_timings_get_all_three_plots_named_by_their_family(tmp_path: Path) -> None:
    trials = [tiled(n, t, r, 1.0 + n, measured=True) for n, (t, r) in enumerate(GRID)]
    written = plots.write_plots(result(trials), tmp_path, "1x1x512x64")
    assert [p.name for p in written] == [
        "search_history.png",
        "tiled_heatmap.png",
        "predicted_vs_measured.png",
    ]


def test_predictions_only_give_the_history_alone(tmp_path: Path) -> None:
    trials = [tiled(n, t, r, 1.0 + n, measured=False) for n, (t, r) in enumerate(GRID)]
    written = plots.write_plots(result(trials), tmp_path, "1x1x512x64")
    assert [p.name for p in written] == ["search_history.png"]
    assert plots.prediction_figure(result(trials), "x") is None
    assert plots.heatmap_figure(result(trials), "x") is None


def test_a_heatmap_of_one_row_is_left_out(tmp_path: Path) -> None:
    trials = [tiled(n, tile, 32, 1.0 + n, measured=True) for n, tile in enumerate((16, 32, 64))]
    assert plots.heatmap_figure(result(trials), "x") is None


def test_the_table_shows_a_prediction_once() -> None:
    table = best_table(result([tiled(0, 32, 32, 1.0, measured=False)]))
    row = table.splitlines()[2].split()
    assert row[2:4] == ["-", "-"]  # median ms, spread ms: nothing was timed
    assert row[-2:] == ["1.1000", "predicted"]
    measured = best_table(result([tiled(0, 32, 32, 1.0, measured=True)])).splitlines()[2]
    assert measured.split()[2] == "1.0000" and measured.endswith("measured")
