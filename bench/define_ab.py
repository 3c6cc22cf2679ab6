"""Kernel source switches, A/B: plans timed as built and with extra ``-D`` defines, in one process.

    python bench/define_ab.py --out ab.json --cache-dir DIR \
        --variant tree4=FA_SOFTMAX_TREE=4 \
        --variant slack8=FA_SOFTMAX_TREE=4,FA_RESCALE_SLACK=8 \
        --case 4x16x4096x128:wgmma_f16/c2/n128/st3/b1/o1/p1/ss/ps/s1 ...
    python bench/define_ab.py --precompile DIR ...   (compile only, no GPU: carry DIR over)

A variant is a case's kernel compiled with its defines added: a switch the source reads with
``#ifndef``, on trial before it becomes the source's default or a tunable. "base" is the plan
as the planner builds it. Each round times every case's variants back to back (the GPU's
drift falls on all alike) and cuDNN on the case's shape; a case reports each variant's best
median over the rounds, its ratio to base, and the largest difference of its output from
base's (a switch must not change the result beyond rounding). Shapes are
``bench/hopper_bench.py``'s SHAPES; a case's plan is named by its key.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hopper_bench import SHAPES, Bench, feasible_plans  # noqa: E402

from tuner.device import H200  # noqa: E402
from tuner.planner.plan import KernelPlan  # noqa: E402

BASE = "base"


def parse_variant(text: str) -> tuple[str, dict[str, int]]:
    """``name=DEFINE=value,DEFINE=value`` -> (name, defines)."""
    name, _, rest = text.partition("=")
    defines = {}
    for item in filter(None, rest.split(",")):
        define, _, value = item.partition("=")
        if not define or not value.lstrip("-").isdigit():
            raise SystemExit(f"--variant {text!r}: DEFINE=integer pairs, comma-separated")
        defines[define] = int(value)
    if not name or name == BASE or not defines:
        raise SystemExit(f"--variant {text!r}: a name (not {BASE!r}) and at least one define")
    return name, defines


def case_plan(case: str) -> KernelPlan:
    shape, _, key = case.partition(":")
    if shape not in SHAPES:
        raise SystemExit(f"--case {case!r}: {shape!r} is none of {', '.join(SHAPES)}")
    for plan in feasible_plans(SHAPES[shape], H200):
        if plan.key() == key:
            return plan
    raise SystemExit(f"--case {case!r}: no feasible plan of {shape} has the key {key!r}")


class Switched:
    """Every family's ``compile_defines`` with ``extra`` added (a variant's build)."""

    def __init__(self) -> None:
        from tuner.planner.families import registered

        self.extra: dict[str, int] = {}
        for family in registered():
            plain = family.compile_defines
            family.compile_defines = (  # type: ignore[method-assign]
                lambda plan, plain=plain: plain(plan) | self.extra
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", required=True, metavar="SHAPE:KEY")
    parser.add_argument("--variant", action="append", required=True, metavar="NAME=D=V,...")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repetitions", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--cache-dir", type=Path, default=None, help="the cubin cache")
    parser.add_argument("--precompile", type=Path, metavar="DIR", help="compile only (no GPU)")
    parser.add_argument("--out", type=Path, help="the JSON results file")
    args = parser.parse_args(argv)
    variants = {BASE: {}} | dict(parse_variant(v) for v in args.variant)
    cases = [(case, case_plan(case)) for case in args.case]
    switched = Switched()

    if args.precompile is not None:
        from kernels import build

        for name, defines in variants.items():
            switched.extra = defines
            results = build.compile_many([plan for _, plan in cases], args.precompile,
                                         arch=H200.arch)
            failed = [k for k, r in results.items() if isinstance(r, build.CompileFailure)]
            print(f"{name}: {len(results)} compiled, {len(failed)} failed {failed}", flush=True)
        return 0

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    bench = Bench(torch, args)
    runs: dict[tuple[str, str], Any] = {}
    rows: dict[str, dict[str, Any]] = {case: {"plan": plan.key()} for case, plan in cases}
    inputs = {}
    for case, plan in cases:
        inputs[case] = q, k, v = bench.inputs(plan.problem)
        for name, defines in variants.items():
            switched.extra = defines
            try:
                runs[case, name] = bench.ours(plan, q, k, v)
            except Exception as error:  # a variant the compiler's report rules out: a result
                rows[case][name] = {"error": f"{type(error).__name__}: {error}"}
                print(f"{case} {name}: {rows[case][name]['error']}", flush=True)
    best: dict[tuple[str, str], float] = {}
    for round_ in range(args.rounds):
        for case, plan in cases:
            for name in variants:
                if (case, name) not in runs:
                    continue
                median = bench.time(runs[case, name][0])["median_ms"]
                best[case, name] = min(best.get((case, name), median), median)
            def cudnn(tensors: Any = inputs[case], problem: Any = plan.problem) -> Any:
                return torch.nn.functional.scaled_dot_product_attention(
                    *tensors, is_causal=problem.causal, enable_gqa=problem.group > 1)

            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                median = bench.time(cudnn)["median_ms"]
            best[case, "cudnn"] = min(best.get((case, "cudnn"), median), median)
        print(f"round {round_ + 1} of {args.rounds} done", flush=True)
    for case, _ in cases:
        row = rows[case]
        if (case, BASE) not in runs:
            continue
        base_out = runs[case, BASE][1]
        for name in variants:
            if (case, name) not in runs:
                continue
            run, out = runs[case, name]
            run()
            torch.cuda.synchronize()
            row[name] = {
                "median_ms": best[case, name],
                "over_base": best[case, BASE] / best[case, name],
                "cudnn_over": best[case, "cudnn"] / best[case, name],
                "max_abs_difference_to_base": (out.float() - base_out.float()).abs().max().item(),
            }
        row["cudnn_ms"] = best[case, "cudnn"]
        timed = [n for n in variants if (case, n) in runs]
        print(case, {n: round(row[n]["over_base"], 3) for n in timed},
              {n: round(row[n]["cudnn_over"], 3) for n in timed}, flush=True)
    result = {"variants": variants, "rounds": args.rounds, "cases": rows,
              "command": " ".join(sys.argv)}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
