"""The cost model against the key-tile sweep (``hopper_bench_c320340_sweep.json``): per shape,
the Spearman rank correlation of predicted and measured times over the timed ``wgmma_f16``
plans, and where the model's own pick (what ``kernels.attention`` serves untuned) lands.

    PYTHONPATH=. python bench/results/hopper_2026-12-04/cost_model_on_sweep.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))

import hopper_bench  # noqa: E402

from tuner.costmodel import predict_time_ms, rank_correlation  # noqa: E402
from tuner.device import H200  # noqa: E402
from tuner.planner.space import candidate_space  # noqa: E402

SWEEP = Path(__file__).with_name("hopper_bench_c320340_sweep.json")


def main() -> None:
    shapes = json.loads(SWEEP.read_text())["shapes"]
    for name, result in shapes.items():
        problem = hopper_bench.SHAPES[name]
        plans = {p.key(): p for p in candidate_space(problem, H200).feasible}
        plans |= {p.key(): p for p in hopper_bench.sweep_plans(problem, H200)}
        rows = [
            row
            for row in result["candidates"]
            if "median_ms" in row and row["plan"].startswith("wgmma") and row["plan"] in plans
        ]
        predicted = [predict_time_ms(plans[row["plan"]], H200) for row in rows]
        measured = [row["median_ms"] for row in rows]
        pick = min(range(len(rows)), key=lambda i: predicted[i])
        print(
            f"{name}: {len(rows)} plans, Spearman {rank_correlation(predicted, measured):.2f}, "
            f"model's pick {rows[pick]['plan'].removeprefix('wgmma_f16/')} at "
            f"{min(measured) / measured[pick]:.3f} of the best"
        )


if __name__ == "__main__":
    main()
