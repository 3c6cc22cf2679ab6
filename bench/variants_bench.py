"""The attention variants against FlexAttention and torch SDPA, tuned with the user's command.

    python bench/variants_bench.py --out $OUT/variants_bench.json --work-dir /tmp/variants

For each target shape of issue 24 (Mistral-like sliding window, gpt-oss-like window of 128
with sinks, Gemma-2-like window with a softcap, ALiBi) it runs ``python -m tuner`` at default
settings with the variant's keys (its own registry and study under ``--work-dir``), then, in
this process, times the stored plan through ``kernels.attention`` (torch tensors, what a
deployment calls: slopes and sinks as tensors) next to:

* FlexAttention compiled with ``mode="max-autotune-no-cudagraphs"``: a block mask for the
  window/causal structure, ``score_mod`` for the softcap and ALiBi, and for sinks its
  log-sum-exp (``return_lse``) folding the sink into the denominator in the same compiled
  function (what gpt-oss implementations on Flex do); where Inductor fails to build the
  max-autotune variant, the default compile mode is timed as ``flex_default`` (the
  failure kept under ``flex``);
* torch SDPA where it can express the variant: the window as a boolean mask, ALiBi as an
  additive float mask (the efficient backend); softcaps and sinks it cannot express;
* the same shape's plain causal attention with the same plan (``--dense``), both timed by
  the tuner's own measurement (PyCUDA backend, parity-checked): the window's time against
  (visible pairs / causal pairs) x the causal time.

All on the same inputs, CUDA events, L2 flushed before each repetition; the tuned plan is
timed before and after the peers. Ratios > 1: ours is faster. TFLOP/s on visible pairs.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evidence import read_best, run_tuning, tune_command  # noqa: E402
from speed_check import time_torch_call as timed  # noqa: E402

from kernels.attention_variants import alibi_slopes  # noqa: E402
from tuner.problem import Problem  # noqa: E402

SHAPES: dict[str, Problem] = {
    "mistral": Problem(16384, 128, heads=32, kv_heads=8, causal=True, dtype="bfloat16",
                       window_left=4096),
    "gpt-oss": Problem(4096, 64, batch=4, heads=64, kv_heads=8, causal=True, dtype="bfloat16",
                       window_left=128, sinks=True),
    "gemma-2": Problem(8192, 128, batch=2, heads=16, kv_heads=8, causal=True, dtype="bfloat16",
                       window_left=4096, softcap=50.0),
    "alibi": Problem(2048, 128, batch=4, heads=16, causal=True, dtype="bfloat16", alibi=True),
}


def variant_overrides(problem: Problem) -> list[str]:
    overrides = []
    if problem.window_left >= 0:
        overrides.append(f"window_left={problem.window_left}")
    if problem.window_right >= 0:
        overrides.append(f"window_right={problem.window_right}")
    if problem.softcap > 0:
        overrides.append(f"softcap={problem.softcap}")
    if problem.alibi:
        overrides.append("alibi=true")
    if problem.sinks:
        overrides.append("sinks=true")
    return overrides


def dense_of(problem: Problem) -> Problem:
    return Problem(problem.seq_len, problem.head_dim, batch=problem.batch, heads=problem.heads,
                   kv_heads=problem.kv_heads, kv_len=problem.kv_len, causal=problem.causal,
                   dtype=problem.dtype)


def tune(problem: Problem, work: Path, cache_dir: Path, timeout_s: float,
         extra: list[str]) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    command = tune_command(problem, work, cache_dir,
                           overrides=[*variant_overrides(problem), *extra])
    tuning = run_tuning(command, work / "tune.log", timeout_s)
    best = read_best(f"sqlite:///{work / 'plans.sqlite'}", problem)
    return {"command": shlex.join(command), "tuning": tuning, "stored": best,
            "registry": f"sqlite:///{work / 'plans.sqlite'}"}


def window_against_dense(problem: Problem, stored: dict[str, Any], cache_dir: Path,
                         repetitions: int) -> dict[str, Any]:
    """The stored plan's time on the problem and on its plain causal twin, same kernel
    parameters, through the tuner's measurement."""
    from kernels.backends.pycuda_backend import PyCudaBackend
    from tuner.planner.params import KernelParams
    from tuner.planner.tunable import plan_kernel

    gpu = PyCudaBackend(0, cache_dir=cache_dir, repetitions=repetitions, warmup=5)
    try:
        device = gpu.device_profile()
        params = KernelParams.from_stored(stored["family"], stored["params"])
        result = {}
        for name, which in (("windowed", problem), ("dense", dense_of(problem))):
            plan = plan_kernel(which, params, device)
            m = gpu.measure(plan, which)
            result[name] = {"plan": plan.key(), "ok": m.ok, "median_ms": m.median_ms,
                            "failure": m.failure and str(m.failure)}
        pairs = problem.attended_pairs / dense_of(problem).attended_pairs
        if result["windowed"]["ok"] and result["dense"]["ok"]:
            expected = pairs * result["dense"]["median_ms"]
            result["window_time_over_proportional"] = result["windowed"]["median_ms"] / expected
        result["visible_over_dense_pairs"] = pairs
        return result
    finally:
        gpu.close()


