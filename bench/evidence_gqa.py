"""GQA and decode evidence on the GPU: tune each shape, then time the stored plan next to torch.

    python bench/evidence_gqa.py --out $OUT/evidence_gqa.json --work-dir /tmp/evgqa \
        [--cache-dir DIR] [--shapes ...] [--tuner-args search.n_trials=N ...]

Shapes are ``BxH/KVHxN[:KVLEN]xD[c]`` in bfloat16 (``16x32/8x1:8192x128``: batch 16, 32
query heads on 8 KV heads, one query row against 8192 keys, head_dim 128; ``c``:
causal). For each it runs the user's command (``python -m tuner ... kv_heads=..
kv_len=..``, bench/evidence.py's ``tune_command``) writing only under ``--work-dir``
and a cubin cache (``--cache-dir``, default ``<work-dir>/cubins``), then, in this
process, measures the registry's best plan with the PyCUDA backend (parity against
float64, CUDA events, L2 flushed before each repetition) and times torch SDPA's flash
and cuDNN backends on the same inputs with the same loop and timer
(bench/speed_check.py's ``TorchTimer``, ``kernels.timing.time_repetitions``): each
with ``enable_gqa=True`` where the backend accepts it, and with K and V
``repeat_interleave``d to the query heads (prepared before timing). The tuned plan is
measured before and after the peers. Ratios > 1 mean the tuned plan is faster;
``vs_best`` is against torch's fastest variant. Decode shapes also report the
effective bandwidth, K+V bytes over the median time.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from evidence import read_best, run_tuning, tune_command
from speed_check import TorchTimer, timing_record

from kernels.timing import time_repetitions
from tuner.problem import Problem

DEFAULT_SHAPES = (
    "2x32/8x4096x128c",
    "16x32/8x1:8192x128",
    "1x32/8x1:32768x128",
    "64x32/8x1:2048x128",
    "16x32/1x1:8192x128",
)
SHAPE = re.compile(r"^(\d+)x(\d+)/(\d+)x(\d+)(?::(\d+))?x(\d+)(c?)$")


def parse_shape(text: str) -> Problem:
    match = SHAPE.match(text)
    if match is None:
        raise SystemExit(f"shape {text!r} is not BxH/KVHxN[:KVLEN]xD[c]")
    b, h, kvh, n, kv_len, d, causal = match.groups()
    return Problem(
        int(n),
        int(d),
        batch=int(b),
        heads=int(h),
        causal=bool(causal),
        dtype="bfloat16",
        kv_heads=int(kvh),
        kv_len=int(kv_len) if kv_len else None,
    )


def kv_bytes(problem: Problem) -> int:
    return 2 * problem.kv_tensor_bytes


def time_peers(
    problem: Problem, inputs: tuple[np.ndarray, ...], l2_bytes: int, repetitions: int, warmup: int
) -> dict[str, Any]:
    import torch
    import torch.nn.functional as functional
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q_shape = (problem.batch, problem.heads, problem.seq_len, problem.head_dim)
    kv_shape = (problem.batch, problem.kv_heads, problem.kv_len, problem.head_dim)
    q, k, v = (
        torch.from_numpy(a.reshape(s)).cuda().to(torch.bfloat16)
        for a, s in zip(inputs, (q_shape, kv_shape, kv_shape), strict=True)
    )
    k_full, v_full = (t.repeat_interleave(problem.group, dim=1) for t in (k, v))
    mask = None
    if problem.causal and problem.kv_len != problem.seq_len:
        # torch's is_causal is top-left aligned; a KV cache needs bottom-right
        mask = torch.ones(problem.seq_len, problem.kv_len, dtype=torch.bool, device="cuda").tril(
            problem.causal_offset
        )
    is_causal = problem.causal and mask is None
    flush_buffer = torch.empty(2 * l2_bytes, dtype=torch.uint8, device="cuda")

    def flush() -> None:
        flush_buffer.zero_()

    results: dict[str, Any] = {"version": torch.__version__}
    for name, backend in (
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
    ):
        for variant, keys, values, gqa in (
            ("gqa", k, v, True),
            ("repeat_interleave", k_full, v_full, False),
        ):
            label = f"{name}_{variant}"
            try:
                with sdpa_kernel(backend):

                    def run(keys: Any = keys, values: Any = values, gqa: bool = gqa) -> None:
                        functional.scaled_dot_product_attention(
                            q, keys, values, attn_mask=mask, is_causal=is_causal, enable_gqa=gqa
                        )

                    stats = time_repetitions(
                        run, TorchTimer(torch), repetitions=repetitions, warmup=warmup, flush=flush
                    )
            except RuntimeError as error:
                results[label] = {"error": str(error).splitlines()[0][:300]}
                continue
            results[label] = timing_record(problem, stats)
    del k_full, v_full
    torch.cuda.empty_cache()
    return results


def measure(problem: Problem, best: dict[str, Any], cache_dir: Path, args: Any) -> dict[str, Any]:
    from kernels.backends.pycuda_backend import PyCudaBackend
    from tuner.planner.params import KernelParams
    from tuner.planner.tunable import plan_kernel

    gpu = PyCudaBackend(0, cache_dir=cache_dir, repetitions=args.repetitions, warmup=args.warmup)
    result: dict[str, Any] = {}
    try:
        device = gpu.device_profile()
        params = KernelParams.from_stored(best["family"], best["params"])
        plan = plan_kernel(problem, params, device)
        result["plan"] = plan.key()
        result["predicted_read_bytes"] = plan.global_read_bytes

        def ours() -> dict[str, Any]:
            m = gpu.measure(plan, problem)
            return {
                "ok": m.ok,
                "failure": m.failure and str(m.failure),
                "detail": m.detail,
                "median_ms": m.median_ms,
                "spread_ms": m.spread_ms,
                "tflops": m.tflops,
                "max_abs_error": m.max_abs_error,
            }

        result["tuned"] = ours()
        result["peers"] = time_peers(
            problem, gpu.inputs(problem), device.l2_bytes, args.repetitions, args.warmup
        )
        result["tuned_again"] = ours()
    finally:
        gpu.close()
    return result


def summary(problem: Problem, result: dict[str, Any]) -> dict[str, Any]:
    """ms, ratios (peer / tuned; > 1: tuned is faster), TB/s of K+V for decode."""
    tuned = [result.get(k, {}).get("median_ms") for k in ("tuned", "tuned_again")]
    tuned = [t for t in tuned if t]
    peers = {
        name: peer["median_ms"]
        for name, peer in result.get("peers", {}).items()
        if isinstance(peer, dict) and peer.get("median_ms")
    }
    if not tuned:
        return {"peers_ms": peers}
    ours = min(tuned)
    out: dict[str, Any] = {
        "tuned_ms": ours,
        "peers_ms": peers,
        "ratios": {f"{name}_over_tuned": ms / ours for name, ms in peers.items()},
        "tuned_tflops": problem.useful_flops / (ours * 1e-3) / 1e12,
    }
    if peers:
        best_name = min(peers, key=peers.__getitem__)
        out["torch_best"] = best_name
        out["vs_best"] = peers[best_name] / ours
        out["torch_best_tflops"] = problem.useful_flops / (peers[best_name] * 1e-3) / 1e12
    if problem.seq_len <= 16:
        out["tuned_kv_tbps"] = kv_bytes(problem) / (ours * 1e-3) / 1e12
        if peers:
            out["torch_best_kv_tbps"] = kv_bytes(problem) / (min(peers.values()) * 1e-3) / 1e12
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--work-dir", required=True, type=Path)
    parser.add_argument("--cache-dir", type=Path, help="cubin cache (default <work-dir>/cubins)")
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES))
    parser.add_argument("--repetitions", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--tune-timeout-s", type=float, default=240.0)
    parser.add_argument("--tuner-args", nargs="*", default=[], help="extra key=value overrides")
    args = parser.parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    cache_dir = args.cache_dir or args.work_dir / "cubins"
    report: dict[str, Any] = {
        "command": "python " + shlex.join(["bench/evidence_gqa.py", *(argv or sys.argv[1:])]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "shapes": {},
    }
    for text in args.shapes:
        problem = parse_shape(text)
        work = args.work_dir / re.sub(r"[^0-9a-z]+", "-", text)
        work.mkdir(parents=True, exist_ok=True)
        command = tune_command(problem, work, cache_dir, overrides=args.tuner_args)
        entry: dict[str, Any] = {"problem": problem.label()}
        entry["tuning"] = run_tuning(command, work / "tune.log", args.tune_timeout_s)
        best = read_best(f"sqlite:///{work / 'plans.sqlite'}", problem)
        entry["stored"] = best
        if best is not None:
            entry |= measure(problem, best, cache_dir, args)
            entry["summary"] = summary(problem, entry)
        report["shapes"][text] = entry
        args.out.write_text(json.dumps(report, indent=1, default=str))
        s = entry.get("summary", {})
        bandwidth = (
            f" | {s['tuned_kv_tbps']:.2f} TB/s (torch best {s['torch_best_kv_tbps']:.2f})"
            if "tuned_kv_tbps" in s and "torch_best_kv_tbps" in s
            else ""
        )
        print(
            f"{text:22s} {entry.get('plan')} {s.get('tuned_ms')} ms "
            f"(err {entry.get('tuned', {}).get('max_abs_error')}) | tune "
            f"{entry['tuning']['wall_s']} s | vs {s.get('torch_best')} {s.get('vs_best')}"
            f"{bandwidth} | " + " ".join(f"{k} {v:.2f}x" for k, v in s.get("ratios", {}).items()),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
