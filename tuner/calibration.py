"""Fitting the cost model's constants to recorded grids, and scoring it out of sample.

Pure (numpy and ``tuner.costmodel``): a ``Grid`` is one recorded problem, every
timed plan with its features (``tuner.costmodel.feature_table``) and measured
median. ``fit`` chooses the ``CostParams`` that minimise the squared log error
of predicted against measured time over the training grids; ``score`` says how
the model ranks a grid it was not fitted on (Spearman per family, the zero-trial
pick's distance to the grid's best); ``leave_one_out`` does both for every grid
in turn, fitting on the others only.

The loss weighs every (grid, family) group equally, and within a group the fast
plans most (weight ``1 / (1 + 4 (t / t_best - 1))``): the search lives at the
top of the ranking, and a grid of 400 plans should not drown one of 40. It is
the absolute error, not only the order: which family to try first at a shape is
a comparison of predicted times across families.

Only constants the training grids can identify are fitted: a pipe's efficiency
stays at its starting value unless some training plan runs on that pipe. A weak
prior (``PRIOR_WEIGHT`` x the squared log distance from ``START``, the
datasheet-and-microbenchmark values) keeps a constant the grids barely constrain
where physics puts it instead of at a bound: the SIMT float32 grids, say, hardly
depend on the DRAM bandwidth, which decode depends on entirely.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from tuner.costmodel import PIPES, CostParams, feature_table, model_times, rank_correlation
from tuner.device import DeviceProfile
from tuner.planner.plan import KernelPlan

#: constant -> (lower, upper) bound: physically plausible ranges on an sm_90 GPU
BOUNDS: dict[str, tuple[float, float]] = {
    "dram_efficiency": (0.5, 1.1),
    "l2_over_dram": (1.0, 8.0),
    "dram_latency_us": (0.1, 4.0),
    "ffma_efficiency": (0.1, 1.2),
    "mma_f16_efficiency": (0.1, 1.2),
    "mma_tf32_efficiency": (0.1, 1.2),
    "wgmma_f16_efficiency": (0.1, 1.2),
    "issue_efficiency": (0.1, 2.0),
    "latency_cycles": (4.0, 512.0),
    "max_ilp": (1.0, 256.0),
    "overlap": (1.0, 32.0),
    "overlap_synchronous": (1.0, 32.0),
    "softmax_hiding": (0.01, 0.95),
    "shared_contention": (1.0, 64.0),
}
#: where a fit starts: datasheet rates, a DRAM latency of the order Hopper's is
#: measured at (about 0.5-1 us under load), L2 at about twice DRAM's bandwidth
START = CostParams(
    dram_efficiency=0.9,
    l2_over_dram=2.5,
    dram_latency_us=0.8,
    ffma_efficiency=0.7,
    mma_f16_efficiency=0.7,
    mma_tf32_efficiency=0.7,
    wgmma_f16_efficiency=0.7,
    issue_efficiency=1.0,
    latency_cycles=48.0,
    max_ilp=32.0,
    overlap=4.0,
    overlap_synchronous=2.0,
    softmax_hiding=0.2,
    shared_contention=2.0,
)
_PIPE_CONSTANTS = {
    "ffma": "ffma_efficiency",
    "mma_sync_f16": "mma_f16_efficiency",
    "mma_sync_tf32": "mma_tf32_efficiency",
    "wgmma_f16": "wgmma_f16_efficiency",
}
#: plans from which a (grid, family) group weighs fully in the loss: one measured plan
#: (a tuned plan's time, no grid) pins the absolute scale without outweighing a grid
FULL_GROUP_PLANS = 4
#: the top-of-the-grid emphasis of the loss (see the module docstring)
FAST_WEIGHT_SLOPE = 4.0
#: weight of the prior's squared log distance from ``START`` per fitted constant: a
#: factor of 2 away costs 0.0024, against a loss of about 0.02-0.05 on real grids
PRIOR_WEIGHT = 0.005


@dataclass(frozen=True)
class Grid:
    """One recorded problem: every timed plan, its features and its measured median."""

    label: str
    keys: tuple[str, ...]
    families: tuple[str, ...]
    table: Mapping[str, np.ndarray]
    measured_ms: np.ndarray

    @classmethod
    def of(
        cls, label: str, timed: Sequence[tuple[KernelPlan, float]], device: DeviceProfile
    ) -> Grid:
        if not timed:
            raise ValueError(f"grid {label} has no timed plan")
        plans = [plan for plan, _ in timed]
        return cls(
            label=label,
            keys=tuple(plan.key() for plan in plans),
            families=tuple(plan.family for plan in plans),
            table=feature_table(plans, device),
            measured_ms=np.array([ms for _, ms in timed], dtype=float),
        )

    def family_mask(self, family: str) -> np.ndarray:
        return np.array([f == family for f in self.families])

    @property
    def family_names(self) -> list[str]:
        return sorted(set(self.families))

    @property
    def pipes(self) -> set[str]:
        return {PIPES[int(i)] for i in self.table["pipe"]}


def weights(grid: Grid) -> np.ndarray:
    """Loss weight per plan: each family's group sums to 1, its fast plans weigh most."""
    result = np.zeros(len(grid.keys))
    for family in grid.family_names:
        mask = grid.family_mask(family)
        times = grid.measured_ms[mask]
        raw = 1.0 / (1.0 + FAST_WEIGHT_SLOPE * (times / times.min() - 1.0))
        result[mask] = raw / raw.sum()
    return result