def measure(problem: Problem, registry: str, repetitions: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as functional
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import kernels

    b, h, kvh, n, m, d = (problem.batch, problem.heads, problem.kv_heads, problem.seq_len,
                          problem.kv_len, problem.head_dim)
    generator = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, h, n, d, device="cuda", generator=generator, dtype=torch.bfloat16)
    k = torch.randn(b, kvh, m, d, device="cuda", generator=generator, dtype=torch.bfloat16)
    v = torch.randn(b, kvh, m, d, device="cuda", generator=generator, dtype=torch.bfloat16)
    slopes = torch.tensor(alibi_slopes(h), device="cuda", dtype=torch.float32)
    sinks = torch.rand(h, device="cuda", generator=generator) * 2.0
    flush_buffer = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    flush = flush_buffer.zero_
    scale = 1.0 / math.sqrt(d)
    window = (problem.window_left, problem.window_right)
    offset = m - n
    left = problem.window_left

    def ours() -> Any:
        return kernels.attention(
            q, k, v, problem.causal, registry, window=window, softcap=problem.softcap,
            alibi_slopes=slopes if problem.alibi else None,
            sinks=sinks if problem.sinks else None,
        )

    with torch.no_grad():
        reference_out = ours()
        torch.cuda.synchronize()
        result: dict[str, Any] = {"ours": timed(torch, ours, flush, repetitions)}
        visible_flops = problem.useful_flops

        # ---- FlexAttention: block mask + score_mod (+ sinks through the LSE)
        def mask_mod(batch, head, q_idx, kv_idx):  # noqa: ANN001, ANN202
            keep = kv_idx <= q_idx + offset if problem.causal else kv_idx >= 0
            if left >= 0:
                keep = keep & (kv_idx >= q_idx + offset - left)
            return keep

        def score_mod(score, batch, head, q_idx, kv_idx):  # noqa: ANN001, ANN202
            if problem.softcap > 0:
                score = problem.softcap * torch.tanh(score / problem.softcap)
            if problem.alibi:
                score = score - slopes[head] * (q_idx + offset - kv_idx).abs()
            return score

        block_mask = create_block_mask(mask_mod, None, None, n, m)
        group = problem.group
        flex = torch.compile(flex_attention, mode="max-autotune-no-cudagraphs")

        def flex_call(flex: Any = flex) -> Any:
            mod = score_mod if (problem.softcap > 0 or problem.alibi) else None
            if not problem.sinks:
                return flex(q, k, v, score_mod=mod, block_mask=block_mask, scale=scale,
                            enable_gqa=group > 1)
            out, lse = flex(q, k, v, score_mod=mod, block_mask=block_mask, scale=scale,
                            enable_gqa=group > 1, return_lse=True)
            # the sink joins the denominator: out * sum / (sum + exp(sink))
            keep = torch.sigmoid(lse - sinks[None, :, None])
            return out * keep[..., None].to(out.dtype)

        # max-autotune first (the peer); where Inductor fails to build it, the
        # default compile mode, recorded as such (the failure is kept next to it)
        for name, mode in (("flex", "max-autotune-no-cudagraphs"), ("flex_default", "default")):
            if name == "flex_default" and "error" not in result["flex"]:
                break
            compiled = torch.compile(flex_attention, mode=mode) if name != "flex" else flex
            try:
                began = time.monotonic()
                flex_out = flex_call(compiled)
                torch.cuda.synchronize()
                compile_s = time.monotonic() - began
                flex_error = (flex_out.float() - reference_out.float()).abs().max().item()
                result[name] = timed(torch, lambda f=compiled: flex_call(f), flush,
                                     repetitions) | {
                    "mode": mode, "compile_autotune_s": compile_s,
                    "max_abs_difference_to_ours": flex_error}
            except Exception as error:  # a peer's failure is recorded, not fatal
                result[name] = {"mode": mode,
                                "error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}

        # ---- SDPA where it can express the variant (windows, ALiBi; not softcap or sinks)
        if problem.softcap == 0 and not problem.sinks:
            rows = torch.arange(n, device="cuda")[:, None]
            keys = torch.arange(m, device="cuda")[None, :]
            allowed = mask_mod(None, None, rows, keys)
            if problem.alibi:
                bias = -(slopes[:, None, None] * (rows + offset - keys).abs()).to(torch.bfloat16)
                attn_mask = bias.masked_fill(~allowed, -math.inf)[None]
            else:
                attn_mask = allowed
            k_full = k.repeat_interleave(group, dim=1)
            v_full = v.repeat_interleave(group, dim=1)
            for name, backend in (("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION),
                                  ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
                try:
                    with sdpa_kernel(backend):
                        def sdpa(mask: Any = attn_mask) -> Any:
                            return functional.scaled_dot_product_attention(
                                q, k_full, v_full, attn_mask=mask)
                        sdpa()
                        result[name] = timed(torch, sdpa, flush, repetitions)
                except RuntimeError as error:
                    result[name] = {"error": str(error).splitlines()[0]}
            del k_full, v_full
        result["ours_again"] = timed(torch, ours, flush, repetitions)
        ours_ms = min(result["ours"]["median_ms"], result["ours_again"]["median_ms"])
        result["ours_tflops"] = visible_flops / (ours_ms * 1e-3) / 1e12
        result["ratios"] = {
            f"{name}_over_ours": entry["median_ms"] / ours_ms
            for name, entry in result.items()
            if isinstance(entry, dict) and "median_ms" in entry and not name.startswith("ours")
        }
    torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--dense", nargs="*", default=["mistral"], choices=list(SHAPES),
                        help="shapes whose stored plan is also timed on the plain causal twin")
    parser.add_argument("--repetitions", type=int, default=20)
    parser.add_argument("--tune-timeout-s", type=float, default=120.0)
    parser.add_argument("--tuner-args", nargs="*", default=[],
                        help="extra key=value overrides of the tuning command")
    args = parser.parse_args(argv)
    cache_dir = args.work_dir / "cubins"
    report: dict[str, Any] = {
        "command": "python " + shlex.join(["bench/variants_bench.py", *(argv or sys.argv[1:])]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "shapes": {},
    }
    for name in args.shapes:
        problem = SHAPES[name]
        entry: dict[str, Any] = {"problem": problem.label()}
        entry["tuned"] = tune(problem, args.work_dir / name, cache_dir, args.tune_timeout_s,
                              args.tuner_args)
        stored = entry["tuned"]["stored"]
        if stored is not None:
            entry |= measure(problem, entry["tuned"]["registry"], args.repetitions)
            if name in args.dense:
                entry["window_against_dense"] = window_against_dense(
                    problem, stored, cache_dir, args.repetitions)
        report["shapes"][name] = entry
        args.out.write_text(json.dumps(report, indent=1, default=str))
        print(f"{name:8s} {problem.label()}: ours {entry.get('ours_tflops', 0):.0f} TF "
              f"({(entry['tuned']['stored'] or {}).get('key')}, tuned in "
              f"{entry['tuned']['tuning']['wall_s']} s) "
              + " ".join(f"{k} {v:.2f}x" for k, v in entry.get("ratios", {}).items())
              + (" window/proportional "
                 f"{entry['window_against_dense'].get('window_time_over_proportional')}"
                 if "window_against_dense" in entry else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
