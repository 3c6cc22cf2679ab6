"""The attention variants on the GPU, family by family: every tensor-core family's kernels on
windows (smaller than a key tile, two-sided, with causal + GQA + kv_len != seq_len), logit
softcaps with logits in the hundreds, ALiBi over 64 heads, dominating sinks, all of them at
once, in prefill and decode, with and without split-KV (the merge adds the sinks), and the
row log-sum-exps the backward pass reads.

Each case's plans (the cost model's best of each family that takes it, and its best plan with
several splits where there is one) are compiled here (``prepare``); on the GPU (``run``) they
launch through the CUDA driver on torch tensors and are judged by FlashAttention's rule
against a float64 reference of the same rounded inputs: ``max|out - ref| <= 2 *
max|peer - ref| + floor``, the peer being the same attention computed naively in the input
dtype (bf16/fp16 products, fp32 softmax, P rounded to the dtype), as FlashAttention's tests
do for every variant; float32 against ``2 * peer(float32) + 2^-20``. LSEs against float64
to 1e-3 (absolute, natural log).

    python bench/variant_parity.py prepare --dir scratch/variants
    python bench/variant_parity.py run --dir scratch/variants --out result.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from kernels import build  # noqa: E402
from kernels.attention_variants import alibi_slopes  # noqa: E402
from tuner.costmodel import predict_time_ms  # noqa: E402
from tuner.device import H200  # noqa: E402
from tuner.planner import candidate_space  # noqa: E402
from tuner.planner.launches import DeviceBuffers  # noqa: E402
from tuner.planner.plan import KernelPlan  # noqa: E402
from tuner.problem import Problem  # noqa: E402

PREFILL_FAMILIES = ("mma_f16", "wgmma_f16")
DECODE_FAMILIES = ("decode_f16", "mma_f16", "wgmma_f16")
FLOOR = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-20}
#: input scale that puts the logits of a softcap case in the hundreds
SOFTCAP_INPUT_SCALE = 12.0


def cases() -> list[tuple[str, Problem, tuple[str, ...]]]:
    """(name, problem, families) of every case."""
    bf16, fp16, fp32 = "bfloat16", "float16", "float32"

    def p(seq, d, dtype=bf16, **kw: Any) -> Problem:
        return Problem(seq, d, dtype=dtype, **kw)

    return [
        ("plain_lse", p(333, 128, batch=2, heads=4, causal=True), PREFILL_FAMILIES),
        ("window_below_tile", p(300, 64, heads=4, kv_heads=2, causal=True, window_left=20),
         PREFILL_FAMILIES),
        ("window_gqa_kvlen", p(200, 128, batch=2, heads=8, kv_heads=2, kv_len=520, causal=True,
                                window_left=100), PREFILL_FAMILIES),
        ("window_two_sided", p(257, 64, heads=4, window_left=33, window_right=17),
         PREFILL_FAMILIES),
        ("softcap_large_logits", p(300, 128, heads=4, causal=True, softcap=30.0),
         PREFILL_FAMILIES),
        ("softcap_fp16", p(190, 64, dtype=fp16, heads=4, kv_heads=1, softcap=50.0),
         PREFILL_FAMILIES),
        ("alibi_64_heads", p(256, 64, heads=64, kv_heads=8, causal=True, alibi=True),
         PREFILL_FAMILIES),
        ("sinks_dominate", p(128, 64, batch=2, heads=8, kv_heads=2, sinks=True),
         PREFILL_FAMILIES),
        ("everything", p(300, 128, heads=8, kv_heads=2, causal=True, window_left=64,
                          softcap=20.0, alibi=True, sinks=True), PREFILL_FAMILIES),
        ("fp32_everything", p(200, 64, dtype=fp32, heads=4, kv_heads=2, causal=True,
                               window_left=40, softcap=20.0, alibi=True, sinks=True),
         ("mma_tf32",)),
        ("decode_window_sinks", p(1, 128, batch=4, heads=32, kv_heads=8, kv_len=1000,
                                   causal=True, window_left=128, sinks=True), DECODE_FAMILIES),
        ("decode_softcap_alibi", p(2, 128, batch=2, heads=32, kv_heads=8, kv_len=777,
                                    causal=True, softcap=30.0, alibi=True), DECODE_FAMILIES),
        ("decode_long_window_splits", p(1, 128, heads=32, kv_heads=8, kv_len=8192, causal=True,
                                         window_left=1024, sinks=True), DECODE_FAMILIES),
        ("decode_long_splits_lse", p(1, 128, batch=2, heads=16, kv_heads=4, kv_len=6000),
         DECODE_FAMILIES),
        ("head_dim_192", p(333, 192, batch=2, heads=4, kv_heads=2), PREFILL_FAMILIES),
        ("gemma_head_dim_256", p(700, 256, heads=8, kv_heads=4, causal=True, window_left=300,
                                  softcap=50.0), PREFILL_FAMILIES),
        ("decode_head_dim_256", p(1, 256, batch=2, heads=16, kv_heads=8, kv_len=3000,
                                   causal=True, window_left=1000, softcap=50.0),
         DECODE_FAMILIES),
    ]


def chosen_plans(problem: Problem, family: str) -> list[KernelPlan]:
    """The model's best plan of the family, and its best with one split and with several
    (where those are other plans)."""
    feasible = [plan for plan in candidate_space(problem, H200).feasible if plan.family == family]
    ranked = sorted(feasible, key=lambda plan: predict_time_ms(plan, H200))
    chosen: list[KernelPlan] = []
    for wanted in (
        lambda plan: True,
        lambda plan: plan.sequence_splits == 1,
        lambda plan: plan.sequence_splits > 1,
    ):
        plan = next((plan for plan in ranked if wanted(plan)), None)
        if plan is not None and plan not in chosen:
            chosen.append(plan)
    return chosen


def prepare(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    entries = []
    for name, problem, families in cases():
        for family in families:
            for plan in chosen_plans(problem, family):
                compiled = build.compile_kernel(plan, directory / "cache")
                if isinstance(compiled, build.CompileFailure):
                    raise SystemExit(f"{name} {plan.key()}: {compiled.reason}")
                cubin = f"{name}-{plan.key().replace('/', '_')}.cubin"
                (directory / cubin).write_bytes(compiled.cubin)
                entries.append({"case": name, "family": family, "key": plan.key(),
                                "cubin": cubin, "registers":
                                compiled.primary_resources.registers,
                                "spills": compiled.primary_resources.spill_store_bytes})
                print(f"compiled {name} {plan.key()}", flush=True)
    (directory / "manifest.json").write_text(json.dumps({"plans": entries}, indent=1))


# ---------------------------------------------------------------------------- the GPU side


def attention(q, k, v, problem: Problem, scale: float, slopes, sinks, compute) -> tuple:  # noqa: ANN001
    """Attention of [B, H, N, D] q and [B, KVH, M, D] k, v with the problem's variants, in
    `compute` (float64: the reference; the input dtype: the peer). Returns (out, lse)."""
    import torch

    group = problem.group
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    low_precision = compute != torch.float64
    scores = torch.matmul(q.to(compute), k.to(compute).transpose(-1, -2)).to(
        torch.float32 if low_precision else torch.float64
    ) * scale
    if problem.softcap > 0:
        scores = problem.softcap * torch.tanh(scores / problem.softcap)
    n, m = problem.seq_len, problem.kv_len
    rows = torch.arange(n, device=q.device)[:, None]
    keys = torch.arange(m, device=q.device)[None, :]
    relative = keys - rows - (m - n)
    if problem.alibi:
        slope = torch.tensor(slopes, device=q.device, dtype=scores.dtype)[None, :, None, None]
        scores = scores - slope * relative.abs().to(scores.dtype)
    visible = torch.ones(n, m, dtype=torch.bool, device=q.device)
    low, high = problem.visible_offsets
    if low is not None and problem.windowed:
        visible &= relative >= low - (m - n)
    if high is not None:
        visible &= relative <= high - (m - n)
    scores = scores.masked_fill(~visible, -math.inf)
    if problem.sinks:
        sink = torch.tensor(sinks, device=q.device, dtype=scores.dtype)[None, :, None, None]
        sink = sink.expand(scores.shape[0], -1, n, 1)
        scores = torch.cat([scores, sink], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)
    probabilities = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    if problem.sinks:
        probabilities = probabilities[..., :-1]
    out = torch.matmul(probabilities.to(compute), v.to(compute))
    return out, lse


def run(directory: Path, out: Path) -> int:
    import torch
    from driver_launch import DriverLauncher

    from kernels.cuda_driver import CudaDriver
    from kernels.launch import buffer_elements, launch_sequence

    torch.empty(1, device="cuda")
    driver = CudaDriver()
    stream = torch.cuda.current_stream().cuda_stream
    manifest = json.loads((directory / "manifest.json").read_text())
    problems = {name: problem for name, problem, _ in cases()}
    results, failures = [], 0
    for entry in manifest["plans"]:
        problem = problems[entry["case"]]
        plan = next(plan for plan in candidate_space(problem, H200).feasible
                    if plan.key() == entry["key"])
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(problem.dtype,
                                                                         torch.float32)
        generator = torch.Generator(device="cuda").manual_seed(7)
        b, h, kvh, n, m, d = (problem.batch, problem.heads, problem.kv_heads, problem.seq_len,
                              problem.kv_len, problem.head_dim)
        magnitude = SOFTCAP_INPUT_SCALE if problem.softcap > 0 else 1.0

        def draw(*shape: int, magnitude: float = magnitude, generator=generator, dtype=dtype):  # noqa: ANN001
            return (torch.randn(*shape, device="cuda", generator=generator) * magnitude).to(dtype)

        q, k, v = draw(b, h, n, d), draw(b, kvh, m, d), draw(b, kvh, m, d, magnitude=1.0)
        slopes = alibi_slopes(h).tolist()
        # Sinks well above the typical row max, so a kernel that drops them fails.
        sinks = (torch.rand(h, generator=generator, device="cuda") * 4 + 4).tolist()
        slopes_tensor = torch.tensor(slopes, device="cuda", dtype=torch.float32)
        sinks_tensor = torch.tensor(sinks, device="cuda", dtype=torch.float32)
        output = torch.full_like(q, float("nan"))
        lse = torch.full((b * h * n,), float("nan"), device="cuda")
        sizes = buffer_elements(plan)
        partial_o = torch.empty(max(sizes.partial_o, 1), device="cuda")
        partial_ml = torch.empty(max(sizes.partial_ml, 1), device="cuda")
        buffers = DeviceBuffers(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), output.data_ptr(),
            partial_o.data_ptr() if sizes.partial_o else 0,
            partial_ml.data_ptr() if sizes.partial_ml else 0,
            alibi_slopes=slopes_tensor.data_ptr() if problem.alibi else 0,
            sinks=sinks_tensor.data_ptr() if problem.sinks else 0,
            lse=lse.data_ptr(),
        )
        launcher = DriverLauncher(driver, (directory / entry["cubin"]).read_bytes(),
                                  launch_sequence(plan, buffers), stream)
        error_text = ""
        try:
            launcher()
            torch.cuda.synchronize()
        except RuntimeError as error:
            error_text = str(error)
        finally:
            launcher.close()
        scale = 1.0 / math.sqrt(d)
        reference, reference_lse = attention(q, k, v, problem, scale, slopes, sinks,
                                             torch.float64)
        peer, _ = attention(q, k, v, problem, scale, slopes, sinks, dtype)
        peer_error = (peer.double() - reference).abs().max().item()
        limit = 2 * peer_error + FLOOR[problem.dtype]
        finite = bool(torch.isfinite(output).all().item())
        error = (output.double() - reference).abs().max().item() if finite else math.inf
        reference_lse = reference_lse.reshape(-1)
        empty = torch.isinf(reference_lse)
        lse_error = (lse.double() - reference_lse).abs()[~empty].max().item()
        lse_empty_ok = bool(torch.isinf(lse[empty]).all().item()) if empty.any() else True
        passed = not error_text and finite and error <= limit and lse_error <= 1e-3 and lse_empty_ok
        failures += not passed
        result = {**entry, "problem": asdict(problem), "label": problem.label(), "splits":
                  plan.sequence_splits, "max_abs_error": error, "limit": limit,
                  "peer_error": peer_error, "lse_error": lse_error, "finite": finite,
                  "launch_error": error_text, "passed": passed}
        results.append(result)
        print(f"{'PASS' if passed else 'FAIL'} {entry['case']:26s} {entry['key']:40s} "
              f"error {error:.2e} (limit {limit:.2e}) lse {lse_error:.1e} {error_text}",
              flush=True)
    out.write_text(json.dumps({"results": results, "failures": failures}, indent=1))
    print(f"{len(results) - failures} of {len(results)} passed", flush=True)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prepare_parser = commands.add_parser("prepare", help="compile the cases' plans (CPU)")
    prepare_parser.add_argument("--dir", type=Path, required=True)
    run_parser = commands.add_parser("run", help="run and judge them (GPU)")
    run_parser.add_argument("--dir", type=Path, required=True)
    run_parser.add_argument("--out", type=Path, required=True)
    arguments = parser.parse_args(argv)
    if arguments.command == "prepare":
        prepare(arguments.dir)
        return 0
    return run(arguments.dir, arguments.out)


if __name__ == "__main__":
    sys.exit(main())
