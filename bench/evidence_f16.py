"""Half-precision evidence on the GPU: tune each shape, then time the stored plan next to torch.

    python bench/evidence_f16.py --out $OUT/evidence_f16.json --work-dir /tmp/ev16 [--shapes ...]

For each shape (``BxHxNxD[c]:bf16|fp16``) it runs the user's command,
``python -m tuner ... dtype=...`` with default search settings, writing only
under ``--work-dir`` (its own registry, study and a cubin cache that starts
empty, so the tuning wall time includes every compile), and records the wall
time. Then, in this process, it reads the registry's best plan, measures it
with the PyCUDA backend (parity-checked against float64, CUDA events, L2
flushed before each repetition) and times torch SDPA's flash, cuDNN and
efficient backends and FlexAttention compiled with
``mode="max-autotune-no-cudagraphs"`` (its first call, compile and Triton
autotuning included, is timed separately) on the same inputs with the same
loop. The tuned plan is measured before and after the peers: a drifting clock
shows as two medians. Ratios > 1 mean the tuned plan is faster.
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
from evidence import read_best, run_tuning, tune_command
from speed_check import TorchTimer, timing_record

from kernels.timing import time_repetitions
from tuner.errors import RegistryError
from tuner.problem import Problem

DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
DEFAULT_SHAPES = (
    "1x1x4096x128:bf16",
    "4x16x4096x128:bf16",
    "4x16x4096x128c:bf16",
    "1x16x1000x128:bf16",
    "8x32x1024x64:bf16",
    "1x32x8192x128:bf16",
    "4x16x4096x128:fp16",
    "1x16x1000x128:fp16",
)


def parse_shape(text: str) -> Problem:
    body, _, dtype = text.partition(":")
    causal = body.endswith("c")
    b, h, n, d = (int(x) for x in body.rstrip("c").split("x"))
    return Problem(n, d, batch=b, heads=h, causal=causal, dtype=DTYPES[dtype or "bf16"])


def time_peers(
    problem: Problem, inputs: tuple[np.ndarray, ...], l2_bytes: int, repetitions: int, warmup: int
) -> dict[str, Any]:
    import torch
    import torch.nn.functional as functional
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[problem.dtype]
    shape = (problem.batch, problem.heads, problem.seq_len, problem.head_dim)
    q, k, v = (torch.from_numpy(a.reshape(shape)).cuda().to(dtype) for a in inputs)
    flush_buffer = torch.empty(2 * l2_bytes, dtype=torch.uint8, device="cuda")

    def flush() -> None:
        flush_buffer.zero_()

    results: dict[str, Any] = {"version": torch.__version__}
    for name, backend in (
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
    ):
        try:
            with sdpa_kernel(backend):

                def run() -> None:
                    functional.scaled_dot_product_attention(q, k, v, is_causal=problem.causal)

                stats = time_repetitions(
                    run, TorchTimer(torch), repetitions=repetitions, warmup=warmup, flush=flush
                )
        except RuntimeError as error:
            results[name] = {"error": str(error).splitlines()[0]}
            continue
        results[name] = timing_record(problem, stats)
    try:
        block_mask = None
        if problem.causal:
            block_mask = create_block_mask(
                lambda b, h, q_idx, kv_idx: q_idx >= kv_idx,
                None, None, problem.seq_len, problem.seq_len,
            )
        compiled = torch.compile(flex_attention, mode="max-autotune-no-cudagraphs")
        began = time.monotonic()
        compiled(q, k, v, block_mask=block_mask)
        torch.cuda.synchronize()
        first_call_s = time.monotonic() - began
        stats = time_repetitions(
            lambda: compiled(q, k, v, block_mask=block_mask),
            TorchTimer(torch), repetitions=repetitions, warmup=warmup, flush=flush,
        )
        results["flex"] = timing_record(problem, stats) | {"compile_autotune_s": first_call_s}
    except Exception as error:  # Flex is a peer: its failure is recorded, not fatal
        results["flex"] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
    torch.cuda.empty_cache()
    return results


def measure(problem: Problem, best: dict[str, Any], cache_dir: Path, args: Any) -> dict[str, Any]:
    from kernels.backends.pycuda_backend import PyCudaBackend
    from tuner.planner.params import KernelParams
    from tuner.planner.tunable import plan_kernel

    gpu = PyCudaBackend(
        0, cache_dir=cache_dir, repetitions=args.repetitions, warmup=args.warmup
    )
    result: dict[str, Any] = {}
    try:
        device = gpu.device_profile()
        params = KernelParams.from_stored(best["family"], best["params"])
        plan = plan_kernel(problem, params, device)
        result["plan"] = plan.key()

        def ours() -> dict[str, Any]:
            m = gpu.measure(plan, problem)
            return {"ok": m.ok, "failure": m.failure and str(m.failure), "detail": m.detail,
                    "median_ms": m.median_ms, "spread_ms": m.spread_ms, "tflops": m.tflops,
                    "max_abs_error": m.max_abs_error}

        result["tuned"] = ours()
        result["peers"] = time_peers(
            problem, gpu.inputs(problem), device.l2_bytes, args.repetitions, args.warmup
        )
        result["tuned_again"] = ours()
    finally:
        gpu.close()
    return result


def ratios(result: dict[str, Any]) -> dict[str, float]:
    tuned = [result.get(k, {}).get("median_ms") for k in ("tuned", "tuned_again")]
    tuned = [t for t in tuned if t]
    if not tuned:
        return {}
    ours = min(tuned)
    return {
        f"{name}_over_tuned": peer["median_ms"] / ours
        for name, peer in result.get("peers", {}).items()
        if isinstance(peer, dict) and peer.get("median_ms")
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--work-dir", required=True, type=Path)
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES))
    parser.add_argument("--repetitions", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--tune-timeout-s", type=float, default=240.0)
    parser.add_argument("--tuner-args", nargs="*", default=[], help="extra key=value overrides")
    args = parser.parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    cache_dir = args.work_dir / "cubins"
    report: dict[str, Any] = {
        "command": "python " + shlex.join(["bench/evidence_f16.py", *(argv or sys.argv[1:])]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "shapes": {},
    }
    for text in args.shapes:
        problem = parse_shape(text)
        work = args.work_dir / text.replace(":", "-")
        work.mkdir(parents=True, exist_ok=True)
        command = tune_command(
            problem, work, cache_dir, overrides=[f"dtype={problem.dtype}", *args.tuner_args]
        )
        entry: dict[str, Any] = {"problem": problem.label()}
        entry["tuning"] = run_tuning(command, work / "tune.log", args.tune_timeout_s)
        try:
            best = read_best(f"sqlite:///{work / 'plans.sqlite'}", problem)
        except RegistryError as error:  # the tuning stored nothing: say so, go on
            best, entry["error"] = None, f"no stored plan: {error} (see {work / 'tune.log'})"
        entry["stored"] = best
        if best is not None:
            entry |= measure(problem, best, cache_dir, args)
            entry["ratios"] = ratios(entry)
        report["shapes"][text] = entry
        args.out.write_text(json.dumps(report, indent=1, default=str))
        tuned = entry.get("tuned", {})
        peers = entry.get("peers", {})
        flex = peers.get("flex", {})
        tflops = tuned.get("tflops")
        autotune_s = flex.get("compile_autotune_s")
        print(
            f"{text:22s} tuned {best and best.get('key')} {tuned.get('median_ms')} ms "
            f"({tflops and round(tflops, 1)} TF, err {tuned.get('max_abs_error')})"
            f" | tune {entry['tuning']['wall_s']} s | flex autotune "
            f"{autotune_s and round(autotune_s, 1)} s | "
            + " ".join(f"{k} {v:.2f}x" for k, v in entry.get("ratios", {}).items()),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