def loss(params: CostParams, grids: Sequence[Grid], device: DeviceProfile) -> float:
    """Weighted mean squared log(predicted / measured) over the grids' (grid, family) groups;
    a group of fewer than ``FULL_GROUP_PLANS`` plans counts in proportion to its plans."""
    total, groups = 0.0, 0.0
    for grid in grids:
        predicted = model_times(grid.table, device, params)["time_ms"]
        error = np.log(predicted / grid.measured_ms)
        if not np.all(np.isfinite(error)):
            return math.inf
        w = weights(grid)
        for family in grid.family_names:
            mask = grid.family_mask(family)
            share = min(1.0, int(mask.sum()) / FULL_GROUP_PLANS)
            total += share * float(np.sum(w[mask] * error[mask] ** 2))
            groups += share
    return total / max(groups, 1e-12)


def fitted_constants(grids: Sequence[Grid]) -> list[str]:
    """The constants the grids identify: all but the efficiencies of pipes no plan uses,
    the overlap of a kind of kernel (pipelined or not) no plan is, and the softmax hiding
    and shared-memory contention where no plan has several streams or wgmma operands."""
    pipes = set().union(*(grid.pipes for grid in grids)) if grids else set()
    unused = {_PIPE_CONSTANTS[pipe] for pipe in PIPES if pipe not in pipes}
    kinds = {bool(value) for grid in grids for value in grid.table["pipelined"]}
    if True not in kinds:
        unused.add("overlap")
    if False not in kinds:
        unused.add("overlap_synchronous")
    if not any((grid.table["softmax_streams"] > 1).any() for grid in grids):
        unused.add("softmax_hiding")
    if not any((grid.table["shared_operands"] > 0).any() for grid in grids):
        unused.add("shared_contention")
    return [name for name in BOUNDS if name not in unused]


