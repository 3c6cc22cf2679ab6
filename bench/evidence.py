"""Evidence on the GPU: tune each shape with the real command, then time the plan next to torch.

    python bench/evidence.py --out $OUT/evidence.json [--shapes NAME ...] [--n-trials N]
        [--budget-s 360] [--repetitions 30] [--warmup 5] [--work-dir DIR]

For each shape (default: 1x1x4096x128, 4x16x4096x128, 1x1x16384x128,
4x16x4096x128-causal, 1x32x8192x128; float32; cheapest and most telling
first, so a tight ``--budget-s`` cuts the most expensive one):

1. Tune it through the user's entry point, in a subprocess, with the project's
   default search settings (``--n-trials`` overrides only when given):
   ``python -m tuner seq_len=.. head_dim=.. batch=.. heads=.. causal=..
   registry.url=sqlite:///<work>/plans.sqlite search.storage=sqlite:///<work>/studies.sqlite
   hydra.run.dir=<work>/run-<shape> backend.cache_dir=<work>/cubins``
   (``backend=auto``: PyCUDA on a GPU). Its wall time is recorded; the first
   shape starts with an empty cubin cache, so its time includes compiling the
   space (the JSON says whether the cache was cold). Later shapes reuse the
   cache where the variants coincide (``seq_len``, batch and heads are launch
   arguments; ``causal`` is a compile-time constant).
2. Read the best plan back from the registry
   (``PlanRegistry.open(url, readonly=True).best(problem)``), rebuild it with
   ``tuner.planner.plan_kernel`` on the live device, and in this process time
   it (``PyCudaBackend.measure``: parity-checked against the reference, CUDA
   events, L2 flushed before each repetition), then torch's
   ``scaled_dot_product_attention`` with the math and the efficient backends
   (``bench/speed_check.py``'s ``time_torch``: same inputs, same loop, same
   flush), then the plan again; the slower of the plan's two medians is the
   one compared, so a lucky run flatters nothing. The plan's output is
   checked against torch's efficient output (max abs error <= 1e-3).
3. Write JSON to ``--out`` after every shape (partial results survive): GPU,
   driver, date, this command, and per shape the tuning run, the search's
   trials (from the study), the plan, both timings (median, IQR, samples),
   ratios (torch / tuned: > 1 means the tuned plan is faster), TFLOP/s
   (4*B*H*N^2*D, about half for causal), the parity error, and pass/miss for
   each target. A summary table goes to stdout.

Every step of every shape is guarded: a failure is recorded with its message
and the script goes on. ``--budget-s`` bounds the whole run: a tuning run that
would overrun it is interrupted with SIGINT (the tuner then stores its best so
far, which is measured and marked as interrupted), and shapes that no longer
fit are recorded as skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from tuner.planner.seed import FLASH_ATTENTION_OUTPUT_TOLERANCE_ABS
from tuner.problem import Problem

ROOT = Path(__file__).resolve().parent.parent

#: name -> problem, in the order they run (cheap and decisive first; 1x32x8192 costs most)
SHAPES: dict[str, Problem] = {
    "1x1x4096x128": Problem(4096, 128),
    "4x16x4096x128": Problem(4096, 128, batch=4, heads=16),
    "1x1x16384x128": Problem(16384, 128),
    "4x16x4096x128-causal": Problem(4096, 128, batch=4, heads=16, causal=True),
    "1x32x8192x128": Problem(8192, 128, heads=32),
}
_SHAPE = re.compile(r"^(\d+)x(\d+)x(\d+)x(\d+)(-causal)?$")

# The targets.
TARGET_TUNE_S = 90.0
TARGET_SPEEDUP_SHAPE = "1x1x4096x128"
TARGET_SPEEDUP = 1.5
TARGET_BATCHED_TFLOPS = 33.0
WITHIN = 1.05

#: seconds kept back from a tuning run for measuring its plan and torch afterwards
MEASURE_RESERVE_S = 25.0
#: seconds a SIGINT-ed tuner gets to store its best so far before it is killed
INTERRUPT_GRACE_S = 20.0
#: a shape is not started with less than this left for its tuning
MIN_TUNE_S = 20.0
OUTPUT_TAIL_LINES = 25


def shape_name(problem: Problem) -> str:
    name = problem.shape_text(heads_separator="kv", rows_separator="kv")
    return name + ("-causal" if problem.causal else "")


def parse_shape(name: str) -> Problem:
    """``BxHxNxD`` or ``BxHxNxD-causal`` (float32)."""
    match = _SHAPE.match(name)
    if match is None:
        raise argparse.ArgumentTypeError(f"{name!r} is not BxHxNxD or BxHxNxD-causal")
    batch, heads, seq_len, head_dim = (int(g) for g in match.groups()[:4])
    return Problem(seq_len, head_dim, batch=batch, heads=heads, causal=bool(match.group(5)))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument(
        "--shapes",
        nargs="+",
        type=parse_shape,
        default=list(SHAPES.values()),
        metavar="BxHxNxD[-causal]",
        help=f"default: {' '.join(SHAPES)}",
    )
    parser.add_argument(
        "--n-trials", type=int, default=None, help="search.n_trials (default: the project's)"
    )
    parser.add_argument(
        "--budget-s", type=float, default=360.0, help="wall-clock bound of the whole run"
    )
    parser.add_argument("--repetitions", type=int, default=30, help="timed runs, ours and torch's")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="registry, studies, cubins (default: a temp dir)",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="cubin cache (default: <work-dir>/cubins, empty at the start: a cold first run)",
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra Hydra override for every tuning run (recorded; the defaults are the evidence)",
    )
    parser.add_argument(
        "--no-measure", action="store_true", help="tune only (no in-process GPU timing)"
    )
    parser.add_argument(
        "--tuned-by",
        type=Path,
        metavar="EVIDENCE_JSON",
        help="skip tuning: time the plans an earlier run stored in --work-dir, and take each "
        "shape's tuning record from that run's JSON",
    )
    args = parser.parse_args(argv)
    if args.n_trials is not None and args.n_trials < 1:
        parser.error("--n-trials must be >= 1")
    return args


# ---------------------------------------------------------------------- 1. tuning


def sqlite_url(path: Path) -> str:
    return f"sqlite:///{path}"


def tune_command(
    problem: Problem,
    work_dir: Path,
    cache_dir: Path,
    n_trials: int | None = None,
    overrides: Sequence[str] = (),
) -> list[str]:
    """The user's command for ``problem``, writing only under ``work_dir``."""
    command = [
        sys.executable,
        "-m",
        "tuner",
        f"seq_len={problem.seq_len}",
        f"head_dim={problem.head_dim}",
        f"batch={problem.batch}",
        f"heads={problem.heads}",
        f"causal={'true' if problem.causal else 'false'}",
        f"dtype={problem.dtype}",
        f"registry.url={sqlite_url(work_dir / 'plans.sqlite')}",
        f"search.storage={sqlite_url(work_dir / 'studies.sqlite')}",
        f"hydra.run.dir={work_dir / ('run-' + shape_name(problem))}",
        f"backend.cache_dir={cache_dir}",
    ]
    if not problem.self_attention:
        command += [f"kv_heads={problem.kv_heads}", f"kv_len={problem.kv_len}"]
    if n_trials is not None:
        command.append(f"search.n_trials={n_trials}")
    return command + list(overrides)


