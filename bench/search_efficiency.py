"""How many measurements the search needs: the project's search replayed on recorded H200 grids.

    python bench/search_efficiency.py [--seeds 50] [--budget 60] [--jobs N] \\
        [--out bench/results/search_efficiency.json] [--png bench/results/search_efficiency.png]

Every file under ``bench/data`` is a recording of *every* feasible plan of a
problem timed on a real GPU (``bench/record_replay.py``), so the grid's best is
known. For each recorded problem this runs the project's search in process
(``tuner.search.run_search`` with the ``ReplayBackend``, the space and
predictions built as ``tuner.app`` builds them for ``backend=replay``) once per
seed and variant, for ``--budget`` counted trials (measurements: what costs GPU
time; proposals the search answers itself are free and not counted):

* ``default``: the project's defaults (``SearchConfig()``: TPE, the cost
  model's best 8 enqueued first, traffic cutoff 16);
* ``random``: uniform random search over the feasible plans, no cost model
  (the baseline the targets compare with);
* ``tpe_no_model``: TPE without the enqueued predictions;
* ``random_with_model``: random after the enqueued predictions (what
  ``search=random`` on the command line runs).

The last two separate what the cost model and what TPE contribute. Per
variant it reports the trials until the best so far is within 5% of the grid's
best (median and IQR over seeds, and how many seeds never got there within
the budget), the best-so-far curves, and per problem the cost model's Spearman
rank correlation against the grid (``tuner.costmodel.rank_correlation``). JSON
to ``--out``, the curves as a PNG to ``--png`` (matplotlib), a summary to stdout.

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
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import optuna
from sqlalchemy.engine import make_url

from kernels.backends.replay import Recording, ReplayBackend, load_recordings
from tuner.config import DeviceConfig, SearchConfig, device_profile_from, space_axes_from
from tuner.costmodel import Prediction, predict, rank_correlation
from tuner.device import DeviceProfile
from tuner.planner.families import families_for
from tuner.planner.space import candidate_space
from tuner.planner.tunable import KernelPlan
from tuner.precompile import precompile
from tuner.search import encoding_for, run_search
from tuner.study_space import StudySpace
from tuner.trials import TrialOutcome

ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = ROOT / "bench" / "data"
RESULTS_DIR = ROOT / "bench" / "results"
#: "within 5% of the grid's best"
WITHIN = 1.05
#: the targets: the default search's median within <= 20 trials, at most half of random's
TARGET_MEDIAN_TRIALS = 20
TARGET_RANDOM_OVER_DEFAULT = 2.0

#: name -> SearchConfig overrides (on top of the project's defaults)
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "random": {"sampler": "random", "enqueue_top": 0},
    "tpe_no_model": {"enqueue_top": 0},
    "random_with_model": {"sampler": "random"},
}
VARIANT_WORDS = {
    "default": "project defaults: TPE + the cost model's top 8 enqueued first",
    "random": "uniform random over the feasible plans, no cost model",
    "tpe_no_model": "TPE without the enqueued predictions",
    "random_with_model": "random after the cost model's top 8 (the CLI's search=random)",
}


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
    """A recorded problem as the tuner's replay run sees it."""

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

    @property
    def grid_best(self) -> tuple[str, float]:
        key = min(self.times, key=lambda k: (self.times[k], k))
        return key, self.times[key]


def setup_problem(path: Path, index: int, cubins: str | None = None) -> ProblemSetup:
    """Space, compiler verdicts and predictions as ``tuner.app`` builds them.

    The project's default axes and device profile (``tuner/conf/``'s h200); plans the
    recording machine's compiler ruled out are dropped before the search, as
    ``tuner.app._candidates`` drops them for ``backend=replay``. With ``cubins``
    (a cubin cache; nvcc compiles what it lacks) the plans are also judged with
    the compiler's register report, as ``tuner.precompile`` judges them before a
    PyCUDA run: the cost model then sees the occupancy the GPU run's sees.
    """
    recording = load_recordings(path)[index]
    device = device_profile_from(DeviceConfig())
    # Families the recording predates (no source hash in it) have no timings to replay.
    recorded = [f for f in families_for(recording.problem.dtype) if f in recording.source_hashes]
    axes = space_axes_from(SearchConfig(families=recorded))
    space = candidate_space(recording.problem, device, axes)
    feasible: list[KernelPlan] = []
    compiled_out: list[KernelPlan] = []
    for plan in space.feasible:
        reason = recording.rejection(plan.key())
        if reason:
            compiled_out.append(dataclasses.replace(plan, feasible=False, reason=reason))
        else:
            feasible.append(plan)
    if cubins is not None:
        feasible, judged_out = precompile(feasible, device, cubins)
        compiled_out += judged_out
    predictions = {plan.key(): predict(plan, device) for plan in feasible}
    times = {
        plan.key(): entry.median_ms
        for plan in feasible
        if (entry := recording.entries.get(plan.key())) is not None and entry.median_ms is not None
    }
    if not times:
        raise ValueError(f"{path.name}: {recording.problem.label()} has no timed feasible plan")
    rejected = [*space.rejected, *compiled_out]
    return ProblemSetup(
        path, index, recording, device, feasible, rejected, predictions, times, len(compiled_out)
    )


