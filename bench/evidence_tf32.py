"""float32 evidence on the GPU: tuned plans per precision next to torch's best float32 SDPA.

    python bench/evidence_tf32.py --out $OUT/evidence_tf32.json --work-dir /tmp/ev32 \\
        [--shapes 1x16x1000x128 ...] [--precisions tf32x3 tf32] [--n-trials 12] [--probe 0]

For each shape and precision it runs the user's command,
``python -m tuner ... dtype=float32 precision=...`` (``--n-trials`` trials,
its own registry and study under ``--work-dir``; ``--cache-dir`` may hold
cubins compiled elsewhere), then, in this process, measures the stored plan
with the PyCUDA backend (parity-checked under the problem's precision rule,
CUDA events, L2 flushed before each repetition). With ``--probe K`` it skips
the tuner and measures the cost model's K best predictions instead (a check of
the kernels and the model before tuning).

torch's float32 SDPA is timed with the efficient and math backends on the same
inputs with the same loop, with ``torch.backends.cuda.matmul.allow_tf32`` and
``torch.backends.cudnn.allow_tf32`` off, so its math backend is true float32
(its efficient kernel is 3xTF32 whatever they say). Every output's error is
taken against one float64 reference of sampled rows (2 heads x 66 rows, the
first and last among them): ours, torch efficient's and torch math's. The
tuned plan is measured before and after the peers (a drifting clock shows as
two medians). Ratios > 1: the tuned plan is faster.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from evidence import read_best, run_tuning, tune_command
from speed_check import TorchTimer, timing_record

from kernels.parity import sample_indices
from kernels.reference import reference_rows
from kernels.timing import time_repetitions
from tuner.costmodel import predict_time_ms
from tuner.planner.params import KernelParams
from tuner.planner.space import candidate_space
from tuner.planner.tunable import KernelPlan, plan_kernel
from tuner.problem import Problem

DEFAULT_SHAPES = ("1x16x1000x128", "1x1x32768x128", "1x1x4096x128", "4x16x4096x128")


def parse_shape(text: str, precision: str) -> Problem:
    causal = text.endswith("c")
    b, h, n, d = (int(x) for x in text.rstrip("c").split("x"))
    return Problem(n, d, batch=b, heads=h, causal=causal, precision=precision)


def sampled_reference(problem: Problem, inputs: tuple[np.ndarray, ...]) -> dict[str, Any]:
    heads, rows = sample_indices(problem, np.random.default_rng(11))
    expected = reference_rows(*inputs, problem.causal, heads, rows)
    return {"heads": heads, "rows": rows, "expected": expected}


def error_of(output: np.ndarray, problem: Problem, reference: dict[str, Any]) -> float:
    shape = (problem.batch_heads, problem.seq_len, problem.head_dim)
    picked = output.reshape(shape)[np.ix_(reference["heads"], reference["rows"])]
    return float(np.abs(picked.astype(np.float64) - reference["expected"]).max())


def torch_peers(
    problem: Problem,
    inputs: tuple[np.ndarray, ...],
    reference: dict[str, Any],
    l2_bytes: int,
    repetitions: int,
    warmup: int,
) -> dict[str, Any]:
    import torch
    import torch.nn.functional as functional
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    shape = (problem.batch, problem.heads, problem.seq_len, problem.head_dim)
    q, k, v = (torch.from_numpy(a.reshape(shape)).cuda() for a in inputs)
    flush_buffer = torch.empty(2 * l2_bytes, dtype=torch.uint8, device="cuda")
    results: dict[str, Any] = {
        "version": torch.__version__,
        "allow_tf32": {
            "matmul": torch.backends.cuda.matmul.allow_tf32,
            "cudnn": torch.backends.cudnn.allow_tf32,
        },
    }
    for name, backend in (
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
        ("math", SDPBackend.MATH),
    ):
        try:
            with sdpa_kernel(backend):

                def run() -> Any:
                    return functional.scaled_dot_product_attention(
                        q, k, v, is_causal=problem.causal
                    )

                output = run().float().cpu().numpy()
                stats = time_repetitions(
                    run,
                    TorchTimer(torch),
                    repetitions=repetitions,
                    warmup=warmup,
                    flush=flush_buffer.zero_,
                )
        except RuntimeError as error:  # out of memory (math at long sequences), no kernel
            results[name] = {"error": str(error).splitlines()[0]}
            continue
        results[name] = timing_record(problem, stats) | {
            "max_abs_error": error_of(output, problem, reference)
        }
    return results


def probe_plans(problem: Problem, device: Any, count: int) -> list[KernelPlan]:
    space = candidate_space(problem, device)
    ranked = sorted(space.feasible, key=lambda plan: predict_time_ms(plan, device))
    return ranked[:count]


def measure_plan(gpu: Any, plan: KernelPlan, problem: Problem, reference: dict[str, Any]):
    m = gpu.measure(plan, problem)
    record = {
        "plan": plan.key(),
        "predicted_ms": predict_time_ms(plan, gpu.device_profile()),
        "ok": m.ok,
        "failure": m.failure and str(m.failure),
        "detail": m.detail,
        "median_ms": m.median_ms,
        "spread_ms": m.spread_ms,
        "tflops": m.tflops,
        "max_abs_error_parity": m.max_abs_error,
    }
    if m.ok:
        record["max_abs_error"] = error_of(gpu.output(plan, problem), problem, reference)
    return record


def evidence_of(
    problem: Problem, plans: list[KernelPlan], cache_dir: Path, args: Any
) -> dict[str, Any]:
    from kernels.backends.pycuda_backend import PyCudaBackend

    gpu = PyCudaBackend(0, cache_dir=cache_dir, repetitions=args.repetitions, warmup=args.warmup)
    try:
        device = gpu.device_profile()
        inputs = gpu.inputs(problem)
        reference = sampled_reference(problem, inputs)
        result: dict[str, Any] = {
            "ours": [measure_plan(gpu, plan, problem, reference) for plan in plans]
        }
        result["torch"] = torch_peers(
            problem, inputs, reference, device.l2_bytes, args.repetitions, args.warmup
        )
        result["ours_again"] = measure_plan(gpu, plans[0], problem, reference)
    finally:
        gpu.close()
    return result


def ratios(entry: dict[str, Any]) -> dict[str, float]:
    timed = [entry["ours"][0].get("median_ms"), entry.get("ours_again", {}).get("median_ms")]
    timed = [t for t in timed if t]
    if not timed:
        return {}
    ours = min(timed)
    return {
        f"{name}_over_ours": peer["median_ms"] / ours
        for name, peer in entry.get("torch", {}).items()
        if isinstance(peer, dict) and peer.get("median_ms")
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--work-dir", required=True, type=Path)
    parser.add_argument("--cache-dir", type=Path, help="cubin cache (default: under --work-dir)")
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES))
    parser.add_argument("--precisions", nargs="+", default=["tf32x3", "tf32"])
    parser.add_argument("--n-trials", type=int, default=12)
    parser.add_argument("--probe", type=int, default=0, help="measure the K best predictions")
    parser.add_argument("--repetitions", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--tune-timeout-s", type=float, default=120.0)
    parser.add_argument("--tuner-args", nargs="*", default=[], help="extra key=value overrides")
    args = parser.parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    cache_dir = args.cache_dir or args.work_dir / "cubins"
    report: dict[str, Any] = {
        "command": "python " + shlex.join(["bench/evidence_tf32.py", *(argv or sys.argv[1:])]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "shapes": {},
    }
    for text in args.shapes:
        for precision in args.precisions:
            problem = parse_shape(text, precision)
            name = f"{text}:{precision}"
            entry: dict[str, Any] = {"problem": problem.label()}
            if args.probe:
                from tuner.device import H200

                plans = probe_plans(problem, H200, args.probe)
            else:
                work = args.work_dir / name.replace(":", "-")
                work.mkdir(parents=True, exist_ok=True)
                overrides = [f"precision={precision}", f"search.n_trials={args.n_trials}"]
                command = tune_command(
                    problem, work, cache_dir, overrides=[*overrides, *args.tuner_args]
                )
                entry["tuning"] = run_tuning(command, work / "tune.log", args.tune_timeout_s)
                best = read_best(f"sqlite:///{work / 'plans.sqlite'}", problem)
                entry["stored"] = best
                if best is None:
                    report["shapes"][name] = entry
                    continue
                params = KernelParams.from_stored(best["family"], best["params"])
                from tuner.device import H200

                plans = [plan_kernel(problem, params, H200)]
            entry |= evidence_of(problem, plans, cache_dir, args)
            entry["ratios"] = ratios(entry)
            report["shapes"][name] = entry
            args.out.write_text(json.dumps(report, indent=1, default=str))
            torch_errors = {
                k: v.get("max_abs_error")
                for k, v in entry["torch"].items()
                if isinstance(v, dict) and "max_abs_error" in v
            }
            for index, ours in enumerate(entry["ours"]):
                extra = (
                    " | " + " ".join(f"{k} {v:.2f}x" for k, v in entry["ratios"].items())
                    if index == 0
                    else ""
                )
                tflops = ours.get("tflops")
                print(
                    f"{name:24s} {ours['plan']:34s} {ours.get('median_ms')} ms "
                    f"(pred {ours['predicted_ms']:.3f}, {tflops and round(tflops, 1)} TF, "
                    f"err {ours.get('max_abs_error')}; torch err {torch_errors}) "
                    f"{'' if ours['ok'] else ours['failure'] + ' ' + str(ours['detail'])}{extra}",
                    flush=True,
                )
    args.out.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