def cache_entries(cache_dir: Path) -> int:
    """Compiled variants in the cache (one JSON report per cubin)."""
    return sum(1 for _ in cache_dir.rglob("*.json")) if cache_dir.is_dir() else 0


def run_tuning(
    command: Sequence[str], log_path: Path, timeout_s: float, cwd: Path = ROOT
) -> dict[str, Any]:
    """Run ``command``, output to ``log_path``; SIGINT at ``timeout_s``, SIGKILL after a grace.

    SIGINT is the tuner's Ctrl-C: it stops the search, stores the best so far
    and exits 130. Its own session, so the kill reaches its measurement workers too.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    interrupted = killed = False
    with log_path.open("w") as log:
        process = subprocess.Popen(
            list(command),
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=os.environ | {"PYTHONUNBUFFERED": "1"},
        )
        try:
            returncode = process.wait(timeout=max(timeout_s, 0.1))
        except subprocess.TimeoutExpired:
            interrupted = True
            process.send_signal(signal.SIGINT)
            try:
                returncode = process.wait(timeout=INTERRUPT_GRACE_S)
            except subprocess.TimeoutExpired:
                killed = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                returncode = process.wait()
    wall_s = time.monotonic() - began
    output = log_path.read_text(errors="replace")
    lines = output.splitlines()
    backend = next((line for line in lines if line.startswith("backend: ")), None)
    return {
        "command": shlex.join(command),
        "returncode": returncode,
        "wall_s": round(wall_s, 2),
        "interrupted_at_budget": interrupted,
        "killed": killed,
        "backend_line": backend,
        "on_gpu": backend is not None and backend.startswith("backend: pycuda"),
        "log": str(log_path),
        "output_tail": lines[-OUTPUT_TAIL_LINES:],
    }


# ---------------------------------------------------------------------- 2. what the tuner stored


def read_best(registry_url: str, problem: Problem) -> dict[str, Any] | None:
    """The registry's best plan of ``problem`` (any environment), as plain values."""
    from db import PlanRegistry

    with PlanRegistry.open(registry_url, readonly=True) as registry:
        stored = registry.best(problem)
    if stored is None:
        return None
    record = stored.record
    return {
        "key": _plan_key(problem, record.family, record.params),
        "family": record.family,
        "params": dict(record.params),
        "measured": record.measured,
        "served_as_measured": stored.served_as_measured,
        "median_ms": record.median_ms,
        "spread_ms": record.spread_ms,
        "tflops": record.tflops,
        "max_abs_error": record.max_abs_error,
        "predicted_ms": record.predicted_ms,
        "study_name": record.study_name,
        "trial_number": record.trial_number,
        "gpu": stored.environment.gpu_name,
    }


