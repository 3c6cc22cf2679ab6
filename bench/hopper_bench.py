"""The Hopper family's prefill forward at every head_dim, next to cuDNN and FlashAttention-2.

    python bench/hopper_bench.py --precompile DIR                  # here: nvcc, no GPU
    python bench/hopper_bench.py --out $OUT/hopper_bench.json --cache-dir DIR   # on the H200

Per shape (issue 28's evidence shapes: bf16 and fp16, causal and not, head_dim 64/96/128/192/
256, an odd length, GQA, the long 1x32x8192x128 and head_dim 256 at 16K), all in this
process, on the same inputs, CUDA events around each call, L2 flushed before each repetition
(``kernels.timing``):

* ours: no tuning run (the device minutes go to timing): the cost model's ``--candidates``
  best ``wgmma_f16`` plans (with their ``--twins``: each also with ``persistent`` flipped, by
  default) and ``--mma-candidates`` best ``mma_f16`` plans, each timed
  through its deploy handle (``DeviceRunner.handle_of``, what ``kernels.attention``
  launches), the fastest reported with the others: a search over the model's short list,
  as the tuner's first trials are. The best is timed again after the peers (the ratio uses
  the faster of the two; both are kept);
* torch SDPA's cuDNN and flash (FlashAttention-2) backends (``sdpa_kernel``), GQA through
  ``enable_gqa``.

``--seed SHAPE:KEY`` adds a named plan of a shape (and its twins): the best of an earlier
sweep, say, timed again with a new tunable flipped.

``--sweep``: each shape's candidates also include the key-tile sweep (``sweep_plans``):
FlashAttention-3's structure (overlap, ping-pong, staged store; persistent and not; the
overlap alone, with and without the staged store) at every key tile the planner allows, P
packed early or late, at the deepest ring (of 2-4 stages) that fits. A candidate the
compiler rules out (spills, serialised wgmma: what the tuner's precompile drops) is listed
with its reason and not timed.

The best plan's output is compared with cuDNN's (max |difference|; the GPU suite holds the
parity rule). TFLOP/s count the visible pairs (4 * pairs * head_dim). ``--plan KEY`` times
only that plan of the one shape given (what ``ncu`` profiles); ``--precompile`` compiles
the candidates for the H200's profile into a cubin cache to carry.
"""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from speed_check import time_torch_call  # noqa: E402

from tuner.device import H200, DeviceProfile  # noqa: E402
from tuner.planner.plan import KernelPlan  # noqa: E402
from tuner.problem import Problem  # noqa: E402


def shape(batch: int, heads: int, n: int, d: int, causal: bool = False, dtype: str = "bfloat16",
          kv_heads: int | None = None) -> Problem:
    return Problem(n, d, batch=batch, heads=heads, kv_heads=kv_heads or heads, causal=causal,
                   dtype=dtype)


SHAPES: dict[str, Problem] = {
    "4x16x4096x64": shape(4, 16, 4096, 64),
    "4x16x4096x64-causal": shape(4, 16, 4096, 64, causal=True),
    "4x16x4096x96": shape(4, 16, 4096, 96),
    "4x16x4096x96-causal": shape(4, 16, 4096, 96, causal=True),
    "4x16x4096x128": shape(4, 16, 4096, 128),
    "4x16x4096x128-causal": shape(4, 16, 4096, 128, causal=True),
    "4x16x4096x128-fp16": shape(4, 16, 4096, 128, dtype="float16"),
    "1x32x8192x128": shape(1, 32, 8192, 128),
    "2x16x3001x128-causal": shape(2, 16, 3001, 128, causal=True),
    "2x32/8x4096x128-causal": shape(2, 32, 4096, 128, causal=True, kv_heads=8),
    "4x16x4096x192": shape(4, 16, 4096, 192),
    "4x16x4096x256": shape(4, 16, 4096, 256),
    "1x16x16384x256": shape(1, 16, 16384, 256),
}


@functools.cache
def feasible_plans(problem: Problem, device: DeviceProfile) -> tuple[KernelPlan, ...]:
    """The planner's feasible plans of ``problem`` (planned once a shape: about 1.3 s at
    head_dim 128, and the candidates, the seeds and the twins all draw on them)."""
    from tuner.planner.space import candidate_space

    return candidate_space(problem, device).feasible


