"""The cost model's picks on the same-process H200 sweeps, with and without its softmax-hiding
and shared-memory-contention terms, and the grid search that chose their constants.

    PYTHONPATH=. python bench/results/hopper_2026-12-04/cost_model_terms.py

Per shape of the sweeps (wgmma_f16 plans only, each shape's timings from its own process;
a shape in two sweeps keeps the later timing of a plan): the share of the shape's best time
that the model's top pick reaches, and Spearman's rank correlation of predicted and measured
times. "before": softmax_hiding 0 and shared_contention 64 (the model of a515981: softmax
and matmuls add up, shared memory only bounds); "after": the shipped constants. In sample:
the constants were chosen on these sweeps.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))
sys.path.insert(0, str(HERE.parent.parent.parent))

import hopper_bench  # noqa: E402

from tuner.costmodel import calibrated, feature_table, model_times, rank_correlation  # noqa: E402
from tuner.device import H200  # noqa: E402
from tuner.planner.space import candidate_space  # noqa: E402

SWEEPS = ("hopper_bench_c320340_sweep.json", "hopper_bench_8f290fb_sweep.json",
          "hopper_bench_a0fac71_sweep.json")


def timed_plans() -> dict[str, list]:
    timings: dict[str, dict[str, float]] = {}
    for name in SWEEPS:
        for shape, result in json.loads((HERE / name).read_text())["shapes"].items():
            timings.setdefault(shape, {}).update(
                {c["plan"]: c["median_ms"] for c in result["candidates"] if c.get("median_ms")}
            )
    found = {}
    for shape, times in timings.items():
        problem = hopper_bench.SHAPES[shape]
        plans = {p.key(): p for p in candidate_space(problem, H200).feasible}
        for plan in hopper_bench.sweep_plans(problem, H200):
            plans.setdefault(plan.key(), plan)
        found[shape] = [
            (plans[k], t) for k, t in times.items() if k.startswith("wgmma") and k in plans
        ]
    return found


def scores(found: dict[str, list], params) -> list[tuple[str, float, float, int]]:
    rows = []
    for shape, pairs in found.items():
        plans, times = [p for p, _ in pairs], np.array([t for _, t in pairs])
        predicted = model_times(feature_table(plans, H200), H200, params)["time_ms"]
        pick = times[int(np.argmin(predicted))]
        rows.append((shape, times.min() / pick, rank_correlation(list(predicted), list(times)),
                     len(plans)))
    return rows


def summary(rows) -> str:
    picks = [r[1] for r in rows]
    return (f"pick: min {min(picks):.3f} mean {np.mean(picks):.3f}; "
            f"Spearman mean {np.mean([r[2] for r in rows]):.2f}")


def main() -> None:
    found = timed_plans()
    shipped = calibrated()
    before = dataclasses.replace(shipped, softmax_hiding=0.0, shared_contention=64.0)
    print(f"{sum(len(v) for v in found.values())} timed wgmma_f16 plans over {len(found)} shapes")
    for label, params in (("before", before), ("after", shipped)):
        rows = scores(found, params)
        print(f"\n{label}: {summary(rows)}")
        for shape, pick, rho, count in rows:
            print(f"  {shape:24s} {count:4d} plans  pick {pick:.3f} of the best  "
                  f"Spearman {rho:+.2f}")
    print("\ngrid search (softmax_hiding, shared_contention):")
    for hiding in (0.1, 0.2, 0.3, 0.4):
        for contention in (1.5, 2.0, 2.5):
            params = dataclasses.replace(shipped, softmax_hiding=hiding,
                                         shared_contention=contention)
            print(f"  {hiding:.1f} {contention:.1f}  {summary(scores(found, params))}")


if __name__ == "__main__":
    main()