def _plan_key(problem: Problem, family: str, params: dict[str, int]) -> str | None:
    """The plan's name as the tuner prints it (the split count it implies for ``problem``)."""
    from tuner.device import H200
    from tuner.planner.tunable import KernelParams, plan_kernel

    try:
        params_ = KernelParams(family=family, **params)  # type: ignore[arg-type]
        return plan_kernel(problem, params_, H200).key()
    except Exception:  # a name is a convenience; the params are the record
        return None


def study_stats(storage_url: str, study_name: str) -> dict[str, Any]:
    """What the search did: counted trials, failures, and when it got within 5% of its best."""
    from collections import Counter

    import optuna
    from search_efficiency import best_so_far, trials_to_within

    from tuner.trials import TrialOutcome

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=study_name, storage=storage_url)
    trials = [TrialOutcome.from_trial(t) for t in study.get_trials(deepcopy=False)]
    counted = sorted((t for t in trials if t.counted), key=lambda t: t.number)
    timed = [t.median_ms for t in counted if t.timed and t.median_ms is not None]
    stats: dict[str, Any] = {
        "study": study_name,
        "proposals": len(trials),
        "counted": len(counted),
        "measured": sum(1 for t in counted if t.timed),
        "failed": sum(1 for t in counted if t.outcome == "failed"),
        "failures": dict(Counter(str(t.failure) for t in counted if t.outcome == "failed")),
        # Unfinished ones are the enqueued predictions the budget never reached (WAITING).
        "free": dict(
            Counter(
                t.outcome if t.outcome != "running" else t.state.lower()
                for t in trials
                if not t.counted
            )
        ),
    }
    if timed:
        best = min(timed)
        curve = best_so_far(trials, best, len(counted))
        stats["best_ms"] = best
        stats["best_found_at"] = trials_to_within(curve, 1.0)
        stats["within_5pct_of_its_best_at"] = trials_to_within(curve, WITHIN)
        stats["first_trial_over_best"] = curve[0] if math.isfinite(curve[0]) else None
    return stats


# ---------------------------------------------------------------------- 3. timing on the GPU