def candidates(problem: Problem, device: DeviceProfile, wgmma: int, mma: int,
               twins: tuple[str, ...] = ()) -> list[KernelPlan]:
    """The cost model's ``wgmma`` best Hopper plans and ``mma`` best mma.sync plans; with
    ``twins`` (wgmma_f16 tunables), each Hopper plan's feasible twins with one of those
    tunables at its other values (a mechanism's effect, measured against its own twin)."""
    from tuner.costmodel import predict_time_ms

    feasible = feasible_plans(problem, device)
    chosen: list[KernelPlan] = []
    for family, count in (("wgmma_f16", wgmma), ("mma_f16", mma)):
        ranked = sorted((p for p in feasible if p.family == family),
                        key=lambda plan: predict_time_ms(plan, device))
        chosen += ranked[:count]
    return with_twins(chosen, problem, device, twins)


#: the sweep's structures: FlashAttention-3's (overlap, ping-pong, staged store), persistent
#: and not, and the overlap without the ping-pong (with and without the staged store: at
#: head_dim 192 and 256 the ping-pong's registers spill the wider tiles), each with two
#: consumers and with three (192-row blocks, FlashAttention-3's at head_dim 64)
SWEEP_BASES = tuple(
    {"consumers": consumers, **structure}
    for consumers in (2, 3)
    for structure in (
        {"overlap": 1, "pingpong": 1, "staged_store": 1},
        {"overlap": 1, "pingpong": 1, "staged_store": 1, "persistent": 1},
        {"overlap": 1, "staged_store": 1},
        {"overlap": 1},
    )
)


def sweep_plans(problem: Problem, device: DeviceProfile) -> list[KernelPlan]:
    """Every key tile of the planner's, early and late P packing, on each SWEEP_BASES
    structure at the deepest feasible ring."""
    from tuner.planner.families import family_named
    from tuner.planner.families.wgmma_f16 import BLOCK_NS
    from tuner.planner.params import KernelParams

    hopper = family_named("wgmma_f16")
    found = []
    for base in SWEEP_BASES:
        for block_n in BLOCK_NS:
            for late_pack in (0, 1):
                for stages in (4, 3, 2):
                    params = KernelParams("wgmma_f16", **base, block_n=block_n, stages=stages,
                                          late_pack=late_pack)
                    plan = hopper.plan(problem, params, device)
                    if plan.feasible:
                        found.append(plan)
                        break
    return found


def seeded_plans(problem: Problem, name: str, device: DeviceProfile, seeds: list[str],
                 twins: tuple[str, ...]) -> list[KernelPlan]:
    """The plans ``--seed NAME:KEY`` names for this shape, each with its ``twins`` (one
    tunable flipped to each of its other values, where feasible)."""
    keys = [seed.partition(":")[2] for seed in seeds if seed.partition(":")[0] == name]
    if not keys:
        return []
    feasible = {plan.key(): plan for plan in feasible_plans(problem, device)}
    missing = [key for key in keys if key not in feasible]
    if missing:
        raise SystemExit(f"--seed: {name} has no feasible plan {', '.join(missing)}")
    return with_twins([feasible[key] for key in keys], problem, device, twins)


def with_twins(plans: list[KernelPlan], problem: Problem, device: DeviceProfile,
               twins: tuple[str, ...]) -> list[KernelPlan]:
    """``plans`` and each Hopper plan's feasible twins with one of the ``twins`` tunables at
    each of its other values, without repeats."""
    from tuner.planner.families import family_named
    from tuner.planner.params import KernelParams

    hopper = family_named("wgmma_f16")
    chosen = list(plans)
    keys = {plan.key() for plan in chosen}
    for plan in [p for p in plans if p.family == "wgmma_f16"]:
        for tunable in (t for t in hopper.tunables if t.name in twins):
            for value in tunable.values:
                params = KernelParams("wgmma_f16", **(plan.params.tunables | {tunable.name: value}))
                twin = hopper.plan(problem, params, device)
                if twin.feasible and twin.key() not in keys:
                    keys.add(twin.key())
                    chosen.append(twin)
    return chosen


