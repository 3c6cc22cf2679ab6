"""The model command on the GPU: ``python -m tuner model=NAME`` timed, then every problem's
stored plan through ``kernels.attention`` next to torch's best SDPA backend, one process.

    python bench/model_bench.py --precompile DIR                      # here: nvcc, no GPU
    python bench/model_bench.py --out $OUT/model_bench.json --work-dir /tmp/model \\
        --cubins DIR                                                   # on the H200

The tuning run is the user's command at default settings (its registry, studies and Hydra
run directory under ``--work-dir``; SIGINT at ``--timeout-s`` stores each problem's best so
far, as Ctrl-C does). Its wall time is reported, with the run's own phase line; with
``--warm-rerun`` the command runs again from a new registry and studies on the cubin cache
the first run filled (the warm-cache time; without ``--cubins`` the first is the cold one).
``--cubins`` seeds the run's cubin cache with what ``--precompile`` built here: the cost
model's ``--candidates`` best plans of each problem (what the search measures first);
the rest compile on the device, ahead of the search, as a user's cold cache does.

Then, per problem of the model (the tuner's own expansion into problems), the registry's
plan is timed through ``kernels.attention(q, k, v, causal=True, registry=...)`` next to
torch SDPA's cuDNN, flash and efficient backends (``enable_gqa``; a decode step's single
query row attends to every cached key, which SDPA's top-left ``is_causal`` would not
express, so its mask is none), on the same inputs, CUDA events, L2 flushed before each
repetition. Ratios > 1: ours is faster than torch's best backend for that problem.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evidence import run_tuning, sqlite_url  # noqa: E402
from speed_check import time_torch_call  # noqa: E402

from tuner.problem import Problem  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def model_problems(model: str) -> list[Problem]:
    """The distinct problems ``python -m tuner model=<model>`` tunes (its expansion)."""
    from hydra import compose, initialize_config_dir

    from tuner.config import typed_config
    from tuner.llm.validation import validate_model

    with initialize_config_dir(config_dir=str(ROOT / "tuner" / "conf"), version_base="1.3"):
        config = typed_config(compose(config_name="config", overrides=[f"model={model}"]))
    return [p.problem for p in validate_model(config).problems]


def precompile(cache_dir: Path, model: str, count: int) -> None:
    from kernels import build
    from tuner.costmodel import predict_time_ms
    from tuner.device import H200
    from tuner.planner.space import candidate_space

    plans = []
    for problem in model_problems(model):
        feasible = candidate_space(problem, H200).feasible
        plans += sorted(feasible, key=lambda plan: predict_time_ms(plan, H200))[:count]
    results = build.compile_many(plans, cache_dir, arch=H200.arch)
    failed = [key for key, r in results.items() if isinstance(r, build.CompileFailure)]
    print(f"{len(results)} variants compiled into {cache_dir} ({len(failed)} failed)")


def tune(model: str, work: Path, cache_dir: Path, timeout_s: float) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "tuner", f"model={model}",
        f"registry.url={sqlite_url(work / 'plans.sqlite')}",
        f"search.storage={sqlite_url(work / 'studies.sqlite')}",
        f"hydra.run.dir={work / 'run'}", f"backend.cache_dir={cache_dir}",
    ]  # fmt: skip
    tuning = run_tuning(command, work / "tune.log", timeout_s)
    return {"command": shlex.join(command), "tuning": tuning,
            "registry": sqlite_url(work / "plans.sqlite")}


def time_problem(torch: Any, problem: Problem, registry: str, flush: Any,
                 repetitions: int) -> dict[str, Any]:
    import torch.nn.functional as functional
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import kernels
    from kernels.deploy import default_instance

    generator = torch.Generator(device="cuda").manual_seed(0)
    dtype = torch.bfloat16 if problem.dtype == "bfloat16" else torch.float16
    b, h, kvh, n, m, d = (problem.batch, problem.heads, problem.kv_heads, problem.seq_len,
                          problem.kv_len, problem.head_dim)
    q = torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=generator)
    k = torch.randn(b, kvh, m, d, device="cuda", dtype=dtype, generator=generator)
    v = torch.randn(b, kvh, m, d, device="cuda", dtype=dtype, generator=generator)

    def timed(run: Any) -> dict[str, Any]:
        return time_torch_call(torch, run, flush, repetitions)

    def ours() -> Any:
        return kernels.attention(q, k, v, problem.causal, registry)

    result: dict[str, Any] = {"problem": problem.label()}
    with torch.no_grad():
        mine = ours()
        chosen = default_instance(registry).plan_for(problem)
        result["plan"], result["plan_origin"] = chosen.plan.key(), chosen.origin
        result["ours"] = timed(ours)
        # SDPA's is_causal is top-left: a decode row would see one key; it sees them all
        causal = problem.causal and n == m
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("flash", SDPBackend.FLASH_ATTENTION),
                              ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
            def sdpa() -> Any:
                return functional.scaled_dot_product_attention(
                    q, k, v, is_causal=causal, enable_gqa=kvh != h)
            try:
                with sdpa_kernel(backend):
                    theirs = sdpa()
                    result[name] = timed(sdpa) | {
                        "max_abs_difference": (theirs.float() - mine.float()).abs().max().item()}
            except RuntimeError as error:
                result[name] = {"error": str(error).splitlines()[0]}
    peers = {k: v["median_ms"] for k, v in result.items() if isinstance(v, dict)
             and "median_ms" in v and k != "ours"}
    if peers:
        best = min(peers, key=peers.get)
        result["torch_best"] = best
        result["torch_best_over_ours"] = peers[best] / result["ours"]["median_ms"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--work-dir", type=Path)
    parser.add_argument("--cubins", type=Path, help="a precompiled cubin cache to start from")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--repetitions", type=int, default=20)
    parser.add_argument("--candidates", type=int, default=8)
    parser.add_argument("--precompile", type=Path, metavar="DIR", help="compile only (no GPU)")
    parser.add_argument("--warm-rerun", action="store_true",
                        help="tune again from scratch on the cubin cache the first run left")
    args = parser.parse_args(argv)
    if args.precompile is not None:
        precompile(args.precompile, args.model, args.candidates)
        return 0
    if args.out is None or args.work_dir is None:
        parser.error("give --out and --work-dir (a run) or --precompile DIR")
    cache_dir = args.work_dir / "cubins"
    if args.cubins is not None and args.cubins.is_dir():
        import shutil

        shutil.copytree(args.cubins, cache_dir, dirs_exist_ok=True)
    report: dict[str, Any] = {
        "command": "python " + shlex.join(["bench/model_bench.py", *(argv or sys.argv[1:])]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "model": args.model,
    }
    began = time.monotonic()
    report["tuned"] = tune(args.model, args.work_dir, cache_dir, args.timeout_s)
    report["tuning_wall_s"] = round(time.monotonic() - began, 1)
    args.out.write_text(json.dumps(report, indent=1, default=str))
    print("\n".join(report["tuned"]["tuning"].get("output_tail", [])[-16:]), flush=True)
    if args.warm_rerun:
        # the same command from scratch (new registry and studies) on the cubins the first
        # run left: the warm-cache figure
        began = time.monotonic()
        report["warm"] = tune(args.model, args.work_dir / "warm", cache_dir, args.timeout_s)
        report["warm_tuning_wall_s"] = round(time.monotonic() - began, 1)
        args.out.write_text(json.dumps(report, indent=1, default=str))
        print("\n".join(report["warm"]["tuning"].get("output_tail", [])[-3:]), flush=True)

    import torch

    flush_buffer = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    report["problems"] = []
    for problem in model_problems(args.model):
        entry = time_problem(torch, problem, report["tuned"]["registry"], flush_buffer.zero_,
                             args.repetitions)
        report["problems"].append(entry)
        args.out.write_text(json.dumps(report, indent=1, default=str))
        print(f"{entry['problem']:24s} {entry['plan']:34s} ours {entry['ours']['median_ms']:.4f} "
              f"ms, torch best ({entry.get('torch_best')}) / ours "
              f"{entry.get('torch_best_over_ours', 0):.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
