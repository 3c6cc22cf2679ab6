"""Record every feasible candidate's timing for the replay backend.

    python bench/record_replay.py --backend pycuda --repetitions 10 \\
        --shape 4x16x4096x128:bf16 --shape 2x32/8x4096x128c:bf16 \\
        --shape 16x32/8x1:8192x128:bf16 --shape 1x16x1000x128:tf32 \\
        --out-dir bench/data

A shape is ``[BxH[/KVH]x]N[:KVLEN]xD[c][:DTYPE]`` (the labels' syntax, as in
``bench/evidence_gqa.py``): batch x query heads, ``/KVH`` KV heads
(grouped-query attention), query rows ``N`` and ``:KVLEN`` keys (decode
against a KV cache), head_dim ``D``, ``c`` for causal, and the element type:
``bf16``, ``fp16``, ``fp32`` (float32, the accurate ``tf32x3`` precision) or
``tf32`` (float32 that allows one-pass TF32); full names (``bfloat16``,
``float16``, ``float32``, ``tf32x3``) are read too. Without a dtype a shape
is float32, and ``NxD`` alone is one head of batch 1, as before.

For each shape it plans the whole candidate space of the recorded families
(``--family``, repeatable; default: every family that takes the shape's dtype)
on the families' own axes (``tuner.planner.space``), compiles it (PyCUDA:
``tuner.precompile``, one nvcc per CPU; a warm ``--cache-dir`` compiles
nothing), measures every feasible plan in an isolated worker (a crash or hang
is recorded as that failure) and writes the recording (format:
``kernels.backends.replay``) with the environment, the date and this
command. Plans the compiler rules out are recorded as INFEASIBLE with its
reason, so a replay reproduces them; plans the planner rules out are not
listed (the replay backend and ``bench/search_efficiency.py`` plan them
again). The recording's ``source_hashes`` name exactly the families it holds,
which is how its readers know what was recorded.

Recordings are written as each shape finishes, so an interrupted run keeps
the shapes done: ``--out FILE`` rewrites one file holding every recording so
far (``--append`` keeps the file's other problems), ``--out-dir DIR`` writes
one file per shape named by GPU, families, shape and dtype
(``h200_mma_f16_2x32-8x4096x128c_bf16.json``). ``--split FILE --out-dir DIR``
measures nothing: it files each recording of FILE under its name in DIR (a
device call returns few files, so it writes one and this splits it here).
``--backend model`` writes the cost model's predictions (``"measured":
false``): fine for testing the format, never a stand-in for GPU data.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import time
from collections import Counter
from collections.abc import Sequence
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
from tuner.errors import TunerError
from tuner.isolation import IsolatedBackend
from tuner.planner.families import families_for, family_names
from tuner.planner.space import SpaceAxes, candidate_space
from tuner.planner.tunable import KernelPlan
from tuner.precompile import precompile
from tuner.problem import Problem

_SHAPE = re.compile(
    r"^(?:(?P<batch>\d+)x(?P<heads>\d+)(?:/(?P<kv_heads>\d+))?x)?"
    r"(?P<seq_len>\d+)(?::(?P<kv_len>\d+))?x(?P<head_dim>\d+)(?P<causal>c?)"
    r"(?::(?P<dtype>[a-z0-9]+))?$"
)
#: shape suffix -> (dtype, precision)
DTYPES: dict[str, tuple[str, str]] = {
    "bf16": ("bfloat16", ""),
    "bfloat16": ("bfloat16", ""),
    "fp16": ("float16", ""),
    "float16": ("float16", ""),
    "fp32": ("float32", "tf32x3"),
    "float32": ("float32", "tf32x3"),
    "tf32x3": ("float32", "tf32x3"),
    "tf32": ("float32", "tf32"),
}
#: (dtype, precision) -> the suffix file names use
DTYPE_TOKENS = {
    ("bfloat16", ""): "bf16",
    ("float16", ""): "fp16",
    ("float32", "tf32x3"): "fp32",
    ("float32", "tf32"): "tf32",
}


def parse_shape(text: str, causal: bool = False) -> Problem:
    """``[BxH[/KVH]x]N[:KVLEN]xD[c][:DTYPE]`` (see the module's head); ``causal`` forces it."""
    match = _SHAPE.match(text.strip().lower())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not [BxH[/KVH]x]N[:KVLEN]xD[c][:DTYPE] (e.g. 2x32/8x4096x128c:bf16)"
        )
    fields = match.groupdict()
    token = fields["dtype"] or "fp32"
    if token not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"{text!r}: dtype {token!r} is not one of {', '.join(DTYPES)}"
        )
    dtype, precision = DTYPES[token]
    heads = int(fields["heads"] or 1)
    try:
        return Problem(
            seq_len=int(fields["seq_len"]),
            head_dim=int(fields["head_dim"]),
            batch=int(fields["batch"] or 1),
            heads=heads,
            causal=causal or bool(fields["causal"]),
            dtype=dtype,
            kv_heads=int(fields["kv_heads"]) if fields["kv_heads"] else None,
            kv_len=int(fields["kv_len"]) if fields["kv_len"] else None,
            precision=precision,
        )
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from error


def shape_token(problem: Problem) -> str:
    """The shape as a file name part: ``2x32-8x4096x128c_bf16``, ``16x32-8x1-8192x128_bf16``."""
    causal = "c" if problem.causal else ""
    dtype = DTYPE_TOKENS[(problem.dtype, problem.precision)]
    return f"{problem.shape_text('-', '-')}{causal}_{dtype}"