def shape_candidates(problem: Problem, device: DeviceProfile, args: argparse.Namespace,
                     name: str = "") -> list[KernelPlan]:
    plans = candidates(problem, device, args.candidates, args.mma_candidates, tuple(args.twins))
    keys = {plan.key() for plan in plans}
    plans += [plan for plan in seeded_plans(problem, name, device, args.seed, tuple(args.twins))
              if plan.key() not in keys]
    if args.sweep:
        keys = {plan.key() for plan in plans}
        plans += [plan for plan in sweep_plans(problem, device) if plan.key() not in keys]
    return plans


def compiler_verdict(plan: KernelPlan, cache_dir: Path, device: DeviceProfile) -> str:
    """Why the compiler rules ``plan`` out ("" when it does not), as the tuner's precompile
    judges it."""
    from kernels import build

    result = build.compile_kernel(plan, cache_dir, arch=device.arch)
    if isinstance(result, build.CompileFailure):
        return result.reason
    return plan.with_resources(result.primary_resources, device).reason


def precompile(cache_dir: Path, names: list[str], args: argparse.Namespace) -> None:
    from kernels import build

    plans = [p for name in names for p in shape_candidates(SHAPES[name], H200, args, name)]
    results = build.compile_many(plans, cache_dir, arch=H200.arch)
    failed = {key: r.reason for key, r in results.items() if isinstance(r, build.CompileFailure)}
    print(f"{len(results)} variants compiled into {cache_dir}, {len(failed)} failed")
    for key, reason in failed.items():
        print(f"  {key}: {reason}")


