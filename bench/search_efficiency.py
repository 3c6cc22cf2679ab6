"""How many measurements the search needs: the project's search replayed on recorded H200 grids.

    python bench/search_efficiency.py [--seeds 25] [--budget 30] [--jobs N] \\
        [--out bench/results/search_efficiency.json] [--png bench/results/search_efficiency.png]

Every file under ``bench/data`` is a recording of *every* feasible plan of a
problem timed on a real GPU (``bench/record_replay.py``; one problem's
families may be recorded in several files, merged here), so the grid's best
is known. For each recorded problem, over all its families and (``--per-family``,
the default) within each family that has at least ``MIN_FAMILY_PLANS`` timed
plans, this runs the project's search in process
(``tuner.search.run_search`` with the ``ReplayBackend``, the space and
predictions built as ``tuner.app`` builds them for ``backend=replay``) once per
seed and variant, for ``--budget`` counted trials (measurements: what costs GPU
time; proposals the search answers itself are free and not counted):

* ``default``: the project's defaults (``SearchConfig()``);
* ``random``: uniform random search over the feasible plans, no cost model
  (the baseline the targets compare with);
* optional (``--variants``): ``model`` (the model sampler), ``tpe`` (TPE after
  the cost model's best 8), ``tpe_no_model``, ``random_with_model``.

Held out (the default; ``--in-sample`` turns it off): each problem's
predictions use the cost-model constants fitted on the *other* grids
(``held_out`` in ``tuner/costmodel_calibration.json``, written by
``bench/calibrate_costmodel.py``), so neither the zero-trial pick nor the
search has seen the grid it is scored on. A grid without held-out constants
is reported as in-sample.

Per (problem, family) and variant it reports the trials until the best so far
is within 5% of the grid's best (median and IQR over seeds, seeds that never
got there within the budget ranked last), the fraction of seeds there within
10 and within 20 trials, the best-so-far curves, and the cost model's Spearman
rank correlation against the grid and its zero-trial pick. JSON to ``--out``,
the curves as a PNG to ``--png`` (matplotlib), a markdown table to stdout.

Optuna's in-memory storage replaces the SQLite file the tuner uses: storages
are interchangeable in Optuna and give the same trial sequence for a seed
(``tests/test_search_efficiency.py`` checks it), but SQLite costs ~25x the
time (each trial is a dozen small transactions).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import optuna
import ptxas_resources
from sqlalchemy.engine import make_url

from kernels.backends.replay import (
    Recording,
    ReplayBackend,
    ReplayEntry,
    load_recordings,
    write_recordings,
)
from tuner.config import DeviceConfig, SearchConfig, device_profile_from, space_axes_from
from tuner.costmodel import CALIBRATION_FILE, CostParams, Prediction, predict, rank_correlation
from tuner.device import DeviceProfile
from tuner.environment import Environment
from tuner.planner.families import families_for
from tuner.planner.space import candidate_space
from tuner.planner.tunable import KernelPlan
from tuner.precompile import precompile
from tuner.problem import Problem
from tuner.recorded_space import within_recording
from tuner.search import encoding_for, run_search
from tuner.study_space import StudySpace
from tuner.trials import SearchResult, TrialOutcome

ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = ROOT / "bench" / "data"
RESULTS_DIR = ROOT / "bench" / "results"
#: "within 5% of the grid's best"
WITHIN = 1.05
#: the targets (issue 18): the default search's median within <= 10 trials on held-out
#: grids, and at most half of random's
TARGET_MEDIAN_TRIALS = 10
TARGET_RANDOM_OVER_DEFAULT = 2.0
#: trial counts the fractions of seeds are reported at
WITHIN_TRIALS = (10, 20)
#: a family with fewer timed plans at a problem gets no row of its own
MIN_FAMILY_PLANS = 8

#: name -> SearchConfig overrides (on top of the project's defaults)
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "random": {"sampler": "random", "enqueue_top": 0},
    "model": {"sampler": "model"},
    "tpe": {"sampler": "tpe", "enqueue_top": 8},
    "tpe_no_model": {"sampler": "tpe", "enqueue_top": 0},
    "random_with_model": {"sampler": "random", "enqueue_top": 8},
}
VARIANT_WORDS = {
    "default": "project defaults (SearchConfig())",
    "random": "uniform random over the feasible plans, no cost model",
    "model": "the model sampler: the cost model's ranking corrected by measured residuals",
    "tpe": "TPE after the cost model's top 8 (the default before issue 18)",
    "tpe_no_model": "TPE without the enqueued predictions",
    "random_with_model": "random after the cost model's top 8",
}
DEFAULT_VARIANTS = ("default", "random")


# ---------------------------------------------------------------------- curves (pure)


def best_so_far(trials: Iterable[TrialOutcome], grid_best_ms: float, budget: int) -> list[float]:
    """Best time so far / the grid's best after each counted trial, ``budget`` values.

    Trials count in number order; a failed one counts but times nothing (the
    curve stays inf until the first time). A search that stopped early (every
    candidate evaluated) keeps its last value to the end of the budget.
    """
    counted = sorted((t for t in trials if t.counted), key=lambda t: t.number)[:budget]
    curve: list[float] = []
    best = math.inf
    for trial in counted:
        if trial.timed and trial.median_ms is not None:
            best = min(best, trial.median_ms)
        curve.append(best / grid_best_ms)
    if curve:
        curve += [curve[-1]] * (budget - len(curve))
    else:
        curve = [math.inf] * budget
    return curve


def trials_to_within(curve: Sequence[float], within: float = WITHIN) -> int | None:
    """1-based count of trials until the curve is within ``within`` of the best; None if never."""
    for index, ratio in enumerate(curve):
        # A hair of slack: the grid's best itself divided by itself is exactly 1.0,
        # but a replayed time may pass through a float round-trip.
        if ratio <= within * (1 + 1e-12):
            return index + 1
    return None


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile that lets inf (never reached) take part in the order."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low, high = math.floor(position), math.ceil(position)
    fraction = position - low
    if ordered[low] == math.inf or (fraction > 0 and ordered[high] == math.inf):
        return math.inf
    return ordered[low] + (ordered[high] - ordered[low]) * fraction


def finite_or_none(value: float) -> float | None:
    """JSON has no inf: None stands for "not within the budget"."""
    return value if math.isfinite(value) else None


def trials_summary(counts: Sequence[int | None], budget: int) -> dict[str, Any]:
    """Median, quartiles and misses of per-seed trials-to-within (None: never, ranked last)."""
    values = [math.inf if c is None else float(c) for c in counts]
    return {
        "median": finite_or_none(quantile(values, 0.5)),
        "q25": finite_or_none(quantile(values, 0.25)),
        "q75": finite_or_none(quantile(values, 0.75)),
        "never": sum(1 for c in counts if c is None),
        "seeds": len(counts),
        "budget": budget,
        "per_seed": list(counts),
    }


def curve_band(curves: Sequence[Sequence[float]]) -> dict[str, list[float | None]]:
    """Per trial: median and quartiles over seeds (None where inf: nothing timed yet)."""
    columns = list(zip(*curves, strict=True))
    return {
        name: [finite_or_none(quantile(column, q)) for column in columns]
        for name, q in (("median", 0.5), ("q25", 0.25), ("q75", 0.75))
    }


def random_median_expected(plans: int, good: int) -> int | None:
    """Median trials for uniform random sampling without repeats to hit one of ``good`` plans.

    P(no hit in t draws) = C(plans-good, t) / C(plans, t); the median is the
    smallest t where that is <= 1/2. A cross-check of the simulated ``random``.
    """
    if good <= 0 or plans <= 0:
        return None
    miss = 1.0
    for t in range(1, plans - good + 2):
        miss *= (plans - good - (t - 1)) / (plans - (t - 1))
        if miss <= 0.5:
            return t
    return plans - good + 1


def ratio_of_medians(random: Mapping[str, Any], default: Mapping[str, Any]) -> dict[str, Any]:
    """random's median / default's; a lower bound when random's median is past the budget."""
    if default["median"] is None:
        return {"value": None, "lower_bound": False}
    if random["median"] is None:
        return {"value": (random["budget"] + 1) / default["median"], "lower_bound": True}
    return {"value": random["median"] / default["median"], "lower_bound": False}


