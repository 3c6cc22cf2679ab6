"""The backward pass on the GPU: our backward families next to torch's, and a training step.

    PYTHONPATH=$PWD python bench/backward_bench.py --out $OUT/backward_bench.json [--flex]

Per shape (bf16; default: 4x16x4096x128 full and causal, 1x32x8192x128, 8x32x1024x64 and the
GQA 2x32/8x4096x128 causal), all in this process, on the same inputs, CUDA events around the
backward launches only, L2 flushed before each repetition (``kernels.timing``):

* ours: no tuning (the ~90 s budget has no room for it); the cost model's ``--candidates``
  best backward plans of each family (``mma_f16_bwd``, and ``wgmma_f16_bwd`` on sm_90) are
  each timed through their deploy handle (dq, dk, dv from dO, O and the LSE), and the
  fastest is reported with the others (and each family's fastest); its
  deterministic variant too (dQ added in key-tile order), and what ``kernels.attention``'s
  autograd runs with no registry (the planner's default, through ``torch.autograd.grad``);
* torch SDPA's flash (FlashAttention-2) and cuDNN backwards (``sdpa_kernel``), through
  ``torch.autograd.grad`` with the graph retained; with ``--flex``, FlexAttention's backward
  (``torch.compile(flex_attention, mode="max-autotune-no-cudagraphs")``, compile and
  autotuning timed apart, about 30 s a shape).

TFLOP/s count the backward as 2.5x the forward's matmul flops (FlashAttention's convention).
Ours is checked against SDPA flash's gradients (max |difference| printed). Then one training
step (forward + backward, no optimiser) of a 2-layer pre-norm transformer block (d_model
2048, 16 heads of 128, MLP 4x, bf16, batch x tokens ``--step-shape``) with ``kernels.attention``
against the same block on SDPA (its default backend choice), eager or with ``--compile``
(``torch.compile``, ``fullgraph=True`` for ours). Writes JSON to ``--out``, prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speed_check import TorchTimer  # noqa: E402

from kernels.timing import time_repetitions  # noqa: E402
from tuner.problem import Problem  # noqa: E402

#: (batch, heads, kv_heads, seq_len, head_dim, causal)
SHAPES = {
    "4x16x4096x128": (4, 16, 16, 4096, 128, False),
    "4x16x4096x128-causal": (4, 16, 16, 4096, 128, True),
    "1x32x8192x128": (1, 32, 32, 8192, 128, False),
    "8x32x1024x64": (8, 32, 32, 1024, 64, False),
    "2x32/8x4096x128-causal": (2, 32, 8, 4096, 128, True),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON results file")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--candidates", type=int, default=6, help="our plans timed per shape")
    parser.add_argument("--repetitions", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--flex", action="store_true", help="also FlexAttention (slow compile)")
    parser.add_argument("--compile", action="store_true", help="training step under compile")
    parser.add_argument("--step-shape", default="4x2048", help="batch x tokens of the step")
    parser.add_argument("--no-step", action="store_true", help="skip the training step")
    return parser.parse_args(argv)


def problem_of(name: str) -> Problem:
    batch, heads, kv_heads, n, d, causal = SHAPES[name]
    return Problem(n, d, batch=batch, heads=heads, kv_heads=kv_heads, causal=causal,
                   dtype="bfloat16", direction="backward")  # fmt: skip


class Bench:
    def __init__(self, torch: Any, args: argparse.Namespace) -> None:
        import kernels

        self.torch, self.args = torch, args
        self.attend = kernels.Attention(None)
        self.runner = self.attend._runner(0)
        l2 = self.runner.profile.l2_bytes
        self.flush_buffer = torch.empty(2 * l2, dtype=torch.uint8, device="cuda")

    def time(self, run: Any) -> dict[str, Any]:
        stats = time_repetitions(
            run,
            TorchTimer(self.torch),
            repetitions=self.args.repetitions,
            warmup=self.args.warmup,
            flush=self.flush_buffer.zero_,
        )
        return {"median_ms": stats.median_ms, "spread_ms": stats.spread_ms}

    def inputs(self, problem: Problem) -> tuple[Any, ...]:
        torch = self.torch
        generator = torch.Generator(device="cuda").manual_seed(0)
        shape = (problem.batch, problem.heads, problem.seq_len, problem.head_dim)
        kv_shape = (problem.batch, problem.kv_heads, problem.kv_len, problem.head_dim)

        def make(size: tuple[int, ...]) -> Any:
            return torch.randn(size, device="cuda", dtype=torch.bfloat16, generator=generator)

        return make(shape), make(kv_shape), make(kv_shape), make(shape)

    def ours(self, problem: Problem) -> dict[str, Any]:
        from kernels import build
        from kernels.plan_choice import ChosenPlan
        from tuner.costmodel import predict_time_ms
        from tuner.planner.space import candidate_space
        from tuner.planner.tunable import KernelParams, plan_kernel

        torch, device = self.torch, self.runner.profile
        q, k, v, dout = self.inputs(problem)
        causal = problem.causal
        with torch.no_grad():
            out, lse = self.attend.attention_with_lse(q, k, v, causal)
        ranked = sorted(
            (p for p in candidate_space(problem, device).feasible if not p.params.deterministic),
            key=lambda plan: predict_time_ms(plan, device),
        )
        # the --candidates best predicted of each backward family (mma_f16_bwd, and
        # wgmma_f16_bwd on sm_90), so each family's best is measured
        families = dict.fromkeys(plan.family for plan in ranked)
        plans = [
            plan
            for family in families
            for plan in [p for p in ranked if p.family == family][: self.args.candidates]
        ]
        build.compile_many(plans, self.runner.backend.cache_dir, arch=device.arch)
        rows = []
        for plan in plans:
            row = {"plan": plan.key(), "predicted_ms": predict_time_ms(plan, device)}
            try:
                handle = self.runner.backward_handle_of(ChosenPlan(plan, "candidate"))
                row |= self.time(lambda h=handle: h.run_torch(dout, q, k, v, out, lse, torch))
            except Exception as error:  # a plan that cannot run is a result, not the end
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
            rows.append(row)
        timed = [row for row in rows if "median_ms" in row]
        result: dict[str, Any] = {"candidates": rows, "plans": "cost model's top, best measured"}
        if not timed:
            return result
        best = min(timed, key=lambda row: row["median_ms"])
        result["best"] = best
        result["best_by_family"] = {
            family: min(rows_of, key=lambda row: row["median_ms"])
            for family in families
            if (rows_of := [r for r in timed if r["plan"].split("/")[0] == family])
        }
        chosen = next(plan for plan in plans if plan.key() == best["plan"])
        twin = plan_kernel(
            problem,
            KernelParams(chosen.family, **(chosen.params.tunables | {"deterministic": 1})),
            device,
        )
        try:
            handle = self.runner.backward_handle_of(ChosenPlan(twin, "candidate"))
            deterministic: dict[str, Any] = {"plan": twin.key()}
        except Exception as error:  # e.g. its ordered dQ spills: what a user would get
            handle = self.runner.backward_handle(problem, deterministic=True)
            reason = f"{type(error).__name__}: {str(error).splitlines()[0]}"
            deterministic = {"plan": handle.plan.key(), "twin": twin.key(), "twin_error": reason}
        result["deterministic"] = deterministic | self.time(
            lambda: handle.run_torch(dout, q, k, v, out, lse, torch)
        )
        dq, dk, dv = handle.run_torch(dout, q, k, v, out, lse, torch)
        result["gradients"] = (dq, dk, dv)
        # What a user gets: kernels.attention's autograd with the planner's default plan.
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        import kernels

        output = kernels.attention(*leaves, causal=causal)
        default = self.runner.backward_handle(problem).plan.key()
        result["autograd_default"] = {"plan": default} | self.time(
            lambda: torch.autograd.grad(output, leaves, dout, retain_graph=True)
        )
        return result

    def sdpa(self, problem: Problem, backend: Any) -> tuple[dict[str, Any], Any]:
        torch = self.torch
        from torch.nn.attention import sdpa_kernel

        q, k, v, dout = self.inputs(problem)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        attend = torch.nn.functional.scaled_dot_product_attention
        errors = []
        # GQA natively (enable_gqa) where the backend takes it, else K and V repeated per
        # query head (autograd then sums their gradients over the group, as GQA's are)
        for expanded in (False, True) if problem.group > 1 else (False,):
            try:
                with sdpa_kernel(backend):
                    if expanded:
                        keys, values = (t.repeat_interleave(problem.group, 1) for t in leaves[1:])
                        out = attend(leaves[0], keys, values, is_causal=problem.causal)
                    else:
                        gqa = problem.group > 1
                        out = attend(*leaves, is_causal=problem.causal, enable_gqa=gqa)
                    timing = self.time(
                        lambda out=out: torch.autograd.grad(out, leaves, dout, retain_graph=True)
                    )
                    grads = torch.autograd.grad(out, leaves, dout, retain_graph=True)
            except RuntimeError as error:
                errors.append(str(error).splitlines()[0])
                continue
            return timing | ({"gqa": "k, v repeated"} if expanded else {}), grads
        return {"error": " / ".join(errors)}, None

    def flex(self, problem: Problem) -> dict[str, Any]:
        torch = self.torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        q, k, v, dout = self.inputs(problem)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        try:
            mask = None
            if problem.causal:
                n = problem.seq_len
                mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, n, n)
            compiled = torch.compile(flex_attention, mode="max-autotune-no-cudagraphs")
            began = time.monotonic()
            out = compiled(*leaves, block_mask=mask, enable_gqa=problem.group > 1)
            torch.autograd.grad(out, leaves, dout, retain_graph=True)
            torch.cuda.synchronize()
            first = time.monotonic() - began
            timing = self.time(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True))
            return timing | {"compile_autotune_s": first}
        except Exception as error:  # a peer's failure is recorded, not fatal
            return {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}


def tflops(problem: Problem, timing: dict[str, Any]) -> float | None:
    ms = timing.get("median_ms")
    return problem.useful_flops / (ms * 1e-3) / 1e12 if ms else None


def difference(torch: Any, ours: Any, theirs: Any) -> dict[str, float] | None:
    if ours is None or theirs is None:
        return None
    return {
        name: float((a.float() - b.float()).abs().max())
        for name, a, b in zip(("dq", "dk", "dv"), ours, theirs, strict=True)
    }


class TransformerBlock:
    """Pre-norm layers: attention (16 heads of 128) and a 4x GELU MLP, bf16."""

    def __init__(self, torch: Any, layers: int, width: int, heads: int, attention: Any) -> None:
        self.torch, self.heads, self.attention = torch, heads, attention
        generator = torch.Generator(device="cuda").manual_seed(0)

        def weight(*shape: int) -> Any:
            values = torch.randn(*shape, device="cuda", generator=generator) / math.sqrt(shape[0])
            return values.to(torch.bfloat16).requires_grad_()

        self.layers = [
            (weight(width, 3 * width), weight(width, width), weight(width, 4 * width),
             weight(4 * width, width))
            for _ in range(layers)
        ]  # fmt: skip

    def parameters(self) -> list[Any]:
        return [w for layer in self.layers for w in layer]

    def __call__(self, x: Any) -> Any:
        functional = self.torch.nn.functional
        batch, tokens, width = x.shape
        head_dim = width // self.heads
        for qkv, proj, up, down in self.layers:
            h = functional.layer_norm(x, (width,))
            q, k, v = (h @ qkv).view(batch, tokens, 3, self.heads, head_dim).permute(2, 0, 3, 1, 4)
            attended = self.attention(q.contiguous(), k.contiguous(), v.contiguous())
            x = x + attended.transpose(1, 2).reshape(batch, tokens, width) @ proj
            x = x + functional.gelu(functional.layer_norm(x, (width,)) @ up) @ down
        return x.float().square().mean()


def training_step(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    import kernels

    torch = bench.torch
    batch, tokens = (int(x) for x in args.step_shape.split("x"))
    x = torch.randn(batch, tokens, 2048, device="cuda", dtype=torch.bfloat16)
    attentions = {
        "kernels.attention": lambda q, k, v: kernels.attention(q, k, v, causal=True),
        "sdpa": lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True
        ),
    }
    results: dict[str, Any] = {"shape": f"2 layers, d_model 2048, 16 heads, {batch}x{tokens}"}
    for name, attention in attentions.items():
        block = TransformerBlock(torch, 2, 2048, 16, attention)
        forward = block.__call__
        if args.compile:
            forward = torch.compile(forward, fullgraph=name == "kernels.attention")
        params = block.parameters()

        def step(forward: Any = forward, params: list[Any] = params) -> None:
            torch.autograd.grad(forward(x), params)

        try:
            results[name] = bench.time(step)
        except Exception as error:
            results[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
    ours, theirs = results["kernels.attention"], results["sdpa"]
    if "median_ms" in ours and "median_ms" in theirs:
        results["speedup_vs_sdpa"] = theirs["median_ms"] / ours["median_ms"]
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from torch.nn.attention import SDPBackend

    bench = Bench(torch, args)
    began = time.monotonic()
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "flops": "backward = 2.5 x forward matmul flops",
        "shapes": {},
    }
    lines = []
    for name in args.shapes:
        problem = problem_of(name)
        ours = bench.ours(problem)
        gradients = ours.pop("gradients", None)
        flash, flash_grads = bench.sdpa(problem, SDPBackend.FLASH_ATTENTION)
        cudnn, _ = bench.sdpa(problem, SDPBackend.CUDNN_ATTENTION)
        entry = {"ours": ours, "flash": flash, "cudnn": cudnn}
        if args.flex:
            entry["flex"] = bench.flex(problem)
        entry["max_diff_vs_flash"] = difference(torch, gradients, flash_grads)
        timings = [ours.get(key, {}) for key in ("best", "deterministic", "autograd_default")]
        for timing in [*timings, flash, cudnn, entry.get("flex", {})]:
            if "median_ms" in timing:
                timing["tflops"] = tflops(problem, timing)
        report["shapes"][name] = entry
        torch.cuda.empty_cache()

        def cell(timing: dict[str, Any]) -> str:
            if "median_ms" not in timing:
                return "-" if not timing else "error"
            return f"{timing['median_ms']:.3f} ({timing['tflops']:.0f})"

        cells = (ours.get("best", {}), ours.get("deterministic", {}), flash, cudnn,
                 entry.get("flex", {}))  # fmt: skip
        row = " ".join(f"{cell(timing):>15s}" for timing in cells)
        lines.append(f"{name:24s} {row}  {ours.get('best', {}).get('plan', '-')}")
    if not args.no_step:
        report["training_step"] = training_step(bench, args)
    report["wall_s"] = time.monotonic() - began
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"backward, bf16, ms (TFLOP/s at 2.5x forward flops) on {report['device']}")
    header = ("shape", "ours best", "ours determ.", "sdpa flash", "cudnn", "flex", "plan")
    print(f"{header[0]:24s} " + " ".join(f"{h:>15s}" for h in header[1:6]) + f"  {header[6]}")
    print("\n".join(lines))
    for name, entry in report["shapes"].items():
        default = entry["ours"].get("autograd_default")
        for family, row in entry["ours"].get("best_by_family", {}).items():
            print(f"{name}: best {family}: {row['plan']} {row['median_ms']:.4f} ms")
        print(f"{name}: max |ours - flash| {entry['max_diff_vs_flash']}; kernels.attention "
              f"autograd (default plan) {default}")  # fmt: skip
    if "training_step" in report:
        print(f"training step: {json.dumps(report['training_step'])}")
    print(f"wall {report['wall_s']:.1f} s; JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
