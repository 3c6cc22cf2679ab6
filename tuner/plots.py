"""PNG plots of a study, written into the run directory.

* ``search_history.png``: each timed trial's median, and the running best
  (predicted times, labelled so, on a machine without a GPU).
* ``<family>_heatmap.png``: the best measured time per cell of two tunables (the
  family's ``heatmap_axes``: ``tile_size`` x ``rows_per_block`` for ``tiled``,
  ``block_n`` x ``block_m`` for the mma families, ...) of the family with the most
  timed trials among those that name them; only with GPU timings and at least two
  values on each axis.
* ``predicted_vs_measured.png``: the cost model's prediction against the
  timing, log-log, with the line of perfect prediction and Spearman's rho; only
  with GPU timings (without them the "timings" are the predictions themselves).

A plot that would carry no information is left out (``write_plots`` returns
what it wrote). matplotlib is optional (the ``plots`` and ``test`` extras):
``available()`` says whether it imports. Figures are built with the object API
(``matplotlib.figure.Figure``), so no GUI backend or global pyplot state is
involved.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from tuner.planner.families import family_named, family_names
from tuner.report import model_rank_correlation
from tuner.trials import SearchResult, TrialOutcome

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def import_ahead() -> None:
    """Import matplotlib on a thread of its own (half a second), while the run waits on
    the GPU; the plots at the end then find it loaded. Nothing where it is missing."""
    if available():
        threading.Thread(target=_import_figure, name="import-matplotlib", daemon=True).start()


def _import_figure() -> None:
    import matplotlib.figure  # noqa: F401 - the import is the work


def write_plots(result: SearchResult, directory: Path, title: str) -> list[Path]:
    """Write every plot that has data into ``directory``; the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    chosen = _heatmap_family(result)
    heatmap_name = f"{chosen[0]}_heatmap.png" if chosen else "heatmap.png"
    for name, figure in (
        ("search_history.png", history_figure(result, title)),
        (heatmap_name, heatmap_figure(result, title)),
        ("predicted_vs_measured.png", prediction_figure(result, title)),
    ):
        if figure is not None:
            path = directory / name
            figure.savefig(path, dpi=110)
            written.append(path)
    return written


def _figure() -> Figure:
    # Under Hydra the root logger prints INFO to the console; matplotlib's
    # one-time font-cache notice is not worth a line of the run's output.
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    from matplotlib.figure import Figure

    return Figure(figsize=(7.5, 4.8), layout="constrained")


def history_figure(result: SearchResult, title: str) -> Figure | None:
    timed = [t for t in result.trials if t.timed]
    if not timed:
        return None
    figure = _figure()
    axes = figure.subplots()
    numbers = [t.number for t in timed]
    times = [float(t.median_ms) for t in timed]  # type: ignore[arg-type]
    axes.scatter(numbers, times, s=14, label="trial")
    best, running = math.inf, []
    for value in times:
        best = min(best, value)
        running.append(best)
    axes.step(numbers, running, where="post", color="C3", label="best so far")
    failed = [t.number for t in result.trials if t.outcome == "failed"]
    if failed:
        axes.scatter(
            failed, [max(times)] * len(failed), marker="x", color="C7", label="failed (no time)"
        )
    axes.set_yscale("log")
    axes.set_xlabel("trial")
    axes.set_ylabel(f"{_kind(timed)} time (ms)")
    axes.set_title(f"search history: {title}")
    axes.legend()
    return figure


def _heatmap_family(result: SearchResult) -> tuple[str, tuple[str, str]] | None:
    """The family with the most timed trials among those that name heatmap axes."""
    counts: dict[str, int] = {}
    for trial in result.ranked():
        name = str(trial.params.get("family", ""))
        if name in family_names() and family_named(name).heatmap_axes is not None:
            counts[name] = counts.get(name, 0) + 1
    if not counts:
        return None
    name = max(counts, key=lambda family: counts[family])
    axes = family_named(name).heatmap_axes
    assert axes is not None
    return name, axes


def heatmap_figure(result: SearchResult, title: str) -> Figure | None:
    chosen = _heatmap_family(result)
    if chosen is None:
        return None
    family, (x_name, y_name) = chosen
    best: dict[tuple[int, int], float] = {}
    for trial in result.ranked():
        if trial.params.get("family") != family or not trial.measured:
            continue
        cell = (int(trial.params[x_name]), int(trial.params[y_name]))
        best[cell] = min(best.get(cell, math.inf), trial.median_ms)  # type: ignore[arg-type]
    if not best:
        return None
    tiles = sorted({tile for tile, _ in best})
    rows = sorted({row for _, row in best})
    if len(tiles) < 2 or len(rows) < 2:
        return None  # a line or a point: the table says as much
    grid = [[best.get((tile, row), math.nan) for tile in tiles] for row in rows]
    figure = _figure()
    axes = figure.subplots()
    image = axes.imshow(grid, origin="lower", cmap="viridis_r", aspect="auto")
    axes.set_xticks(range(len(tiles)), [str(t) for t in tiles])
    axes.set_yticks(range(len(rows)), [str(r) for r in rows])
    middle = (min(best.values()) + max(best.values())) / 2
    for y, row in enumerate(grid):
        for x, value in enumerate(row):
            if not math.isnan(value):
                # viridis_r: fast cells are light, slow ones dark.
                color = "black" if value < middle else "white"
                axes.text(x, y, f"{value:.3g}", ha="center", va="center", color=color, fontsize=8)
    axes.set_xlabel(x_name)
    axes.set_ylabel(y_name)
    axes.set_title(f"best measured ms per cell ({family}): {title}")
    figure.colorbar(image, ax=axes, label="ms")
    return figure


def prediction_figure(result: SearchResult, title: str) -> Figure | None:
    # Only GPU timings: without them a trial's time is its prediction, a plot of a line.
    pairs = [
        (t.predicted_ms, t.median_ms, t.params.get("family", ""))
        for t in result.ranked()
        if t.measured and t.predicted_ms is not None and t.median_ms is not None
    ]
    if len(pairs) < 2:
        return None
    figure = _figure()
    axes = figure.subplots()
    for index, family in enumerate(sorted({f for _, _, f in pairs})):
        chosen = [(p, m) for p, m, f in pairs if f == family]
        axes.scatter(*zip(*chosen, strict=True), s=14, color=f"C{index}", label=family)
    low = min(min(p, m) for p, m, _ in pairs)
    high = max(max(p, m) for p, m, _ in pairs)
    axes.plot([low, high], [low, high], color="C7", linewidth=1, label="prediction = time")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("predicted ms (cost model)")
    axes.set_ylabel("measured ms")
    rho = model_rank_correlation(result.ranked())
    note = f", Spearman rho {rho:.2f}" if rho is not None else ""
    axes.set_title(f"predicted vs measured{note}: {title}")
    axes.legend()
    return figure


def _kind(trials: list[TrialOutcome]) -> str:
    return "measured" if any(t.measured for t in trials) else "predicted"