# ---------------------------------------------------------------------- one problem


@dataclass
class ProblemSetup:
    """A recorded problem (or one family of it) as the tuner's replay run sees it."""

    path: Path
    index: int
    recording: Recording
    device: DeviceProfile
    feasible: list[KernelPlan]
    rejected: list[KernelPlan]
    predictions: dict[str, Prediction]
    #: recorded median per feasible plan that has a time
    times: dict[str, float]
    #: planner-feasible plans the recording machine's compiler ruled out
    compiler_rejected: int = 0
    #: the replay files the problem's recordings came from
    sources: tuple[Path, ...] = ()
    #: the one family searched, or None for all of the problem's recorded families
    family: str | None = None
    #: whether the predictions use constants fitted without this problem's grid
    held_out: bool = False
    #: the grid's name where it is not the problem's label (a probe's)
    label: str = ""

    @property
    def grid_best(self) -> tuple[str, float]:
        key = min(self.times, key=lambda k: (self.times[k], k))
        return key, self.times[key]


def problems_by_shape(paths: Iterable[Path]) -> dict[Problem, list[tuple[Path, int]]]:
    """(file, index) of every recording timed on a GPU, grouped by problem (a problem's
    families may be recorded in separate files)."""
    found: dict[Problem, list[tuple[Path, int]]] = {}
    for path in paths:
        for index, recording in enumerate(load_recordings(path)):
            if recording.measured:
                found.setdefault(recording.problem, []).append((path, index))
            else:
                print(f"skipped: {path.name} {recording.problem.label()} is not GPU data")
    return found


