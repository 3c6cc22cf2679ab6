"""How well the cost model ranks mma_f16 plans: Spearman and the zero-trial pick, per shape.

    python bench/costmodel_mma_f16.py bench/results/mma_probe_2026-12-03/ab_interleaved_softmax.json

Reads ``bench/mma_probe.py`` JSON (variants named by their compile constants and
split count, with measured medians), plans each variant with the family's
planning module, predicts it with ``tuner.costmodel`` and prints, per shape,
Spearman's rank correlation between prediction and measurement and how much
slower the model's first pick is than the measured best. CPU only.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from tuner import costmodel
from tuner.device import H200
from tuner.planner.params import KernelParams
from tuner.planner.tunable import plan_kernel
from tuner.problem import Problem

NAME = re.compile(r"mma_f16_D(\d+)_M(\d+)_N(\d+)_W(\d+)_S(\d+)_C(\d)_H(\d)_Q(\d)_x(\d+)")


def rows_of(path: str) -> list[tuple[str, list[tuple[float, object]]]]:
    shapes = []
    for shape, entry in json.loads(Path(path).read_text())["shapes"].items():
        body, _, dtype = shape.partition(":")
        b, h, n, d = (int(x) for x in body.rstrip("c").split("x"))
        problem = Problem(
            n, d, batch=b, heads=h, causal=body.endswith("c"),
            dtype="float16" if dtype == "fp16" else "bfloat16",
        )
        rows = []
        for variant in entry["variants"]:
            if "ms" not in variant:
                continue
            _, m, nn, w, s, _, _, q, x = map(int, NAME.fullmatch(variant["variant"]).groups())
            tiles = -(-n // nn)
            target = -(-tiles // x)  # tiles per split that give x splits
            params = KernelParams(
                "mma_f16", block_m=m, block_n=nn, warps=w, stages=s, q_in_registers=q,
                split_target=target,
            )
            plan = plan_kernel(problem, params, H200)
            if plan.sequence_splits == x:
                rows.append((variant["ms"], plan))
        shapes.append((shape, rows))
    return shapes


def main(paths: list[str]) -> int:
    for path in paths:
        for shape, rows in rows_of(path):
            predicted = [costmodel.predict_time_ms(plan, H200) for _, plan in rows]
            measured = [ms for ms, _ in rows]
            pick = min(range(len(rows)), key=lambda i: predicted[i])
            print(
                f"{shape:20s} plans {len(rows):3d}  spearman "
                f"{costmodel.rank_correlation(predicted, measured):+.2f}  "
                f"model's pick / measured best {measured[pick] / min(measured):.3f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