def measure_on_gpu(
    problem: Problem,
    best: dict[str, Any],
    cache_dir: Path,
    repetitions: int,
    warmup: int,
    result: dict[str, Any],
) -> None:
    """Fill ``result`` with the stored plan's and torch SDPA's timings, taken the same way in
    this process. Needs CUDA. Each step is guarded so that what was measured before a
    failure stays in ``result`` (its ``errors`` say what failed)."""
    from speed_check import time_torch

    from kernels.backends.pycuda_backend import PyCudaBackend
    from tuner.planner.tunable import KernelParams, plan_kernel

    errors: list[str] = result.setdefault("errors", [])

    def step(name: str, work: Callable[[], None]) -> bool:
        try:
            work()
        except Exception as error:  # recorded; the later steps still run where they can
            errors.append(f"{name}: {type(error).__name__}: {error}")
            return False
        return True

    gpu = PyCudaBackend(0, cache_dir=cache_dir, repetitions=repetitions, warmup=warmup)
    try:
        device = gpu.device_profile()
        result["environment"] = gpu.environment()
        params = KernelParams(family=best["family"], **best["params"])
        plan = plan_kernel(problem, params, device)
        result["plan"] = {
            "key": plan.key(),
            "params": plan.params.as_dict(),
            "sequence_splits": plan.sequence_splits,
            "grid": list(plan.launch.grid),
            "threads": plan.threads,
            "feasible": plan.feasible,
            "reason": plan.reason,
        }
        if not plan.feasible:
            errors.append(f"plan: {plan.key()} is infeasible here: {plan.reason}")
            return
        outputs: dict[str, Any] = {}

        def tuned(name: str) -> Callable[[], None]:
            return lambda: result.__setitem__(name, _measurement(gpu.measure(plan, problem)))

        def torch() -> None:
            timings, outputs["torch"] = time_torch(
                problem, gpu.inputs(problem), device.l2_bytes, repetitions, warmup
            )
            result["torch"] = timings

        def parity() -> None:
            if outputs.get("torch") is None:
                raise RuntimeError("no torch efficient output to compare with")
            ours = gpu.output(plan, problem).astype(np.float64)
            result["tuned_vs_torch_efficient_max_abs"] = float(
                np.abs(ours - outputs["torch"]).max()
            )

        # Ours, torch, ours again (a drifting clock shows as two different medians),
        # then the outputs side by side.
        step("tuned", tuned("tuned"))
        step("torch", torch)
        step("tuned again", tuned("tuned_repeat"))
        step("parity", parity)
    finally:
        gpu.close()
        _release_torch_memory()


def _measurement(measurement: Any) -> dict[str, Any]:
    return {
        "ok": measurement.ok,
        "failure": None if measurement.failure is None else str(measurement.failure),
        "detail": measurement.detail,
        "median_ms": measurement.median_ms,
        "spread_ms": measurement.spread_ms,
        "tflops": measurement.tflops,
        "max_abs_error_vs_reference": measurement.max_abs_error,
        "samples_ms": list(measurement.samples_ms),
    }


def _release_torch_memory() -> None:
    # torch's caching allocator would hold the math backend's N^2 scores while
    # the next shape's tuner (another process) needs the memory.
    if "torch" in sys.modules:
        with contextlib.suppress(Exception):
            sys.modules["torch"].cuda.empty_cache()


# ---------------------------------------------------------------------- assembling the figures


@dataclass
class Verdict:
    target: str
    value: float | None
    passed: bool | None  # None: could not be judged (a step failed)

    def as_json(self) -> dict[str, Any]:
        word = "error" if self.passed is None else ("pass" if self.passed else "miss")
        return {"target": self.target, "value": self.value, "result": word}


def figures(problem: Problem, gpu: dict[str, Any]) -> dict[str, Any]:
    """Ratios and throughput from ``measure_on_gpu``'s values (None where a part is missing)."""
    tuned = gpu.get("tuned") or {}
    repeat = gpu.get("tuned_repeat") or {}
    medians = [m["median_ms"] for m in (tuned, repeat) if m.get("ok") and m.get("median_ms")]
    # The slower of the two runs of the plan: the comparison must not rest on a lucky one.
    tuned_ms = max(medians) if medians else None
    torch = gpu.get("torch") or {}
    peers = {
        name: torch[name]["median_ms"]
        for name in ("math", "efficient")
        if isinstance(torch.get(name), dict) and torch[name].get("median_ms")
    }
    out: dict[str, Any] = {"tuned_ms": tuned_ms, "torch_ms": peers}
    if peers:
        best_name = min(peers, key=lambda n: peers[n])
        out["torch_best"] = {"backend": best_name, "ms": peers[best_name]}
    if tuned_ms:
        seconds = tuned_ms * 1e-3
        out["tuned_tflops"] = problem.useful_flops / seconds / 1e12
        out["ratios"] = {f"torch_{n}_over_tuned": ms / tuned_ms for n, ms in peers.items()}
        if peers:
            out["ratios"]["torch_best_over_tuned"] = min(peers.values()) / tuned_ms
    if peers:
        out["torch_best_tflops"] = problem.useful_flops / (min(peers.values()) * 1e-3) / 1e12
    return out