def recorded_problems(paths: Iterable[Path]) -> list[tuple[Path, int]]:
    """(file, index) of every recording in ``paths`` that was timed on a GPU."""
    return [place for places in problems_by_shape(paths).values() for place in places]


def merged_recording(recordings: Sequence[Recording]) -> Recording:
    """One recording of a problem from several (one per family, say): entries and source
    hashes united; the first one's environment, command and date."""
    first = recordings[0]
    if len({r.problem for r in recordings}) != 1:
        raise ValueError("only recordings of one problem merge")
    entries: dict[str, Any] = {}
    hashes: dict[str, str] = {}
    for recording in recordings:
        entries.update(recording.entries)
        hashes.update(recording.source_hashes)
    return dataclasses.replace(first, entries=entries, source_hashes=hashes)


@functools.cache
def _merged_file(places: tuple[tuple[str, int], ...]) -> Path:
    """A replay file holding the merged recording of ``places`` (written once per process)."""
    recording = merged_recording([load_recordings(path)[index] for path, index in places])
    directory = Path(tempfile.mkdtemp(prefix="search-efficiency-"))
    path = directory / "merged.json"
    write_recordings(path, [recording])
    return path


def held_out_params(label: str) -> CostParams | None:
    """The cost-model constants fitted without ``label``'s grid, if the calibration has them."""
    try:
        data = json.loads(CALIBRATION_FILE.read_text())
    except FileNotFoundError:
        return None
    entry = data.get("held_out", {}).get(label)
    return CostParams.from_dict(entry["params"]) if entry else None


def setup_problem(
    path: Path,
    index: int,
    cubins: str | None = None,
    *,
    also: Sequence[tuple[Path, int]] = (),
    family: str | None = None,
    held_out: bool = False,
    resources: str = "",
) -> ProblemSetup:
    """Space, compiler verdicts and predictions as ``tuner.app`` builds them.

    The project's default axes and device profile (``tuner/conf/``'s h200); plans the
    recording machine's compiler ruled out are dropped before the search, as
    ``tuner.app._candidates`` drops them for ``backend=replay``. With ``cubins``
    (a cubin cache; nvcc compiles what it lacks) the plans are also judged with
    the compiler's register report, as ``tuner.precompile`` judges them before a
    PyCUDA run: the cost model then sees the occupancy the GPU run's sees.
    ``also``: more recordings of the same problem (other families), merged.
    ``family``: only that family's plans. ``held_out``: predictions with the
    constants fitted without this problem (``held_out_params``) where there are some.
    ``resources``: a ``bench/ptxas_resources.py`` file: plans re-judged with ptxas's
    recorded report (registers, spills), as ``tuner.precompile`` judges them.
    """
    places = ((str(path), index), *((str(p), i) for p, i in also))
    if len(places) > 1:
        replay_path, replay_index = _merged_file(places), 0
    else:
        replay_path, replay_index = Path(path), index
    recording = load_recordings(replay_path)[replay_index]
    device = device_profile_from(DeviceConfig())
    # Families the recording predates (no source hash in it) have no timings to replay.
    recorded = [f for f in families_for(recording.problem.dtype) if f in recording.source_hashes]
    if family is not None:
        recorded = [f for f in recorded if f == family]
    axes = space_axes_from(SearchConfig(families=recorded))
    space = candidate_space(recording.problem, device, axes)
    # the replay's one rule (the tuner's too): a tunable or choice added since, what the
    # recording's compiler ruled out, and a key it lacks (a third consumer, a new key tile)
    feasible, compiled_out = within_recording(list(space.feasible), recording)
    if resources:
        feasible, judged_out = ptxas_resources.judged(feasible, _reports(resources), device)
        compiled_out += judged_out
    if cubins is not None:
        feasible, judged_out = precompile(feasible, device, cubins)
        compiled_out += judged_out
    params = held_out_params(recording.problem.label()) if held_out else None
    predictions = {plan.key(): predict(plan, device, params) for plan in feasible}
    times = {
        plan.key(): entry.median_ms
        for plan in feasible
        if (entry := recording.entries.get(plan.key())) is not None and entry.median_ms is not None
    }
    if not times:
        raise ValueError(f"{path.name}: {recording.problem.label()} has no timed feasible plan")
    rejected = [*space.rejected, *compiled_out]
    return ProblemSetup(
        replay_path,
        replay_index,
        recording,
        device,
        feasible,
        rejected,
        predictions,
        times,
        len(compiled_out),
        sources=tuple(Path(p) for p, _ in places),
        family=family,
        held_out=params is not None,
    )