def fit(
    grids: Sequence[Grid],
    device: DeviceProfile,
    start: CostParams = START,
    iterations: int = 600,
) -> CostParams:
    """The constants that minimise ``loss`` on ``grids`` (Nelder-Mead in log space, in bounds)."""
    names = fitted_constants(grids)
    low = np.log([BOUNDS[n][0] for n in names])
    high = np.log([BOUNDS[n][1] for n in names])

    def params_at(x: np.ndarray) -> CostParams:
        values = np.exp(np.clip(x, low, high))
        return replace(start, **{n: float(v) for n, v in zip(names, values, strict=True)})

    x0 = np.clip(np.log([getattr(start, n) for n in names]), low, high)

    def objective(x: np.ndarray) -> float:
        prior = PRIOR_WEIGHT * float(np.sum((np.clip(x, low, high) - x0) ** 2))
        return loss(params_at(x), grids, device) + prior

    best = nelder_mead(objective, x0, step=0.3, iterations=iterations)
    # One restart from the optimum: Nelder-Mead's simplex collapses early on ridges.
    best = nelder_mead(objective, best, step=0.15, iterations=iterations // 2)
    return params_at(best)


def nelder_mead(
    objective: Callable[[np.ndarray], float], x0: np.ndarray, step: float, iterations: int
) -> np.ndarray:
    """The textbook downhill simplex (reflection 1, expansion 2, contraction and shrink 1/2)."""
    dimension = len(x0)
    simplex = [x0.astype(float)] + [x0 + step * np.eye(dimension)[i] for i in range(dimension)]
    values = [objective(x) for x in simplex]
    for _ in range(iterations):
        order = np.argsort(values)
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        if abs(values[-1] - values[0]) <= 1e-10 * (abs(values[0]) + 1e-12):
            break
        centroid = np.mean(simplex[:-1], axis=0)
        reflected = centroid + (centroid - simplex[-1])
        value = objective(reflected)
        if value < values[0]:
            expanded = centroid + 2 * (centroid - simplex[-1])
            expanded_value = objective(expanded)
            if expanded_value < value:
                simplex[-1], values[-1] = expanded, expanded_value
            else:
                simplex[-1], values[-1] = reflected, value
        elif value < values[-2]:
            simplex[-1], values[-1] = reflected, value
        else:
            contracted = centroid + 0.5 * (simplex[-1] - centroid)
            contracted_value = objective(contracted)
            if contracted_value < values[-1]:
                simplex[-1], values[-1] = contracted, contracted_value
            else:
                simplex = [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex]
                values = [values[0]] + [objective(x) for x in simplex[1:]]
    return simplex[int(np.argmin(values))]


@dataclass(frozen=True)
class Score:
    """How the model ranks one family's plans of one grid (``family`` "all": every plan)."""

    grid: str
    family: str
    plans: int
    spearman: float
    #: measured time of the model's first pick over the measured best
    pick_over_best: float
    #: the model's first pick and the measured best
    pick: str
    best: str
    #: predicted over measured time of the measured best plan
    predicted_over_measured: float

    def as_dict(self) -> dict[str, object]:
        return {
            "grid": self.grid,
            "family": self.family,
            "plans": self.plans,
            "spearman": None if math.isnan(self.spearman) else round(self.spearman, 4),
            "pick_over_best": round(self.pick_over_best, 4),
            "pick": self.pick,
            "best": self.best,
            "predicted_over_measured": round(self.predicted_over_measured, 4),
        }


def score(grid: Grid, params: CostParams, device: DeviceProfile) -> list[Score]:
    """Per family of the grid, and over all its plans: Spearman and the zero-trial pick."""
    predicted = model_times(grid.table, device, params)["time_ms"]
    groups = [(family, grid.family_mask(family)) for family in grid.family_names]
    if len(groups) > 1:
        groups.append(("all", np.ones(len(grid.keys), dtype=bool)))
    scores = []
    for family, mask in groups:
        indices = np.flatnonzero(mask)
        p, m = predicted[indices], grid.measured_ms[indices]
        pick, best = int(np.argmin(p)), int(np.argmin(m))
        scores.append(
            Score(
                grid=grid.label,
                family=family,
                plans=len(indices),
                spearman=rank_correlation(list(p), list(m)),
                pick_over_best=float(m[pick] / m[best]),
                pick=grid.keys[indices[pick]],
                best=grid.keys[indices[best]],
                predicted_over_measured=float(p[best] / m[best]),
            )
        )
    return scores


def leave_one_out(
    grids: Sequence[Grid], device: DeviceProfile, iterations: int = 600
) -> list[tuple[Grid, CostParams, list[Score]]]:
    """For each grid: the constants fitted on the others, and its score under them."""
    results = []
    for held_out in grids:
        training = [grid for grid in grids if grid is not held_out]
        params = fit(training, device, iterations=iterations)
        results.append((held_out, params, score(held_out, params, device)))
    return results