def judge(
    name: str,
    problem: Problem,
    tuning: dict[str, Any] | None,
    numbers: dict[str, Any],
    gpu: dict[str, Any],
    measured: bool = True,
) -> list[Verdict]:
    """Pass/miss of every target that applies to this shape (``measured=False``: the
    timing step was not run, so only the tuning target is judged)."""
    verdicts = [] if not measured else _timing_verdicts(name, problem, numbers, gpu)
    if tuning is not None and tuning.get("cache_cold") and name == TARGET_SPEEDUP_SHAPE:
        wall = tuning.get("wall_s")
        ok = tuning.get("returncode") == 0 and tuning.get("on_gpu")
        verdicts.append(
            Verdict(
                f"tuning with compilation < {TARGET_TUNE_S:g} s",
                wall,
                None if not ok or wall is None else wall < TARGET_TUNE_S,
            )
        )
    return verdicts


def _timing_verdicts(
    name: str, problem: Problem, numbers: dict[str, Any], gpu: dict[str, Any]
) -> list[Verdict]:
    verdicts = []
    ratio = numbers.get("ratios", {}).get("torch_best_over_tuned")
    verdicts.append(
        Verdict(
            "faster than torch's fastest fp32 SDPA", ratio, None if ratio is None else ratio > 1
        )
    )
    if name == TARGET_SPEEDUP_SHAPE:
        verdicts.append(
            Verdict(
                f">= {TARGET_SPEEDUP}x torch's fastest",
                ratio,
                None if ratio is None else ratio >= TARGET_SPEEDUP,
            )
        )
    if problem.batch_heads > 1:
        tflops = numbers.get("tuned_tflops")
        verdicts.append(
            Verdict(
                f">= {TARGET_BATCHED_TFLOPS:g} TFLOP/s (batched)",
                tflops,
                None if tflops is None else tflops >= TARGET_BATCHED_TFLOPS,
            )
        )
    parity = gpu.get("tuned_vs_torch_efficient_max_abs")
    reference_ok = (gpu.get("tuned") or {}).get("ok")
    verdicts.append(
        Verdict(
            f"parity with torch efficient <= {FLASH_ATTENTION_OUTPUT_TOLERANCE_ABS:g}",
            parity,
            None
            if parity is None
            else bool(parity <= FLASH_ATTENTION_OUTPUT_TOLERANCE_ABS and reference_ok),
        )
    )
    return verdicts