#: shapes of a probe file with fewer timed variants are left out
MIN_PROBE_VARIANTS = 20


def probe_label(shape: str, path: Path) -> str:
    """The name ``bench/calibrate_costmodel.py`` gives a probe grid (its held-out key)."""
    return f"{shape} (probe {path.stem})"


def probe_shapes(path: Path) -> list[int]:
    """Indices of the shapes of a ``bench/mma_probe.py`` file that become grids."""
    import costmodel_mma_f16

    return [
        index
        for index, (_, rows) in enumerate(costmodel_mma_f16.rows_of(str(path)))
        if len(rows) >= MIN_PROBE_VARIANTS
    ]


def setup_probe(
    path: Path,
    index: int,
    held_out: bool = False,
    cubins: str | None = None,
    resources: str = "",
) -> ProblemSetup:
    """A ``bench/mma_probe.py`` shape as a grid: the probe's variants are the whole space.

    The probe timed a hand-picked subset of ``mma_f16`` variants (an earlier kernel
    version, ``bench/results/mma_probe_2026-12-03``), so the search chooses among
    those only and "the grid's best" is the best of them. Its recording is made
    here (a temporary replay file) and is not GPU data of the current kernel.
    ``cubins`` or ``resources``: drop the variants today's compiler rules out
    (spills), as a tuning run would, and give the rest their reported registers.
    """
    import costmodel_mma_f16

    shape, rows = costmodel_mma_f16.rows_of(str(path))[index]
    data = json.loads(path.read_text())
    plans: dict[str, KernelPlan] = {}
    entries = {}
    for ms, plan in rows:
        plans[plan.key()] = plan
        entries[plan.key()] = ReplayEntry(plan.key(), dict(plan.params.as_dict()), ms)
    problem = next(iter(plans.values())).problem
    device = device_profile_from(DeviceConfig())
    environment = Environment(
        str(data.get("gpu", "")),
        f"{device.compute_capability[0]}.{device.compute_capability[1]}",
        device.sm_count,
    )
    recording = Recording(problem, environment, True, str(data.get("command", "")), "", entries)
    replay = Path(tempfile.mkdtemp(prefix="search-efficiency-probe-")) / "probe.json"
    write_recordings(replay, [recording])
    label = probe_label(shape, path)
    params = held_out_params(label) if held_out else None
    feasible = list(plans.values())
    rejected: list[KernelPlan] = []
    if resources:
        feasible, rejected = ptxas_resources.judged(feasible, _reports(resources), device)
    if cubins is not None:
        feasible, judged_out = precompile(feasible, device, cubins)
        rejected += judged_out
    predictions = {plan.key(): predict(plan, device, params) for plan in feasible}
    times = {plan.key(): entries[plan.key()].median_ms for plan in feasible}
    return ProblemSetup(
        replay,
        0,
        recording,
        device,
        feasible,
        rejected,
        predictions,
        times,  # type: ignore[arg-type]
        len(rejected),
        sources=(path,),
        held_out=params is not None,
        label=label,
    )


@functools.cache
def _reports(path: str) -> dict[str, dict[str, Any]]:
    return ptxas_resources.load(Path(path))


#: (file, index) places of one problem, a family or None, cubins, held out, the
#: ptxas resources file or ""; a probe file's place is ("probe:<path>", shape index)
Unit = tuple[tuple[tuple[str, int], ...], str | None, str | None, bool, str]


@functools.cache
def _cached_setup(unit: Unit) -> ProblemSetup:
    places, family, cubins, held_out, resources = unit
    (path, index), *also = places
    if path.startswith("probe:"):
        probe = Path(path.removeprefix("probe:"))
        return setup_probe(probe, index, held_out, cubins, resources)
    return setup_problem(
        Path(path),
        index,
        cubins,
        also=[(Path(p), i) for p, i in also],
        family=family,
        held_out=held_out,
        resources=resources,
    )


