"""Every backward plan of a sweep of problems (mma_f16_bwd and wgmma_f16_bwd on the H200
profile) as JSON: feasibility and reason, traffic, non-matmul flops, the predicted time, each
launch with every argument, and the scratch. Snapshots of two revisions compare with cmp:
how a planner refactor was shown to change no plan (see ../gpu_suite/LATEST.md).

    PYTHONPATH=$PWD python bench/results/backward_2026-12-04/backward_plan_snapshot.py OUT.json
"""

from __future__ import annotations

import itertools
import json
import sys

from tuner.costmodel import predict_time_ms
from tuner.device import H200
from tuner.planner.launches import BackwardBuffers
from tuner.planner.space import candidate_space
from tuner.problem import Problem

MARKERS = BackwardBuffers(*(1000 + 16 * i for i in range(17)))
FAMILIES = ("mma_f16_bwd", "wgmma_f16_bwd")


def problems() -> list[Problem]:
    found = []
    for n, d, causal, kv_heads, kv_len, dtype in itertools.product(
        (77, 1000, 4096), (64, 128), (False, True), (8, 2), (None, 1500), ("bfloat16", "float16")
    ):
        m = kv_len or n
        found.append(
            Problem(n, d, batch=2, heads=8, kv_heads=kv_heads, kv_len=max(m, n) if causal else m,
                    causal=causal, dtype=dtype, direction="backward")
        )  # fmt: skip
    found.append(Problem(300, 64, heads=2, causal=True, window_left=70, kv_len=350,
                         dtype="bfloat16", direction="backward"))  # fmt: skip
    found.append(Problem(190, 128, heads=4, kv_heads=1, causal=True, softcap=20.0, alibi=True,
                         sinks=True, dtype="bfloat16", direction="backward"))  # fmt: skip
    return found


def snapshot() -> dict[str, dict]:
    plans = {}
    for problem in problems():
        for plan in candidate_space(problem, H200).feasible:
            if plan.family not in FAMILIES:
                continue
            family = plan.kernel_family
            plans[f"{problem.label()} {plan.key()}"] = {
                "reason": plan.reason,
                "read": plan.global_read_bytes,
                "write": plan.global_write_bytes,
                "non_matmul": plan.non_matmul_flops,
                "launch": repr(plan.launch),
                "predicted_ms": repr(predict_time_ms(plan, H200)),
                "launches": [
                    repr(
                        (
                            launch.function,
                            launch.grid,
                            launch.block,
                            launch.shared_bytes,
                            [repr(a) for a in launch.args],
                        )
                    )
                    for launch in family.launches(plan, MARKERS)
                ],  # fmt: skip
                "scratch": repr(family.backward_scratch(plan)),
            }
    return plans


if __name__ == "__main__":
    plans = snapshot()
    with open(sys.argv[1], "w") as out:
        json.dump(plans, out, indent=0, sort_keys=True)
    print(f"{len(plans)} plans")
