"""Speed check on the GPU: tuned tiled plans against the scalar kernel and torch SDPA.

    python bench/speed_check.py --out $OUT/speed_check.json [--top 24] [--repetitions 30]

For 1x1x4096x128 and 4x16x4096x128 (float32, non-causal) it compiles the
planner's feasible space (``--cache-dir``: carry a cache compiled elsewhere to
skip nvcc), drops what ptxas rules out, ranks the rest by the cost model and
measures the ``--top`` best predictions and every scalar plan with the PyCUDA
backend (parity-checked, median of CUDA-event timings with an L2 flush before
each). It then times torch's ``scaled_dot_product_attention`` with the math
and the memory-efficient backends in the same process, on the same inputs,
with the same loop (``kernels.timing.time_repetitions``, CUDA events, the same
2x L2 flush), checks the fastest tiled plan's output against torch's, and
writes the environment, the date, this command, every timing and the ratios
(> 1: the tuned kernel is faster) as JSON to ``--out``. A summary goes to stdout.

PyCUDA works in the device's primary context, the one torch uses, so both
share this process.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from kernels import build
from kernels.backends.base import Measurement
from kernels.backends.pycuda_backend import DEFAULT_CACHE_DIR, PyCudaBackend
from kernels.timing import TimingStats, throughput, time_repetitions
from tuner.costmodel import predict_time_ms
from tuner.device import DeviceProfile
from tuner.planner.space import candidate_space
from tuner.planner.tunable import KernelPlan
from tuner.problem import Problem

SHAPES = (Problem(4096, 128, batch=1, heads=1), Problem(4096, 128, batch=4, heads=16))
FASTEST_KEPT = 3


def ranked_candidates(
    problem: Problem, device: DeviceProfile, cache_dir: str, top: int
) -> tuple[list[KernelPlan], list[KernelPlan], dict[str, int]]:
    """(scalar plans, the ``top`` tiled plans by predicted time, counts of what was dropped)."""
    space = candidate_space(problem, device)
    compiled = build.compile_many(space.feasible, cache_dir, arch=device.arch)
    accepted: list[KernelPlan] = []
    dropped = {"planner": len(space.rejected), "nvcc": 0, "ptxas": 0}
    for plan in space.feasible:
        result = compiled[build.KernelSpec.from_plan(plan).key]
        if isinstance(result, build.CompileFailure):
            dropped["nvcc"] += 1
            continue
        judged = plan.with_resources(result.primary_resources, device)
        if judged.feasible:
            accepted.append(judged)
        else:
            dropped["ptxas"] += 1
    scalar = [p for p in accepted if p.family == "scalar_online"]
    tiled = sorted(
        (p for p in accepted if p.family == "tiled"), key=lambda p: predict_time_ms(p, device)
    )
    return scalar, tiled[:top], dropped


def record(plan: KernelPlan, result: Measurement, device: DeviceProfile) -> dict[str, Any]:
    return {
        "plan": plan.key(),
        "params": plan.params.as_dict(),
        "sequence_splits": plan.sequence_splits,
        "predicted_ms": predict_time_ms(plan, device),
        "ok": result.ok,
        "failure": str(result.failure) if result.failure else None,
        "detail": result.detail,
        "median_ms": result.median_ms,
        "spread_ms": result.spread_ms,
        "tflops": result.tflops,
        "gbps": result.gbps,
        "max_abs_error": result.max_abs_error,
        "samples_ms": list(result.samples_ms),
    }


class TorchTimer:
    """CUDA events on torch's current stream, the stream its SDPA launches go to."""

    def __init__(self, torch: Any) -> None:
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        self._start.record()

    def stop(self) -> float:
        self._end.record()
        self._end.synchronize()
        return float(self._start.elapsed_time(self._end))


def time_torch_call(
    torch: Any, run: Any, flush: Any, repetitions: int, warmup: int = 5
) -> dict[str, Any]:
    """``run`` timed on torch's stream by the project's loop (``flush`` before each
    repetition): its median and spread in ms, as the benches record a peer or a plan."""
    stats = time_repetitions(run, TorchTimer(torch), repetitions=repetitions, warmup=warmup,
                             flush=flush)
    return {"median_ms": stats.median_ms, "spread_ms": stats.spread_ms}