def overall(shapes: Sequence[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """target -> shape -> pass/miss/error, over every shape that was judged."""
    table: dict[str, dict[str, str]] = {}
    for shape in shapes:
        for verdict in shape.get("targets", []):
            table.setdefault(verdict["target"], {})[shape["shape"]] = verdict["result"]
    return table


# ---------------------------------------------------------------------- one shape, all steps


@dataclass
class Run:
    """What the whole run shares: where things go and the clock."""

    work_dir: Path
    cache_dir: Path
    n_trials: int | None
    overrides: list[str]
    repetitions: int
    warmup: int
    measure: bool
    deadline: float
    #: shape name -> the tuning record of an earlier run that stored its plan here
    tuned_by: dict[str, Any] | None = None
    log: Callable[[str], None] = print
    environment: dict[str, Any] = field(default_factory=dict)

    @property
    def registry_url(self) -> str:
        return sqlite_url(self.work_dir / "plans.sqlite")

    @property
    def storage_url(self) -> str:
        return sqlite_url(self.work_dir / "studies.sqlite")


def evidence_for(problem: Problem, run: Run) -> dict[str, Any]:
    """Tune, read back, measure and judge one shape; failures become entries in ``errors``."""
    name = shape_name(problem)
    shape: dict[str, Any] = {
        "shape": name,
        "problem": problem.label(),
        "batch": problem.batch,
        "heads": problem.heads,
        "seq_len": problem.seq_len,
        "head_dim": problem.head_dim,
        "causal": problem.causal,
        "useful_flops": problem.useful_flops,
        "errors": [],
    }
    left = run.deadline - time.monotonic()
    if left < MIN_TUNE_S + MEASURE_RESERVE_S:
        shape["skipped"] = f"budget: {left:.0f} s left when this shape's turn came"
        shape["targets"] = []
        return shape

    # 1. tune (or take the record of the earlier run that did)
    command = tune_command(problem, run.work_dir, run.cache_dir, run.n_trials, run.overrides)
    before = cache_entries(run.cache_dir)
    tuning: dict[str, Any] | None = None
    if run.tuned_by is not None:
        tuning = run.tuned_by.get(name)
        if tuning is None:
            shape["errors"].append("tuning: the earlier run has no record of this shape")
    else:
        try:
            timeout = left - MEASURE_RESERVE_S - INTERRUPT_GRACE_S
            run.log(f"== {name}: tuning (up to {timeout:.0f} s)\n   {shlex.join(command)}")
            tuning = run_tuning(command, run.work_dir / f"tune-{name}.log", timeout)
            tuning |= {
                "cache_entries_before": before,
                "cache_entries_after": cache_entries(run.cache_dir),
                "cache_cold": before == 0,
                "n_trials_setting": run.n_trials or "project default",
            }
            for line in tuning["output_tail"]:
                run.log(f"   | {line}")
            if tuning["returncode"] not in (0, 130):
                shape["errors"].append(f"tuning: exit status {tuning['returncode']}")
        except Exception as error:  # recorded, and the script goes on
            shape["errors"].append(f"tuning: {type(error).__name__}: {error}")
    shape["tuning"] = tuning

    # 2. the stored plan and the search that found it
    best = None
    try:
        best = read_best(run.registry_url, problem)
        if best is None:
            shape["errors"].append("registry: no plan stored for this shape")
    except Exception as error:
        shape["errors"].append(f"registry: {type(error).__name__}: {error}")
    shape["best_plan"] = best
    if best is not None and best.get("study_name"):
        try:
            shape["search"] = study_stats(run.storage_url, best["study_name"])
        except Exception as error:
            shape["errors"].append(f"study: {type(error).__name__}: {error}")

    # 3. timing next to torch
    gpu: dict[str, Any] = {}
    if best is not None and run.measure:
        try:
            run.log(f"== {name}: timing the tuned plan and torch SDPA in this process")
            measure_on_gpu(problem, best, run.cache_dir, run.repetitions, run.warmup, gpu)
        except Exception as error:
            shape["errors"].append(f"gpu: {type(error).__name__}: {error}")
        shape["errors"] += [f"gpu {e}" for e in gpu.pop("errors", [])]
        if "environment" in gpu:
            run.environment = gpu.pop("environment")
    shape["gpu"] = gpu
    shape["figures"] = figures(problem, gpu)
    verdicts = judge(name, problem, tuning, shape["figures"], gpu, measured=run.measure)
    shape["targets"] = [v.as_json() for v in verdicts]
    return shape


# ---------------------------------------------------------------------- report


def nvidia_smi() -> dict[str, str]:
    """GPU name and driver as nvidia-smi says (no CUDA context in this process)."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return {"error": str(error)}
    first = done.stdout.strip().splitlines()[:1]
    if done.returncode != 0 or not first:
        return {"error": (done.stderr or done.stdout).strip()[:200]}
    gpu, _, driver = first[0].partition(", ")
    return {"gpu": gpu, "driver": driver}


def header(args: argparse.Namespace, argv: Sequence[str] | None, run: Run) -> dict[str, Any]:
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "bench/evidence.py", *(argv or sys.argv[1:])]),
        "nvidia_smi": nvidia_smi(),
        "environment": {},
        "cpu_cores": os.cpu_count(),
        "settings": {
            "search": "project defaults"
            + (f", search.n_trials={args.n_trials}" if args.n_trials else ""),
            "overrides": list(args.override),
            "repetitions": args.repetitions,
            "warmup": args.warmup,
            "budget_s": args.budget_s,
            "work_dir": str(run.work_dir),
            "cache_dir": str(run.cache_dir),
            "timing": "CUDA events around the launches, L2 flushed (2x its size) before each "
            "repetition, median and IQR; the same loop for the plan and torch",
            "tuned_ms": "the slower of the plan's two medians (timed before and after torch)",
            "tflops": "useful flops 4*B*H*N^2*D (causal: pairs with k <= q) over the median",
        },
        "shapes": [],
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_summary(report: dict[str, Any]) -> str:
    rows = [
        (
            "shape",
            "tune s",
            "trials",
            "5% at",
            "best plan",
            "tuned ms",
            "math ms",
            "eff ms",
            "torch/tuned",
            "TFLOP/s",
            "max err",
        )
    ]
    for shape in report["shapes"]:
        if shape.get("skipped"):
            rows.append((shape["shape"], "skipped", "", "", shape["skipped"], *[""] * 6))
            continue
        tuning = shape.get("tuning") or {}
        numbers = shape.get("figures", {})
        torch_ms = numbers.get("torch_ms", {})
        plan = (shape.get("gpu") or {}).get("plan", {}).get("key") or (
            (shape.get("best_plan") or {}).get("key") or "-"
        )
        wall = tuning.get("wall_s")
        mark = "*" if tuning.get("interrupted_at_budget") else ""
        rows.append(
            (
                shape["shape"],
                _fmt(wall, ".1f") + mark,
                str((shape.get("search") or {}).get("counted", "-")),
                str((shape.get("search") or {}).get("within_5pct_of_its_best_at", "-")),
                plan,
                _fmt(numbers.get("tuned_ms"), ".4f"),
                _fmt(torch_ms.get("math"), ".4f"),
                _fmt(torch_ms.get("efficient"), ".4f"),
                _fmt(numbers.get("ratios", {}).get("torch_best_over_tuned"), ".2f"),
                _fmt(numbers.get("tuned_tflops"), ".1f"),
                _fmt((shape.get("gpu") or {}).get("tuned_vs_torch_efficient_max_abs"), ".1e"),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    if any((s.get("tuning") or {}).get("interrupted_at_budget") for s in report["shapes"]):
        lines.append("(* tuning interrupted at the budget; its best so far was measured)")
    for target, results in report.get("targets", {}).items():
        listed = ", ".join(f"{shape} {word.upper()}" for shape, word in results.items())
        lines.append(f"{target}: {listed}")
    for shape in report["shapes"]:
        for error in shape.get("errors", []):
            lines.append(f"error {shape['shape']}: {error}")
    return "\n".join(lines)


def write_report(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=_json_default) + "\n")


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    return str(value)


def _tuning_records(path: Path) -> dict[str, Any]:
    earlier = json.loads(path.read_text())
    return {shape["shape"]: shape.get("tuning") for shape in earlier.get("shapes", [])}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    work_dir = (args.work_dir or Path(tempfile.mkdtemp(prefix="evidence-"))).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    cache_dir = (args.cache_dir or work_dir / "cubins").resolve()
    run = Run(
        work_dir=work_dir,
        cache_dir=cache_dir,
        n_trials=args.n_trials,
        overrides=list(args.override),
        repetitions=args.repetitions,
        warmup=args.warmup,
        measure=not args.no_measure,
        deadline=started + args.budget_s,
        tuned_by=_tuning_records(args.tuned_by) if args.tuned_by else None,
    )
    report = header(args, argv, run)
    for problem in args.shapes:
        try:
            shape = evidence_for(problem, run)
        except Exception as error:  # a bug in this script must not cost the other shapes
            shape = {"shape": shape_name(problem), "errors": [f"{type(error).__name__}: {error}"]}
        report["shapes"].append(shape)
        report["environment"] = run.environment
        report["targets"] = overall(report["shapes"])
        report["seconds"] = round(time.monotonic() - started, 1)
        write_report(args.out, report)
    print(format_summary(report))
    print(f"written: {args.out} ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
