"""The replay backend: timings recorded on a real GPU, served back without one.

``bench/record_replay.py`` measures every feasible candidate of a problem and
writes a *recording*; CI replays it, so the search is tested on real data.

File format 1 (JSON). A file is one recording or a list of recordings (several
problems, one per recording; ``--append`` in the recorder grows the list)::

    {
      "format": 1,
      "measured": true,        # true: timed on the GPU named below; false: cost model
      "environment": {"gpu_name": "NVIDIA H200", "compute_capability": "9.0",
                      "sm_count": 132, "driver_version": "...", "cuda_version": "...",
                      "nvcc_version": "...", "pycuda_version": "..."},
      "problem": {"seq_len": 4096, "head_dim": 128, "batch": 1, "heads": 1,
                  "causal": false, "dtype": "float32"},
      "command": "python bench/record_replay.py ...",
      "date": "2026-12-02T17:00:00+00:00",
      "source_hashes": {"tiled": "<sha256 of kernels/tiled.cu>", ...},
      "measurements": [
        {"key": "tiled/b64/r64/t256/s4",
         "params": {"family": "tiled", "threads": 256, "tile_size": 64,
                    "rows_per_block": 64, "split_target": 4},
         "median_ms": 0.21, "spread_ms": 0.002, "max_abs_error": 3e-7,
         "failure": null, "detail": ""}
      ]
    }

``source_hashes`` (optional) names the kernel sources the timings belong to:
a replay stores its best plan under them, so the registry treats the plan as
stale once a ``.cu`` file changes. ``failure`` is null or a
``kernels.backends.base.Failure`` value; a failed
entry has null times. Optional entry fields: ``tflops``, ``gbps``,
``repetitions``, ``predicted_ms``. Results are ``measured=True`` only when the
recording says ``"measured": true`` *and* names a GPU (``gpu_name`` other
than ``"model"``). A plan the recording lacks is an ``INFEASIBLE`` failure
saying so (the recorder measures every feasible candidate, so a missing key
was rejected on the recording machine or lies outside the recorded space).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kernels.backends.base import Backend, Failure, Measurement
from kernels.backends.model import MODEL_GPU_NAME
from tuner.environment import Environment
from tuner.errors import BackendError
from tuner.planner.tunable import KernelPlan
from tuner.problem import Problem

FORMAT = 1


@dataclass(frozen=True, slots=True)
class ReplayEntry:
    key: str
    params: dict[str, Any]
    median_ms: float | None
    spread_ms: float | None = None
    max_abs_error: float | None = None
    failure: Failure | None = None
    detail: str = ""
    tflops: float | None = None
    gbps: float | None = None
    repetitions: int = 0
    predicted_ms: float | None = None

    def as_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "key": self.key,
            "params": dict(self.params),
            "median_ms": _significant(self.median_ms),
            "spread_ms": _significant(self.spread_ms),
            "max_abs_error": _significant(self.max_abs_error),
            "failure": None if self.failure is None else str(self.failure),
            "detail": self.detail,
        }
        optional = {
            "tflops": _significant(self.tflops),
            "gbps": _significant(self.gbps),
            "repetitions": self.repetitions or None,
            "predicted_ms": _significant(self.predicted_ms),
        }
        data.update({name: value for name, value in optional.items() if value is not None})
        return data


def _significant(value: float | None) -> float | None:
    """Six significant digits: beyond what a timing resolves, and half the file size."""
    return None if value is None else float(f"{value:.6g}")


@dataclass(frozen=True, slots=True)
class Recording:
    """Every candidate of one problem, measured in one environment."""

    problem: Problem
    environment: Environment
    measured: bool
    command: str
    date: str
    entries: Mapping[str, ReplayEntry]
    #: kernel family -> sha256 of its .cu text when recorded ({} if not recorded)
    source_hashes: Mapping[str, str] = field(default_factory=dict)

    def rejection(self, key: str) -> str | None:
        """The recorded reason a plan was ruled out before timing (compiler verdict), if so."""
        entry = self.entries.get(key)
        if entry is None or entry.failure != Failure.INFEASIBLE:
            return None
        return entry.detail or "infeasible on the recording machine"

    def as_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "measured": self.measured,
            "environment": self.environment.as_dict(),
            "problem": {f.name: getattr(self.problem, f.name) for f in fields(Problem)},
            "command": self.command,
            "date": self.date,
            "source_hashes": dict(self.source_hashes),
            "measurements": [entry.as_json() for entry in self.entries.values()],
        }


def load_recordings(path: str | Path) -> list[Recording]:
    """Every recording of a replay file; ``BackendError`` names what is wrong with it."""
    path = Path(path).expanduser()
    try:
        data = json.loads(path.read_text())
    except OSError as error:
        raise BackendError(f"cannot read replay file {path}: {error.strerror or error}") from error
    except json.JSONDecodeError as error:
        raise BackendError(f"replay file {path} is not JSON: {error}") from error
    blocks = data if isinstance(data, list) else [data]
    recordings = []
    for index, block in enumerate(blocks):
        where = f"replay file {path}" + (f", recording {index}" if len(blocks) > 1 else "")
        try:
            recordings.append(_recording(block))
        except (KeyError, TypeError, ValueError) as error:
            raise BackendError(f"{where} is malformed: {_describe(error)}") from error
    seen: set[Problem] = set()
    for recording in recordings:
        if recording.problem in seen:
            raise BackendError(
                f"replay file {path} holds {recording.problem.label()} twice; keep one recording"
            )
        seen.add(recording.problem)
    return recordings


def write_recordings(path: str | Path, recordings: Sequence[Recording]) -> None:
    """Write one recording as an object, several as a list (the format above).

    One measurement per line: a file of hundreds of plans stays readable, and
    a re-recording diffs line by line.
    """
    blocks = [_dump(r.as_json()) for r in recordings]
    text = blocks[0] if len(blocks) == 1 else "[\n" + ",\n".join(blocks) + "\n]"
    Path(path).write_text(text + "\n")


def _dump(block: dict[str, Any]) -> str:
    measurements = block.pop("measurements")
    head = json.dumps(block, indent=1).removesuffix("\n}")
    rows = ",\n  ".join(json.dumps(m) for m in measurements)
    return f'{head},\n "measurements": [\n  {rows}\n ]\n}}'


def _describe(error: Exception) -> str:
    return f"missing field {error}" if isinstance(error, KeyError) else str(error)


def _recording(block: Any) -> Recording:
    if not isinstance(block, dict):
        raise TypeError(f"a recording is a JSON object, not {type(block).__name__}")
    if block.get("format") != FORMAT:
        raise ValueError(f"format {block.get('format')!r} is not supported (this reader: {FORMAT})")
    measured = block["measured"]
    if not isinstance(measured, bool):
        raise TypeError("'measured' must be true or false")
    environment = Environment(**block["environment"])
    if measured and environment.gpu_name == MODEL_GPU_NAME:
        raise ValueError("it says measured but its environment is the cost model")
    problem = Problem(**block["problem"])
    entries: dict[str, ReplayEntry] = {}
    for item in block["measurements"]:
        entry = _entry(item)
        if entry.key in entries:
            raise ValueError(f"plan {entry.key} is recorded twice")
        entries[entry.key] = entry
    return Recording(
        problem=problem,
        environment=environment,
        measured=measured,
        command=str(block.get("command", "")),
        date=str(block.get("date", "")),
        entries=entries,
        source_hashes={str(k): str(v) for k, v in block.get("source_hashes", {}).items()},
    )


def _entry(item: Mapping[str, Any]) -> ReplayEntry:
    failure = None if item.get("failure") is None else Failure(item["failure"])
    median = _number(item.get("median_ms"))
    if failure is None and (median is None or not math.isfinite(median) or median <= 0):
        raise ValueError(f"plan {item['key']} has no failure and no positive median_ms")
    return ReplayEntry(
        key=str(item["key"]),
        params=dict(item.get("params", {})),
        median_ms=median if failure is None else None,
        spread_ms=_number(item.get("spread_ms")),
        max_abs_error=_number(item.get("max_abs_error")),
        failure=failure,
        detail=str(item.get("detail", "")),
        tflops=_number(item.get("tflops")),
        gbps=_number(item.get("gbps")),
        repetitions=int(item.get("repetitions") or 0),
        predicted_ms=_number(item.get("predicted_ms")),
    )


def _number(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{value!r} is not a number")
    return float(value)


class ReplayBackend(Backend):
    """Serves a replay file's timings for the plans it holds."""

    name = "replay"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        self.recordings = load_recordings(self.path)
        if not self.recordings:
            raise BackendError(f"replay file {self.path} holds no recording")
        self._by_problem = {r.problem: r for r in self.recordings}

    def recording_for(self, problem: Problem) -> Recording:
        """The recording of ``problem``; ``BackendError`` (a run-level error) if none."""
        recording = self._by_problem.get(problem)
        if recording is not None:
            return recording
        for held in self._by_problem:
            other = dataclasses.replace(problem, dtype=held.dtype, precision=held.precision)
            if other == held:
                # Same shape, another element type: the commonest slip (the tuner's default
                # dtype is bfloat16; many recordings are float32).
                asked = f"dtype={problem.dtype}" + (" precision=tf32" if problem.fast_tf32 else "")
                fix = f"dtype={held.dtype}" + (" precision=tf32" if held.fast_tf32 else "")
                raise BackendError(
                    f"replay file {self.path} records {held.shape_text()} in {held.dtype_label}, "
                    f"but the problem asks for {asked}: replay it with {fix}"
                )
        listed = "; ".join(p.label() for p in self._by_problem)
        raise BackendError(
            f"replay file {self.path} has no recording of {problem.label()} (it holds: {listed})"
        )

    @property
    def measured(self) -> bool:
        return all(r.measured for r in self.recordings)

    def environment(self) -> dict[str, str | int]:
        environments = {r.environment for r in self.recordings}
        if len(environments) > 1:
            raise BackendError(
                f"replay file {self.path} mixes {len(environments)} environments; "
                "keep one GPU and toolchain per file"
            )
        return next(iter(environments)).as_dict()

    def measure(self, plan: KernelPlan, problem: Problem) -> Measurement:
        recording = self._by_problem.get(problem)
        if recording is None:
            return Measurement.failed(
                Failure.INFEASIBLE,
                f"replay file {self.path.name} has no recording of {problem.label()}",
                measured=False,
            )
        entry = recording.entries.get(plan.key())
        if entry is None:
            return Measurement.failed(
                Failure.INFEASIBLE,
                f"{plan.key()} is not in replay file {self.path.name} ({len(recording.entries)} "
                "plans recorded): rejected on the recording machine or outside its space",
                measured=False,
            )
        if entry.failure is not None:
            return Measurement.failed(entry.failure, entry.detail, measured=recording.measured)
        assert entry.median_ms is not None  # checked on load
        seconds = entry.median_ms * 1e-3
        tflops = entry.tflops or problem.useful_flops / seconds / 1e12
        gbps = entry.gbps or plan.global_bytes / seconds / 1e9
        return Measurement(
            measured=recording.measured,
            median_ms=entry.median_ms,
            spread_ms=entry.spread_ms,
            repetitions=entry.repetitions,
            max_abs_error=entry.max_abs_error,
            tflops=tflops,
            gbps=gbps,
            detail=entry.detail or f"replayed from {self.path.name} ({recording.date})",
        )


def recording_from(
    problem: Problem,
    environment: Environment,
    measured: bool,
    command: str,
    date: str,
    results: Iterable[tuple[KernelPlan, Measurement, float | None]],
    source_hashes: Mapping[str, str] | None = None,
) -> Recording:
    """A recording of ``(plan, measurement, predicted_ms)`` results, in the order given."""
    entries = {}
    for plan, measurement, predicted_ms in results:
        entries[plan.key()] = ReplayEntry(
            key=plan.key(),
            params=dict(plan.params.as_dict()),
            median_ms=measurement.median_ms if measurement.ok else None,
            spread_ms=measurement.spread_ms,
            max_abs_error=measurement.max_abs_error,
            failure=measurement.failure,
            detail=measurement.detail,
            tflops=measurement.tflops,
            gbps=measurement.gbps,
            repetitions=measurement.repetitions,
            predicted_ms=predicted_ms,
        )
    return Recording(
        problem, environment, measured, command, date, entries, dict(source_hashes or {})
    )