def time_torch(
    problem: Problem,
    inputs: tuple[np.ndarray, ...],
    l2_bytes: int,
    repetitions: int,
    warmup: int,
) -> tuple[dict[str, Any], np.ndarray | None]:
    """Timings of torch SDPA (math, efficient) and the efficient backend's output."""
    try:
        import torch
        import torch.nn.functional as functional
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as error:
        return {"error": f"torch unavailable: {error}"}, None
    shape = (problem.batch, problem.heads, problem.seq_len, problem.head_dim)
    q, k, v = (torch.from_numpy(a.reshape(shape)).cuda() for a in inputs)
    flush_buffer = torch.empty(2 * l2_bytes, dtype=torch.uint8, device="cuda")
    flushes = iter(range(1 << 62))

    def flush() -> None:
        flush_buffer.fill_(next(flushes) & 0xFF)

    results: dict[str, Any] = {"version": torch.__version__}
    output = None
    for name, backend in (("math", SDPBackend.MATH), ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel(backend):

                def run() -> None:
                    functional.scaled_dot_product_attention(q, k, v, is_causal=problem.causal)

                stats = time_repetitions(
                    run, TorchTimer(torch), repetitions=repetitions, warmup=warmup, flush=flush
                )
                if name == "efficient":
                    result = functional.scaled_dot_product_attention(
                        q, k, v, is_causal=problem.causal
                    )
                    output = result.reshape(inputs[0].shape).cpu().numpy()
        except RuntimeError as error:
            results[name] = {"error": str(error).splitlines()[0]}
            continue
        results[name] = timing_record(problem, stats)
    torch.cuda.synchronize()
    return results, output


def timing_record(problem: Problem, stats: TimingStats) -> dict[str, Any]:
    tflops, _ = throughput(problem, None, stats.median_ms)
    return {
        "median_ms": stats.median_ms,
        "spread_ms": stats.spread_ms,
        "tflops": tflops,
        "samples_ms": list(stats.samples_ms),
    }


def check_shape(
    gpu: PyCudaBackend, problem: Problem, arguments: argparse.Namespace
) -> dict[str, Any]:
    device = gpu.device_profile()
    began = time.monotonic()
    scalar_plans, tiled_plans, dropped = ranked_candidates(
        problem, device, arguments.cache_dir, arguments.top
    )
    scalar = [record(p, gpu.measure(p, problem), device) for p in scalar_plans]
    tiled = [record(p, gpu.measure(p, problem), device) for p in tiled_plans]
    fastest = sorted((r for r in tiled if r["ok"]), key=lambda r: r["median_ms"])[:FASTEST_KEPT]
    torch_results, torch_output = time_torch(
        problem, gpu.inputs(problem), device.l2_bytes, arguments.repetitions, arguments.warmup
    )
    summary: dict[str, Any] = {
        "shape": problem.label(),
        "candidates": {"measured_tiled": len(tiled_plans), "dropped": dropped},
        "scalar": scalar,
        "tiled_fastest": fastest,
        "tiled_all": [
            {k: r[k] for k in ("plan", "ok", "failure", "median_ms", "predicted_ms")} for r in tiled
        ],
        "torch": torch_results,
        "seconds": time.monotonic() - began,
    }
    if fastest:
        best_ms = fastest[0]["median_ms"]
        best_plan = next(p for p in tiled_plans if p.key() == fastest[0]["plan"])
        ratios = {}
        for name in ("math", "efficient"):
            peer = torch_results.get(name, {})
            if "median_ms" in peer:
                ratios[f"torch_{name}_over_tuned"] = peer["median_ms"] / best_ms
        best_scalar = min((r["median_ms"] for r in scalar if r["ok"]), default=None)
        if best_scalar is not None:
            ratios["scalar_over_tuned"] = best_scalar / best_ms
        summary["ratios"] = ratios
        if torch_output is not None:
            tuned = gpu.output(best_plan, problem)
            summary["tuned_vs_torch_efficient_max_abs"] = float(
                np.abs(tuned.astype(np.float64) - torch_output).max()
            )
    return summary


def print_summary(shape: dict[str, Any]) -> None:
    print(shape["shape"], f"({shape['seconds']:.0f} s)")
    for name in ("math", "efficient"):
        peer = shape["torch"].get(name, {})
        if "median_ms" in peer:
            print(f"  torch {name:9s} {peer['median_ms']:9.4f} ms  {peer['tflops']:6.1f} TFLOP/s")
        else:
            print(f"  torch {name:9s} {peer.get('error', shape['torch'].get('error'))}")
    for row in shape["scalar"]:
        if row["ok"]:
            print(f"  {row['plan']:28s} {row['median_ms']:9.4f} ms  {row['tflops']:6.1f} TFLOP/s")
    for row in shape["tiled_fastest"]:
        print(
            f"  {row['plan']:28s} {row['median_ms']:9.4f} ms  {row['tflops']:6.1f} TFLOP/s"
            f"  IQR {row['spread_ms']:.4f}  err {row['max_abs_error']:.1e}"
        )
    for name, ratio in shape.get("ratios", {}).items():
        print(f"  {name} = {ratio:.2f}")
    failed = [r for r in shape["tiled_all"] if not r["ok"]]
    if failed:
        first = failed[0]
        print(f"  {len(failed)} tiled candidates failed, e.g. {first['plan']}: {first['failure']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="JSON file to write")
    parser.add_argument("--top", type=int, default=24, help="tiled candidates to measure")
    parser.add_argument("--repetitions", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR)
    parser.add_argument("--device", type=int, default=0)
    arguments = parser.parse_args(argv)

    gpu = PyCudaBackend(
        arguments.device,
        cache_dir=arguments.cache_dir,
        repetitions=arguments.repetitions,
        warmup=arguments.warmup,
    )
    try:
        report: dict[str, Any] = {
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": shlex.join([sys.executable, *sys.argv]),
            "environment": gpu.environment(),
            "timing": {
                "repetitions": arguments.repetitions,
                "warmup": arguments.warmup,
                "l2_flush_bytes": 2 * gpu.device_profile().l2_bytes,
                "method": "CUDA events around the launches; L2 flushed before each repetition",
            },
            "shapes": [],
        }
        for problem in SHAPES:
            shape = check_shape(gpu, problem, arguments)
            report["shapes"].append(shape)
            print_summary(shape)
            arguments.out.parent.mkdir(parents=True, exist_ok=True)
            arguments.out.write_text(json.dumps(report, indent=1))  # partial results survive
    finally:
        gpu.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