class Bench:
    def __init__(self, torch: Any, args: argparse.Namespace) -> None:
        from kernels.backends.pycuda_attention import DeviceRunner

        self.torch, self.args = torch, args
        self.runner = DeviceRunner(0, None, False, args.cache_dir)
        self.flush_buffer = torch.empty(2 * self.runner.profile.l2_bytes, dtype=torch.uint8,
                                        device="cuda")

    def time(self, run: Any) -> dict[str, Any]:
        return time_torch_call(self.torch, run, self.flush_buffer.zero_, self.args.repetitions,
                               self.args.warmup)

    def inputs(self, problem: Problem) -> tuple[Any, Any, Any]:
        torch = self.torch
        dtype = torch.bfloat16 if problem.dtype == "bfloat16" else torch.float16
        generator = torch.Generator(device="cuda").manual_seed(0)
        q_shape = (problem.batch, problem.heads, problem.seq_len, problem.head_dim)
        kv_shape = (problem.batch, problem.kv_heads, problem.kv_len, problem.head_dim)
        return tuple(torch.randn(s, device="cuda", dtype=dtype, generator=generator)
                     for s in (q_shape, kv_shape, kv_shape))

    def ours(self, plan: KernelPlan, q: Any, k: Any, v: Any) -> tuple[Any, Any]:
        """A runnable of ``plan`` on (q, k, v) and its output tensor."""
        from kernels import build
        from kernels.plan_choice import ChosenPlan

        build.compile_many([plan], self.runner.backend.cache_dir, arch=self.runner.profile.arch)
        handle = self.runner.handle_of(ChosenPlan(plan, "candidate"))
        out = self.torch.empty_like(q)
        pointers = (q.data_ptr(), k.data_ptr(), v.data_ptr())

        def run() -> Any:
            return handle.run_torch(q, *pointers, out, self.torch)

        return run, out

    def shape(self, problem: Problem, only: str | None, name: str = "") -> dict[str, Any]:
        torch = self.torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q, k, v = self.inputs(problem)
        plans = shape_candidates(problem, self.runner.profile, self.args, name)
        if only is not None:
            plans = [p for p in plans if p.key() == only]
            if not plans:
                raise SystemExit(f"{only} is not a candidate of {problem.label()}")
        rows, runs = [], {}
        for plan in plans:
            row: dict[str, Any] = {"plan": plan.key()}
            verdict = compiler_verdict(plan, self.runner.backend.cache_dir, self.runner.profile)
            if verdict:
                row["rejected"] = verdict
                rows.append(row)
                print(f"  {plan.key()}: rejected: {verdict}", flush=True)
                continue
            try:
                runs[plan.key()] = self.ours(plan, q, k, v)
                row |= self.time(runs[plan.key()][0])
            except Exception as error:  # a plan that cannot run is a result, not the end
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
            rows.append(row)
            print(f"  {plan.key()}: {row.get('median_ms', row.get('error'))}", flush=True)
        result: dict[str, Any] = {"problem": problem.label(), "candidates": rows}
        timed = [row for row in rows if "median_ms" in row]
        if not timed or only is not None:
            return result
        best = min(timed, key=lambda row: row["median_ms"])
        by_family = {}
        for row in timed:
            family = row["plan"].split("/")[0]
            if family not in by_family or row["median_ms"] < by_family[family]["median_ms"]:
                by_family[family] = row
        result["best"], result["best_of_family"] = best, by_family
        run, out = runs[best["plan"]]
        gqa = problem.group > 1
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("flash", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    def sdpa(backend: Any = backend) -> Any:
                        return torch.nn.functional.scaled_dot_product_attention(
                            q, k, v, is_causal=problem.causal, enable_gqa=gqa)
                    reference = sdpa()
                    result[name] = self.time(sdpa)
                    if name == "cudnn":
                        run()
                        torch.cuda.synchronize()
                        difference = (out.float() - reference.float()).abs().max().item()
                        result["max_abs_difference_to_cudnn"] = difference
            except RuntimeError as error:
                result[name] = {"error": str(error).splitlines()[0]}
        result["best_again"] = self.time(run)
        ours_ms = min(best["median_ms"], result["best_again"]["median_ms"])
        flops = 4 * problem.attended_pairs * problem.batch_heads * problem.head_dim
        result["ours_tflops"] = flops / (ours_ms * 1e-3) / 1e12
        result["ratios"] = {
            f"{name}_over_ours": result[name]["median_ms"] / ours_ms
            for name in ("cudnn", "flash") if "median_ms" in result[name]
        }
        if "median_ms" in result["cudnn"]:
            result["cudnn_tflops"] = flops / (result["cudnn"]["median_ms"] * 1e-3) / 1e12
        if {"wgmma_f16", "mma_f16"} <= set(by_family):
            result["mma_over_wgmma"] = (by_family["mma_f16"]["median_ms"]
                                        / by_family["wgmma_f16"]["median_ms"])
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="the JSON results file")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--candidates", type=int, default=12, help="wgmma_f16 plans a shape")
    parser.add_argument("--mma-candidates", type=int, default=1, help="mma_f16 plans a shape")
    parser.add_argument("--twins", nargs="*", default=["persistent"],
                        help="wgmma_f16 tunables each Hopper candidate is also timed flipped")
    parser.add_argument("--repetitions", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--cache-dir", type=Path, default=None, help="the cubin cache")
    parser.add_argument("--plan", help="time only this plan key (one shape: for ncu)")
    parser.add_argument("--precompile", type=Path, metavar="DIR", help="compile only (no GPU)")
    parser.add_argument("--seed", action="append", default=[], metavar="SHAPE:KEY",
                        help="also time this plan of the shape, with its --twins")
    parser.add_argument("--sweep", action="store_true",
                        help="also time the key-tile sweep (sweep_plans) of each shape")
    args = parser.parse_args(argv)
    if args.precompile is not None:
        precompile(args.precompile, args.shapes, args)
        return 0
    if args.out is None:
        parser.error("give --out (a run) or --precompile DIR")
    if args.plan and len(args.shapes) != 1:
        parser.error("--plan times one plan of one shape: give one --shapes")
    if args.cache_dir is None:
        from kernels.backends.pycuda_backend import DEFAULT_CACHE_DIR

        args.cache_dir = Path(DEFAULT_CACHE_DIR)
    import torch

    bench = Bench(torch, args)
    report: dict[str, Any] = {
        "command": "python " + shlex.join(["bench/hopper_bench.py", *(argv or sys.argv[1:])]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "shapes": {},
    }
    for name in args.shapes:
        began = time.monotonic()
        print(f"{name}:", flush=True)
        entry = bench.shape(SHAPES[name], args.plan, name)
        entry["wall_s"] = round(time.monotonic() - began, 1)
        report["shapes"][name] = entry
        args.out.write_text(json.dumps(report, indent=1, default=str))
        torch.cuda.empty_cache()
        if "best" in entry:
            print(f"{name}: ours {entry['ours_tflops']:.0f} TF ({entry['best']['plan']}), "
                  + " ".join(f"{k} {v:.3f}x" for k, v in entry["ratios"].items())
                  + (f" mma/wgmma {entry['mma_over_wgmma']:.3f}x" if "mma_over_wgmma" in entry
                     else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