class MemoryStorage(optuna.storages.InMemoryStorage):
    """Optuna's in-memory storage, with the ``engine.url`` an RDB storage has.

    ``run_search`` shows the storage's URL in its result; older versions of it
    read ``storage.engine.url`` unconditionally, so the attribute keeps this
    script working with either.
    """

    engine = SimpleNamespace(url=make_url("memory://"))


def search_once(
    setup: ProblemSetup,
    variant: str,
    seed: int,
    budget: int,
    storage: Any | None = None,
) -> list[TrialOutcome]:
    """One search of ``setup``'s problem with ``VARIANTS[variant]``; every trial of the study."""
    settings = SearchConfig(**(VARIANTS[variant] | {"seed": seed, "n_trials": budget}))
    return search_with(setup, settings, f"{variant}-{seed}", storage).trials


def search_with(
    setup: ProblemSetup, settings: SearchConfig, name: str, storage: Any | None = None
) -> SearchResult:
    """One search of ``setup``'s problem with ``settings`` (in memory unless ``storage``)."""
    space = StudySpace(
        setup.recording.problem,
        setup.device,
        setup.feasible,
        setup.rejected,
        encoding=encoding_for(settings.sampler),
    )
    return run_search(
        space,
        ReplayBackend(setup.path),
        settings,
        storage=storage if storage is not None else MemoryStorage(),
        study_name=name,
        predictions=setup.predictions,
    )


def _curve_task(task: tuple[Unit, str, int, int]) -> tuple[Unit, str, int, list[float]]:
    unit, variant, seed, budget = task
    setup = _cached_setup(unit)
    trials = search_once(setup, variant, seed, budget)
    return unit, variant, seed, best_so_far(trials, setup.grid_best[1], budget)


def cost_model_figures(setup: ProblemSetup) -> dict[str, Any]:
    """How well the cost model ranks the recorded grid, and what its top 8 holds."""
    keys = sorted(setup.times)
    rho = rank_correlation(
        [setup.predictions[k].time_ms for k in keys], [setup.times[k] for k in keys]
    )
    ranked = sorted(keys, key=lambda k: (setup.predictions[k].time_ms, k))
    best_key, best_ms = setup.grid_best
    top = 8
    return {
        "spearman": None if math.isnan(rho) else rho,
        "pairs": len(keys),
        "predicted_best": ranked[0],
        "predicted_best_over_grid_best": setup.times[ranked[0]] / best_ms,
        "predicted_over_measured_at_best": setup.predictions[best_key].time_ms / best_ms,
        f"top{top}_within_5pct": sum(1 for k in ranked[:top] if setup.times[k] <= WITHIN * best_ms),
        f"top{top}_best_over_grid_best": min(setup.times[k] for k in ranked[:top]) / best_ms,
        "grid_best_predicted_rank": ranked.index(best_key) + 1,
    }


def problem_facts(setup: ProblemSetup) -> dict[str, Any]:
    best_key, best_ms = setup.grid_best
    recording = setup.recording
    settings = SearchConfig()
    traffic = {p.key(): setup.predictions[p.key()].traffic_bytes for p in setup.feasible}
    cutoff = settings.traffic_cutoff * min(traffic.values())
    allowed = [k for k in traffic if k in setup.times and traffic[k] <= cutoff]
    good = [k for k in setup.times if setup.times[k] <= WITHIN * best_ms]
    return {
        "files": [
            str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)
            for p in (setup.sources or (setup.path,))
        ],
        "problem": setup.label or recording.problem.label(),
        "family": setup.family or "all",
        "held_out": setup.held_out,
        "recorded_on": recording.environment.gpu_name,
        "recorded_measured": recording.measured,
        "recording_date": recording.date,
        "feasible_plans": len(setup.feasible),
        "timed_plans": len(setup.times),
        "compiler_rejected": setup.compiler_rejected,
        "grid_best": {"key": best_key, "ms": best_ms},
        "plans_within_5pct": len(good),
        "grid_best_within_traffic_cutoff": best_key in allowed,
        "random_median_expected": random_median_expected(
            len([k for k in traffic if traffic[k] <= cutoff]),
            len([k for k in good if k in allowed]),
        ),
        "cost_model": cost_model_figures(setup),
    }


# ---------------------------------------------------------------------- the whole run