@functools.cache
def _cached_setup(path: str, index: int, cubins: str | None) -> ProblemSetup:
    return setup_problem(Path(path), index, cubins)


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
    space = StudySpace(
        setup.recording.problem,
        setup.device,
        setup.feasible,
        setup.rejected,
        encoding=encoding_for(settings.sampler),
    )
    result = run_search(
        space,
        ReplayBackend(setup.path),
        settings,
        storage=storage if storage is not None else MemoryStorage(),
        study_name=f"{variant}-{seed}",
        predictions=setup.predictions,
    )
    return result.trials


def _curve_task(
    task: tuple[str, int, str | None, str, int, int],
) -> tuple[str, int, str, int, list[float]]:
    path, index, cubins, variant, seed, budget = task
    setup = _cached_setup(path, index, cubins)
    trials = search_once(setup, variant, seed, budget)
    return path, index, variant, seed, best_so_far(trials, setup.grid_best[1], budget)


def cost_model_figures(setup: ProblemSetup) -> dict[str, Any]:
    """How well the cost model ranks the recorded grid, and what its top 8 holds."""
    keys = sorted(setup.times)
    rho = rank_correlation(
        [setup.predictions[k].time_ms for k in keys], [setup.times[k] for k in keys]
    )
    ranked = sorted(keys, key=lambda k: (setup.predictions[k].time_ms, k))
    _, best_ms = setup.grid_best
    top = SearchConfig().enqueue_top
    return {
        "spearman": None if math.isnan(rho) else rho,
        "pairs": len(keys),
        "predicted_best": ranked[0],
        "predicted_best_over_grid_best": setup.times[ranked[0]] / best_ms,
        f"top{top}_within_5pct": sum(1 for k in ranked[:top] if setup.times[k] <= WITHIN * best_ms),
        f"top{top}_best_over_grid_best": min(setup.times[k] for k in ranked[:top]) / best_ms,
        "grid_best_predicted_rank": ranked.index(setup.grid_best[0]) + 1,
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
        "file": str(setup.path.relative_to(ROOT))
        if setup.path.is_relative_to(ROOT)
        else str(setup.path),
        "problem": recording.problem.label(),
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


def recorded_problems(paths: Iterable[Path]) -> list[tuple[Path, int]]:
    """(file, index) of every recording in ``paths`` that was timed on a GPU."""
    found = []
    for path in paths:
        for index, recording in enumerate(load_recordings(path)):
            if recording.measured:
                found.append((path, index))
            else:
                print(f"skipped: {path.name} {recording.problem.label()} is not GPU data")
    return found


def run_all(
    problems: Sequence[tuple[Path, int]],
    seeds: int,
    budget: int,
    variants: Sequence[str],
    jobs: int,
    cubins: str | None = None,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Every (problem, variant, seed) search; per problem its facts and per-variant results."""
    # Built here first (compiling, where asked, once): forked workers inherit the cache.
    setups = {(str(p), i): _cached_setup(str(p), i, cubins) for p, i in problems}
    tasks = [
        (str(path), index, cubins, variant, seed, budget)
        for path, index in problems
        for variant in variants
        for seed in range(seeds)
    ]
    curves: dict[tuple[str, int, str], list[list[float]]] = {}
    began = time.monotonic()
    if jobs > 1 and len(tasks) > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            # Ordered by task: one problem's setup is built once per worker and reused.
            results = list(pool.map(_curve_task, tasks, chunksize=max(1, seeds // 2)))
    else:
        results = [_curve_task(task) for task in tasks]
    for path, index, variant, _seed, curve in results:
        curves.setdefault((path, index, variant), []).append(curve)
    log(f"{len(tasks)} searches in {time.monotonic() - began:.0f} s")

    report = []
    for path, index in problems:
        setup = setups[(str(path), index)]
        entry = problem_facts(setup)
        entry["variants"] = {}
        for variant in variants:
            runs = curves[(str(path), index, variant)]
            entry["variants"][variant] = {
                "settings": VARIANTS[variant],
                "trials_to_within_5pct": trials_summary(
                    [trials_to_within(c) for c in runs], budget
                ),
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
        "default_median_within_20": median is not None and median <= TARGET_MEDIAN_TRIALS,
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
    lines = []
    for entry in report["problems"]:
        facts = entry["cost_model"]
        best = entry["grid_best"]
        lines.append(
            f"{entry['problem']} ({entry['file']}, {entry['timed_plans']} timed plans, "
            f"{entry['plans_within_5pct']} within 5% of the best {best['key']} "
            f"{best['ms']:.4f} ms; cost model Spearman {_num(facts['spearman'], '.3f')}, "
            f"its first pick {facts['predicted_best_over_grid_best']:.3f}x the best)"
        )
        for name, result in entry["variants"].items():
            t = result["trials_to_within_5pct"]
            exact = result["trials_to_grid_best"]
            lines.append(
                f"  {name:18s} to within 5%: median {_num(t['median'])} "
                f"IQR {_num(t['q25'])}-{_num(t['q75'])}, never {t['never']}/{t['seeds']}; "
                f"to the grid best: median {_num(exact['median'])}; "
                f"final best/grid median {_num(result['final_ratio']['median'], '.3f')}"
            )
        targets = entry["targets"]
        if "random_over_default" in targets:
            ratio = targets["random_over_default"]
            bound = ">=" if ratio["lower_bound"] else "="
            lines.append(
                f"  random/default {bound} {_num(ratio['value'], '.2f')} (random's median by "
                f"the closed form: {_num(entry['random_median_expected'])}); targets: "
                f"median <= {TARGET_MEDIAN_TRIALS} "
                f"{_word(targets['default_median_within_20'])}, random/default >= "
                f"{TARGET_RANDOM_OVER_DEFAULT:g} {_word(targets['random_needs_2x'])}"
            )
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
}


def write_plot(report: Mapping[str, Any], path: Path) -> Path:
    """Best so far / grid best against counted trials: median and IQR band per variant."""
    from matplotlib.figure import Figure

    def clean(values: list[float | None]) -> list[float]:
        return [math.nan if v is None else v for v in values]

    problems = report["problems"]
    columns = min(len(problems), 2) if len(problems) > 3 else len(problems)
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
        ax.set_xlabel("measurements (counted trials)")
        ax.set_ylabel("best so far / grid best")
        facts = entry["cost_model"]
        ax.set_title(
            f"{entry['problem']}: {entry['timed_plans']} plans, "
            f"{entry['plans_within_5pct']} within 5%\n"
            f"cost model Spearman {_num(facts['spearman'], '.2f')}",
            fontsize=9,
        )
        ax.legend(fontsize=7, loc="upper right")
    settings = report["settings"]
    figure.suptitle(
        f"search replayed on recorded H200 grids: median and IQR over {settings['seeds']} "
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
    parser.add_argument("--seeds", type=int, default=50, help="seeds per variant (0..N-1)")
    parser.add_argument("--budget", type=int, default=60, help="counted trials per search")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
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
    problems = recorded_problems(paths)
    if not problems:
        print(f"no GPU recordings in {', '.join(map(str, paths)) or DATA_DIR}")
        return 1
    began = time.monotonic()
    cubins = str(Path(args.cubins).expanduser()) if args.cubins else None
    results = run_all(problems, args.seeds, args.budget, args.variants, args.jobs, cubins)
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
                "register-aware: plans judged with the compiler's report, as before a GPU run"
                if cubins
                else "planner only, as python -m tuner backend=replay"
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
    print(f"written: {args.out}")
    if args.png:
        try:
            print(f"written: {write_plot(report, Path(args.png))}")
        except ImportError:
            print("plot: none (matplotlib is not installed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