def recording_name(recording: Recording) -> str:
    """``<gpu>_<families>_<shape>_<dtype>.json``: ``h200_mma_f16_4x16x4096x128_bf16.json``."""
    gpu = recording.environment.gpu_name.lower().removeprefix("nvidia ")
    gpu = re.sub(r"[^a-z0-9]+", "-", gpu).strip("-") or "gpu"
    families = "_".join(sorted(recording.source_hashes)) or "none"
    return f"{gpu}_{families}_{shape_token(recording.problem)}.json"


def recorded_families(problem: Problem, asked: Sequence[str] | None) -> tuple[str, ...]:
    """The families to record for ``problem``: those asked for (default: all) that take
    its dtype."""
    takes = families_for(problem.dtype)
    return tuple(f for f in (asked or takes) if f in takes)


def record(
    problem: Problem,
    backend: Backend,
    device: DeviceProfile,
    *,
    measured: bool,
    command: str,
    families: Sequence[str],
    cache_dir: str | None = None,
) -> Recording:
    """Every planner-feasible plan of ``families`` at ``problem``, measured (or ruled out
    by the compiler); the recording's ``source_hashes`` name the families that have one."""
    space = candidate_space(problem, device, SpaceAxes(families=tuple(families)))
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
    held = sorted({plan.params.family for plan in space.feasible})
    hashes = {family: build.source_hash(family) for family in held}
    return recording_from(problem, environment, measured, command, date, results, hashes)


def summary(recording: Recording) -> str:
    """One line: plans, how many were timed, the failures by kind, the best plan."""
    entries = list(recording.entries.values())
    timed = [e for e in entries if e.median_ms is not None]
    failures = Counter(str(e.failure) for e in entries if e.failure is not None)
    best = min(timed, key=lambda e: (e.median_ms or 0.0, e.key)) if timed else None
    text = f"{recording.problem.label()}: {len(entries)} plans, {len(timed)} timed"
    if failures:
        text += " (" + ", ".join(f"{n} {kind}" for kind, n in sorted(failures.items())) + ")"
    if best is not None:
        text += f", best {best.key} {best.median_ms:.4f} ms"
    return text


def write_atomically(path: Path, recordings: Sequence[Recording]) -> None:
    """``write_recordings`` through a temporary file: an interrupt never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    write_recordings(temporary, recordings)
    os.replace(temporary, path)


def split(source: Path, out_dir: Path) -> list[Path]:
    """File each recording of ``source`` in ``out_dir`` under ``recording_name``."""
    written = []
    for recording in load_recordings(source):
        path = out_dir / recording_name(recording)
        write_atomically(path, [recording])
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("pycuda", "model"))
    parser.add_argument(
        "--shape", action="append", default=[], help="[BxH[/KVH]x]N[:KVLEN]xD[c][:DTYPE]"
    )
    parser.add_argument("--causal", action="store_true", help="causal masking for every shape")
    parser.add_argument(
        "--family",
        action="append",
        choices=family_names(),
        help="record this family (repeatable; default: every family that takes the dtype)",
    )
    parser.add_argument("--out", type=Path, help="one file holding every recording")
    parser.add_argument("--out-dir", type=Path, help="one file per recording, named by shape")
    parser.add_argument("--append", action="store_true", help="keep --out's other shapes")
    parser.add_argument("--split", type=Path, help="file FILE's recordings in --out-dir; no run")
    parser.add_argument("--device-ordinal", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per plan")
    parser.add_argument("--repetitions", type=int, default=30)
    parser.add_argument("--cache-dir", default=BackendConfig.cache_dir)
    args = parser.parse_args(argv)

    if args.split is not None:
        if args.out_dir is None:
            parser.error("--split needs --out-dir")
        for path in split(args.split, args.out_dir):
            print(f"written: {path}")
        return 0
    if args.backend is None or not args.shape:
        parser.error("--backend and at least one --shape are needed (or --split)")
    if args.out is None and args.out_dir is None:
        parser.error("give --out FILE, --out-dir DIR, or both")
    try:
        problems = [parse_shape(shape, args.causal) for shape in args.shape]
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    families = {problem: recorded_families(problem, args.family) for problem in problems}
    for problem, chosen in families.items():
        if not chosen:
            parser.error(f"no family of {args.family} takes {problem.label()}")
    command = shlex.join(["python", "bench/record_replay.py", *(argv or sys.argv[1:])])

    kept: list[Recording] = []
    if args.out is not None and args.append and args.out.exists():
        fresh = set(problems)
        kept = [r for r in load_recordings(args.out) if r.problem not in fresh]

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
    recordings: list[Recording] = []
    problem = problems[0]
    try:
        for problem in problems:
            began = time.monotonic()
            print(f"recording {problem.label()}: {', '.join(families[problem])}", flush=True)
            try:
                recording = record(
                    problem,
                    backend,
                    device,
                    measured=args.backend == "pycuda",
                    command=command,
                    families=families[problem],
                    cache_dir=cache_dir,
                )
            except TunerError as error:  # this shape only (no nvcc, no memory for it)
                print(f"{problem.label()}: not recorded: {error}", flush=True)
                continue
            recordings.append(recording)
            if args.out is not None:
                write_atomically(args.out, kept + recordings)
            if args.out_dir is not None:
                write_atomically(args.out_dir / recording_name(recording), [recording])
            print(f"{summary(recording)} [{time.monotonic() - began:.0f} s]", flush=True)
    except KeyboardInterrupt:
        print(f"interrupted while recording {problem.label()}: {len(recordings)} shapes written")
        return 130
    finally:
        backend.close()
    if args.out is not None:
        print(f"written: {args.out}")
    if args.out_dir is not None:
        print(f"written: {len(recordings)} files in {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