def search_units(
    paths: Iterable[Path],
    cubins: str | None,
    per_family: bool,
    held_out: bool,
    probes: Iterable[Path] = (),
    resources: str = "",
) -> list[Unit]:
    """Every (problem, family or all) to search: all families, then each with enough plans;
    then every shape of the probe files."""
    units: list[Unit] = [
        (((f"probe:{path}", index),), None, cubins, held_out, resources)
        for path in probes
        for index in probe_shapes(path)
    ]
    for places in problems_by_shape(paths).values():
        key = tuple((str(p), i) for p, i in places)
        whole: Unit = (key, None, cubins, held_out, resources)
        units.append(whole)
        if not per_family:
            continue
        setup = _cached_setup(whole)
        counts: dict[str, int] = {}
        for plan in setup.feasible:
            if plan.key() in setup.times:
                counts[plan.family] = counts.get(plan.family, 0) + 1
        families = [f for f, n in sorted(counts.items()) if n >= MIN_FAMILY_PLANS]
        if len(families) > 1:
            units += [(key, family, cubins, held_out, resources) for family in families]
    return units


def run_all(
    units: Sequence[Unit],
    seeds: int,
    budget: int,
    variants: Sequence[str],
    jobs: int,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Every (unit, variant, seed) search; per unit its facts and per-variant results."""
    # Built here first (compiling, where asked, once): forked workers inherit the cache.
    setups = {unit: _cached_setup(unit) for unit in units}
    tasks = [
        (unit, variant, seed, budget)
        for unit in units
        for variant in variants
        for seed in range(seeds)
    ]
    curves: dict[tuple[Unit, str], list[list[float]]] = {}
    began = time.monotonic()
    if jobs > 1 and len(tasks) > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            # Ordered by task: one problem's setup is built once per worker and reused.
            results = list(pool.map(_curve_task, tasks, chunksize=max(1, seeds // 2)))
    else:
        results = [_curve_task(task) for task in tasks]
    for unit, variant, _seed, curve in results:
        curves.setdefault((unit, variant), []).append(curve)
    log(f"{len(tasks)} searches in {time.monotonic() - began:.0f} s")

    report = []
    for unit in units:
        entry = problem_facts(setups[unit])
        entry["variants"] = {}
        for variant in variants:
            runs = curves[(unit, variant)]
            counts = [trials_to_within(c) for c in runs]
            entry["variants"][variant] = {
                "settings": VARIANTS[variant],
                "trials_to_within_5pct": trials_summary(counts, budget),
                "fraction_within": {
                    str(n): sum(1 for c in counts if c is not None and c <= n) / len(counts)
                    for n in WITHIN_TRIALS
                    if n <= budget
                },
                # Stricter: the grid's best plan itself (or one as fast).
                "trials_to_grid_best": trials_summary(
                    [trials_to_within(c, 1.0) for c in runs], budget
                ),
                "final_ratio": trials_summary_of_values([c[-1] for c in runs]),
                "curve": curve_band(runs),
            }
        entry["targets"] = problem_targets(entry["variants"])
        report.append(entry)
    return report


def trials_summary_of_values(values: Sequence[float]) -> dict[str, float | None]:
    return {
        "median": finite_or_none(quantile(values, 0.5)),
        "q25": finite_or_none(quantile(values, 0.25)),
        "q75": finite_or_none(quantile(values, 0.75)),
        "worst": finite_or_none(max(values)),
    }


def problem_targets(variants: Mapping[str, Any]) -> dict[str, Any]:
    """Pass/miss of the two search targets for one problem (where both variants ran)."""
    if "default" not in variants:
        return {}
    default = variants["default"]["trials_to_within_5pct"]
    median = default["median"]
    targets: dict[str, Any] = {
        "default_median_trials": median,
        "default_median_within_target": median is not None and median <= TARGET_MEDIAN_TRIALS,
    }
    if "random" in variants:
        ratio = ratio_of_medians(variants["random"]["trials_to_within_5pct"], default)
        targets["random_over_default"] = ratio
        targets["random_needs_2x"] = (
            ratio["value"] is not None and ratio["value"] >= TARGET_RANDOM_OVER_DEFAULT
        )
    return targets


#: the code the results depend on (the search, its space, the model, the replay)
SOURCES = (
    "tuner/search.py",
    "tuner/claims.py",
    "tuner/study_space.py",
    "tuner/costmodel.py",
    "tuner/costmodel_calibration.json",
    "tuner/model_sampler.py",
    "tuner/stopping.py",
    "tuner/planner/tunable.py",
    "tuner/planner/space.py",
    "kernels/backends/replay.py",
)


def code_state() -> dict[str, Any]:
    """The commit, and the sha256 of each source the numbers depend on, with those that
    differ from the commit (others edit the tree while this runs)."""
    import hashlib
    import subprocess

    def git(*args: str) -> str:
        try:
            done = subprocess.run(
                ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30, check=False
            )
        except OSError:
            return ""
        # rstrip only: porcelain lines start with a status column that may be a space
        return done.stdout.rstrip() if done.returncode == 0 else ""

    hashes = {
        name: hashlib.sha256((ROOT / name).read_bytes()).hexdigest()[:16]
        for name in SOURCES
        if (ROOT / name).exists()
    }
    changed = git("status", "--porcelain", "--", *hashes).splitlines()
    return {
        "commit": git("rev-parse", "HEAD").strip(),
        "sources_sha256": hashes,
        "uncommitted": sorted(line[3:] for line in changed),
    }


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "optuna": optuna.__version__,
        "platform": platform.platform(),
    }


def format_summary(report: Mapping[str, Any]) -> str:
    """The markdown table for ``bench/README.md``: one row per (problem, family)."""
    variants = list(report["settings"]["variants"])
    budget = report["settings"]["budget"]
    head = "| problem | family | held out | timed plans (within 5%) | Spearman | pick / best "
    rule = "|---|---|---|---|---|---|"
    for name in variants:
        fractions = " ".join(f"<={n}" for n in WITHIN_TRIALS if n <= budget)
        head += f"| {name}: median trials to 5% (IQR); seeds {fractions} "
        rule += "---|"
    if "default" in variants and "random" in variants:
        head += "| random / default "
        rule += "---|"
    lines = [head + "|", rule]
    for entry in report["problems"]:
        facts = entry["cost_model"]
        row = (
            f"| {entry['problem']} | {entry['family']} | {'yes' if entry['held_out'] else 'no'} "
            f"| {entry['timed_plans']} ({entry['plans_within_5pct']}) "
            f"| {_num(facts['spearman'], '.2f')} | {facts['predicted_best_over_grid_best']:.3f} "
        )
        for name in variants:
            result = entry["variants"][name]
            t = result["trials_to_within_5pct"]
            over = f"> {budget}"
            fractions = " / ".join(f"{value:.2f}" for value in result["fraction_within"].values())
            row += (
                f"| {_num(t['median'], 'g', over)} ({_num(t['q25'], 'g', over)}-"
                f"{_num(t['q75'], 'g', over)}); {fractions} "
            )
        targets = entry["targets"]
        if "random_over_default" in targets:
            ratio = targets["random_over_default"]
            bound = ">= " if ratio["lower_bound"] else ""
            row += f"| {bound}{_num(ratio['value'], '.1f', 'n/a')} "
        lines.append(row + "|")
    return "\n".join(lines)


def _num(value: float | None, spec: str = "g", none: str = "never") -> str:
    return none if value is None else format(value, spec)


def _word(ok: bool) -> str:
    return "PASS" if ok else "MISS"


# ---------------------------------------------------------------------- plot

#: colour, line style, width, drawing order: the default on top, since the
#: model-seeded variants coincide where the model's first pick is within 5% already
STYLES: dict[str, tuple[str, str, float, int]] = {
    "default": ("tab:blue", "-", 2.6, 4),
    "random": ("tab:red", "-", 1.6, 3),
    "tpe_no_model": ("tab:green", "-", 1.4, 2),
    "random_with_model": ("tab:orange", "--", 1.4, 5),
    "model": ("tab:purple", "-", 1.4, 3),
    "tpe": ("tab:brown", "-", 1.4, 2),
}


def write_plot(report: Mapping[str, Any], path: Path) -> Path:
    """Best so far / grid best against counted trials: median and IQR band per variant."""
    from matplotlib.figure import Figure

    def clean(values: list[float | None]) -> list[float]:
        return [math.nan if v is None else v for v in values]

    # One panel per problem, over all its families (the per-family rows are in the table).
    problems = [entry for entry in report["problems"] if entry["family"] == "all"]
    columns = min(len(problems), 3) if len(problems) > 3 else len(problems)
    rows = math.ceil(len(problems) / columns)
    figure = Figure(figsize=(5.4 * columns, 4.0 * rows + 0.4), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False).flatten()
    for ax in axes[len(problems) :]:
        ax.set_visible(False)
    for ax, entry in zip(axes, problems, strict=False):
        for name, result in entry["variants"].items():
            band = result["curve"]
            x = list(range(1, len(band["median"]) + 1))
            colour, style, width, order = STYLES.get(name, ("tab:purple", "-", 1.4, 1))
            t = result["trials_to_within_5pct"]
            median = _num(t["median"], "g", f"> {t['budget']}")
            ax.plot(
                x,
                clean(band["median"]),
                color=colour,
                ls=style,
                lw=width,
                zorder=order,
                label=f"{name}: median {median} to 5%",
            )
            ax.fill_between(
                x, clean(band["q25"]), clean(band["q75"]), color=colour, alpha=0.13, lw=0
            )
        ax.axhline(WITHIN, color="grey", ls=":", lw=1)
        ax.set_ylim(0.98, 1.6)
        ax.set_xlim(1, len(band["median"]))
        ax.set_xlabel("measurements (counted trials)")
        ax.set_ylabel("best so far / grid best")
        facts = entry["cost_model"]
        ax.set_title(
            f"{entry['problem']}{'' if entry['held_out'] else ' (in sample)'}: "
            f"{entry['timed_plans']} plans, "
            f"{entry['plans_within_5pct']} within 5%\n"
            f"cost model Spearman {_num(facts['spearman'], '.2f')}",
            fontsize=9,
        )
        ax.legend(fontsize=7, loc="upper right")
    settings = report["settings"]
    figure.suptitle(
        f"search replayed on recorded H200 grids, held-out predictions: median and IQR over "
        f"{settings['seeds']} "
        "seeds (dotted: within 5%)",
        fontsize=10,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path


# ---------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", type=Path, nargs="+", help="replay files (default: every bench/data/*.json)"
    )
    parser.add_argument("--seeds", type=int, default=25, help="seeds per variant (0..N-1)")
    parser.add_argument("--budget", type=int, default=30, help="counted trials per search")
    parser.add_argument(
        "--variants", nargs="+", choices=list(VARIANTS), default=list(DEFAULT_VARIANTS)
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--per-family",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also search each family of a problem on its own",
    )
    parser.add_argument(
        "--resources",
        default=str(ptxas_resources.DEFAULT_FILE),
        help="ptxas reports (bench/ptxas_resources.py): plans judged with their registers "
        "and spills as before a GPU run; '' for the planner alone (default: %(default)s)",
    )
    parser.add_argument(
        "--probe",
        type=Path,
        nargs="*",
        default=[],
        help="bench/mma_probe.py JSON: each shape's timed variants as a grid of its own",
    )
    parser.add_argument(
        "--in-sample",
        action="store_true",
        help="predict with the shipped constants (fitted on every grid) instead of held out",
    )
    parser.add_argument(
        "--cubins",
        default=None,
        metavar="DIR",
        help="cubin cache: judge plans with the compiler's register report as a GPU run does "
        "(nvcc compiles what the cache lacks); default: as backend=replay, planner only",
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "search_efficiency.json")
    parser.add_argument(
        "--png", default=str(RESULTS_DIR / "search_efficiency.png"), help="'' for none"
    )
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.budget < 1:
        parser.error("--seeds and --budget must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    paths = args.data or sorted(DATA_DIR.glob("*.json"))
    began = time.monotonic()
    cubins = str(Path(args.cubins).expanduser()) if args.cubins else None
    resources = args.resources if args.resources and Path(args.resources).exists() else ""
    units = search_units(
        paths,
        cubins,
        args.per_family,
        held_out=not args.in_sample,
        probes=args.probe,
        resources=resources,
    )
    if not units:
        print(f"no GPU recordings in {', '.join(map(str, paths)) or DATA_DIR}")
        return 1
    results = run_all(units, args.seeds, args.budget, args.variants, args.jobs)
    report: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "bench/search_efficiency.py", *(argv or sys.argv[1:])]),
        "machine": machine(),
        "code": code_state(),
        "seconds": round(time.monotonic() - began, 1),
        "settings": {
            "seeds": args.seeds,
            "budget": args.budget,
            "within": WITHIN,
            "predictions": (
                "in-sample: the shipped constants, fitted on every grid"
                if args.in_sample
                else "held out: constants fitted without the problem's grid"
            )
            + (
                "; register-aware: plans judged with the compiler's report"
                if cubins
                else f"; plans judged with the recorded ptxas reports in {resources}"
                if resources
                else "; planner only, as python -m tuner backend=replay"
            ),
            "defaults": dataclasses.asdict(SearchConfig()),
            "variants": {name: VARIANT_WORDS[name] for name in args.variants},
            "trials_counted": "measured or failed trials (what costs GPU time); "
            "free proposals (duplicate, infeasible, over the traffic cutoff) not counted",
        },
        "problems": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(format_summary(report))
    print(f"written: {args.out} ({report['seconds']:.0f} s)")
    if args.png:
        try:
            print(f"written: {write_plot(report, Path(args.png))}")
        except ImportError:
            print("plot: none (matplotlib is not installed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
