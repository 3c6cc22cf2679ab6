"""Where a default tuning run spends its wall time, measured without a GPU.

    python bench/tuning_time.py [--runs 3] [--tree DIR] [--compile] \\
        [--out bench/results/tuning_time.json]

Two measurements on this machine:

* **The run.** The user's command for the shape of ``--recording`` (by default
  4x16x4096x128 bf16) with ``backend=replay``, in a fresh directory each time
  (registry, study, run directory), ``--runs`` times: the wall time seen from
  outside and the ``time:`` line the run prints (start-up, backend start,
  planning, study, search, report; ``tuner.phases``). ``--tree DIR`` runs the
  tuner of another checkout (an export of an older commit) the same way, for a
  before/after; its output may have no ``time:`` line.
* **The compile step** (``--compile``; nvcc, several minutes on 2 cores): from
  an empty cubin cache, every variant of the shape's space compiled up front
  (``tuner.precompile.precompile``, what a PyCUDA run did before the search),
  against the default search replayed on the recording with
  ``tuner.precompile.CompileAhead`` (what a PyCUDA run does now): the variants
  each compiles and the wall time, with ``--jobs`` nvcc processes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RECORDING = ROOT / "bench" / "data" / "h200_mma_f16_wgmma_f16_4x16x4096x128_bf16.json"
SHAPE = ("seq_len=4096", "head_dim=128", "batch=4", "heads=16")
_PHASE = re.compile(r"([\d.]+) s ([a-z -]+?)(?: \(([^()]*)\))?(?:, |$)")


def parse_time_line(output: str) -> dict[str, Any] | None:
    """The phases of a run's ``time:`` line: {"total": s, "phases": {name: s}, "notes": ...}."""
    lines = [line for line in output.splitlines() if line.startswith("time: ")]
    if not lines:
        return None
    head, _, body = lines[-1].partition(": ")[2].partition(": ")
    phases, notes = {}, {}
    for seconds, name, note in _PHASE.findall(body):
        phases[name] = float(seconds)
        if note:
            notes[name] = note
    return {"total": float(head.split()[0]), "phases": phases, "notes": notes}


def one_run(tree: Path, recording: Path, where: Path) -> dict[str, Any]:
    command = [
        sys.executable,
        "-m",
        "tuner",
        *SHAPE,
        "backend=replay",
        f"backend.replay_path={recording}",
        f"registry.url=sqlite:///{where / 'plans.sqlite'}",
        f"search.storage=sqlite:///{where / 'studies.sqlite'}",
        f"hydra.run.dir={where / 'run'}",
    ]
    env = os.environ | {"PYTHONPATH": str(tree)}
    began = time.monotonic()
    done = subprocess.run(
        command, cwd=tree, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    wall = time.monotonic() - began
    stop = [line for line in done.stdout.splitlines() if line.startswith("stopped")]
    stored = [line for line in done.stdout.splitlines() if line.startswith("registry: ")]
    return {
        "returncode": done.returncode,
        "wall_s": round(wall, 3),
        "time_line": parse_time_line(done.stdout),
        "stopped": stop[-1] if stop else "",
        "stored": stored[-1].split()[1] if stored else "",
    }


def runs(tree: Path, recording: Path, count: int) -> list[dict[str, Any]]:
    results = []
    for _ in range(count):
        with tempfile.TemporaryDirectory(prefix="tuning-time-") as where:
            results.append(one_run(tree, recording, Path(where)))
    return results


def compile_step(recording: Path, jobs: int) -> dict[str, Any]:
    """Full precompile against compile-ahead, each from an empty cubin cache."""
    from kernels import build
    from kernels.backends.replay import ReplayBackend, load_recordings
    from tuner.config import DeviceConfig, SearchConfig, device_profile_from, space_axes_from
    from tuner.costmodel import predict
    from tuner.planner.space import candidate_space
    from tuner.precompile import CompileAhead, precompile
    from tuner.recorded_space import within_recording
    from tuner.search import run_search
    from tuner.study_space import StudySpace

    loaded = load_recordings(recording)[0]
    device = device_profile_from(DeviceConfig())
    axes = space_axes_from(SearchConfig(families=list(loaded.source_hashes)))
    space = candidate_space(loaded.problem, device, axes)
    feasible, _ = within_recording(list(space.feasible), loaded)  # what a replay answers
    variants = {build.KernelSpec.from_plan(p).key for p in space.feasible}
    with tempfile.TemporaryDirectory(prefix="cubins-") as cache:
        began = time.monotonic()
        accepted, rejected = precompile(list(space.feasible), device, cache, jobs)
        full_s = time.monotonic() - began
    predictions = {p.key(): predict(p, device) for p in feasible}
    study_space = StudySpace(loaded.problem, device, feasible, (), encoding="candidate")
    with tempfile.TemporaryDirectory(prefix="cubins-") as cache:
        ahead = CompileAhead(device, cache, jobs)
        began = time.monotonic()
        try:
            result = run_search(
                study_space,
                ReplayBackend(recording),
                SearchConfig(),
                storage=f"sqlite:///{Path(cache) / 'studies.sqlite'}",
                study_name="compile-ahead",
                predictions=predictions,
                compile_ahead=ahead,
            )
        finally:
            ahead.close()
        search_s = time.monotonic() - began
        asked, _ = ahead.variants
    return {
        "jobs": jobs,
        "variants_in_space": len(variants),
        "precompile": {
            "seconds": round(full_s, 1),
            "variants": len(variants),
            "accepted_plans": len(accepted),
            "ruled_out_plans": len(rejected),
        },
        "compile_ahead": {
            "search_seconds": round(search_s, 1),
            "variants": asked,
            "trials": result.counted,
            "stopped": result.stop_reason,
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose tuner runs")
    parser.add_argument("--recording", type=Path, default=DEFAULT_RECORDING)
    parser.add_argument("--compile", action="store_true", help="also time the compile step")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tuning_time.json")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "bench/tuning_time.py", *(argv or sys.argv[1:])]),
        "machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg()},
        "tree": str(args.tree),
        "recording": str(args.recording),
        "runs": runs(args.tree.resolve(), args.recording.resolve(), args.runs),
    }
    if args.compile:
        report["compile_step"] = compile_step(args.recording.resolve(), args.jobs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for run in report["runs"]:
        line = run["time_line"]
        phases = ", ".join(f"{n} {s}" for n, s in line["phases"].items()) if line else "-"
        print(f"wall {run['wall_s']:.2f} s (rc {run['returncode']}); {phases}; {run['stopped']}")
    if args.compile:
        step = report["compile_step"]
        print(
            f"precompile: {step['precompile']['variants']} variants in "
            f"{step['precompile']['seconds']} s; compile-ahead: {step['compile_ahead']['variants']}"
            f" variants during a {step['compile_ahead']['trials']}-trial search of "
            f"{step['compile_ahead']['search_seconds']} s ({step['jobs']} nvcc jobs)"
        )
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
