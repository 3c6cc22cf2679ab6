"""Record every feasible candidate's timing for the replay backend.

    python bench/record_replay.py --backend pycuda --shape 4096x128 --shape 1x8x2048x64 \\
        --out bench/data/h200.json

Plans the whole candidate space of each shape (the default axes of
``tuner.planner.space``) on the device, compiles it (PyCUDA), measures every
feasible plan in an isolated worker (a crash or hang is recorded as that
failure) and writes the replay file (format: ``kernels.backends.replay``) with
the environment, the date and this command. Plans the compiler rules out are
recorded as INFEASIBLE with its reason, so a replay reproduces them.
``--backend model`` writes the cost model's predictions (``"measured":
false``): fine for testing the format, never a stand-in for GPU data.
``--append`` adds (or replaces) shapes in an existing file.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from datetime import UTC, datetime
from pathlib import Path

from tqdm import tqdm

from kernels import build
from kernels.backends import BackendFactory
from kernels.backends.base import Backend, Failure, Measurement
from kernels.backends.model import ModelBackend
from kernels.backends.replay import Recording, load_recordings, recording_from, write_recordings
from tuner.config import BackendConfig
from tuner.costmodel import predict_time_ms
from tuner.device import H200, DeviceProfile
from tuner.environment import Environment
from tuner.isolation import IsolatedBackend
from tuner.planner.space import SpaceAxes, candidate_space
from tuner.planner.tunable import KernelPlan
from tuner.precompile import precompile
from tuner.problem import Problem

_SHAPE = re.compile(r"^(?:(\d+)x(\d+)x)?(\d+)x(\d+)$")


def parse_shape(text: str, causal: bool) -> Problem:
    """``NxD`` or ``BxHxNxD`` (batch x heads x seq_len x head_dim)."""
    match = _SHAPE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not NxD or BxHxNxD")
    batch, heads, seq_len, head_dim = match.groups()
    return Problem(
        seq_len=int(seq_len),
        head_dim=int(head_dim),
        batch=int(batch or 1),
        heads=int(heads or 1),
        causal=causal,
    )


def record(
    problem: Problem,
    backend: Backend,
    device: DeviceProfile,
    *,
    measured: bool,
    command: str,
    cache_dir: str | None = None,
) -> Recording:
    space = candidate_space(problem, device, SpaceAxes())
    plans: list[KernelPlan] = list(space.feasible)
    results: list[tuple[KernelPlan, Measurement, float | None]] = []
    if cache_dir is not None:
        plans, compiled_out = precompile(plans, device, cache_dir)
        for plan in compiled_out:
            failure = Measurement.failed(Failure.INFEASIBLE, plan.reason, measured=False)
            results.append((plan, failure, predict_time_ms(plan, device)))
    for plan in tqdm(plans, desc=problem.label(), unit="plan", file=sys.stderr, disable=None):
        results.append((plan, backend.measure(plan, problem), predict_time_ms(plan, device)))
    environment = Environment(**backend.environment())  # type: ignore[arg-type]
    date = datetime.now(UTC).isoformat(timespec="seconds")
    hashes = {family: build.source_hash(family) for family in build.SOURCES}
    return recording_from(problem, environment, measured, command, date, results, hashes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("pycuda", "model"), required=True)
    parser.add_argument("--shape", action="append", required=True, help="NxD or BxHxNxD")
    parser.add_argument("--causal", action="store_true", help="causal masking for every shape")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--append", action="store_true", help="keep the file's other shapes")
    parser.add_argument("--device-ordinal", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per plan")
    parser.add_argument("--repetitions", type=int, default=30)
    parser.add_argument("--cache-dir", default=BackendConfig.cache_dir)
    args = parser.parse_args(argv)
    problems = [parse_shape(shape, args.causal) for shape in args.shape]
    command = shlex.join(["python", "bench/record_replay.py", *(argv or sys.argv[1:])])

    if args.backend == "model":
        backend: Backend = ModelBackend(H200)
        device, cache_dir = H200, None
    else:
        config = BackendConfig(
            name="pycuda", repetitions=args.repetitions, cache_dir=args.cache_dir
        )
        factory = BackendFactory("pycuda", config, args.device_ordinal)
        isolated = IsolatedBackend(factory, args.timeout, name="pycuda")
        device = isolated.device_profile() or H200
        backend, cache_dir = isolated, args.cache_dir
    try:
        recordings = [
            record(
                problem,
                backend,
                device,
                measured=args.backend == "pycuda",
                command=command,
                cache_dir=cache_dir,
            )
            for problem in problems
        ]
    finally:
        backend.close()

    if args.append and args.out.exists():
        fresh = {r.problem for r in recordings}
        kept = [r for r in load_recordings(args.out) if r.problem not in fresh]
        recordings = kept + recordings
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_recordings(args.out, recordings)
    for recording in recordings:
        timed = [e for e in recording.entries.values() if e.median_ms is not None]
        best = min(timed, key=lambda e: e.median_ms or 0.0) if timed else None
        print(
            f"{recording.problem.label()}: {len(recording.entries)} plans, {len(timed)} timed"
            + (f", best {best.key} {best.median_ms:.4f} ms" if best else "")
        )
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
