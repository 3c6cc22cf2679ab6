"""Fit the cost model's constants to the recorded grids, and score it out of sample.

    python bench/calibrate_costmodel.py [--data bench/data/*.json] [--probe FILE ...] \\
        [--write tuner/costmodel_calibration.json] [--table bench/results/costmodel_loo.md]

Every measured recording under ``bench/data`` is a grid: every feasible plan of
a problem timed on the GPU (``bench/record_replay.py``), planned here as
``python -m tuner backend=replay`` plans it (``search_efficiency.setup_problem``).
``--probe`` adds ``bench/mma_probe.py`` JSON (mma_f16 variants timed directly) as
further grids. Then:

1. leave one grid out: for each grid, ``tuner.calibration.fit`` on all the
   others, then Spearman per family and the zero-trial pick's distance to the
   grid's best on the held-out grid (the table);
2. the constants fitted on every grid, written with their provenance (files,
   problems, plans, command, date, the held-out table) to ``--write``, which
   ``tuner.costmodel.calibrated()`` reads.

CPU only; about a minute on two cores for a dozen grids.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import ptxas_resources
import search_efficiency

from tuner import costmodel
from tuner.calibration import Grid, Score, fit, leave_one_out, loss, score
from tuner.device import H200
from tuner.planner.params import KernelParams
from tuner.planner.tunable import plan_kernel
from tuner.problem import Problem

ROOT = Path(__file__).resolve().parent.parent


def recorded_grids(
    paths: Sequence[Path], cubins: str | None = None, resources: str = ""
) -> list[tuple[Grid, dict[str, Any]]]:
    """A grid per measured problem (its recordings in several files merged), with sources.
    ``cubins`` or ``resources`` (recorded ptxas reports): judge the plans with the
    compiler's register report, as a GPU run does."""
    grids = []
    for places in search_efficiency.problems_by_shape(paths).values():
        setup = search_efficiency.setup_problem(
            *places[0], cubins, also=places[1:], resources=resources
        )
        by_key = {plan.key(): plan for plan in setup.feasible}
        timed = [(by_key[key], ms) for key, ms in sorted(setup.times.items())]
        label = setup.recording.problem.label()
        source = {
            "files": [_relative(path) for path, _ in places],
            "problem": label,
            "plans": len(timed),
            "families": sorted({plan.family for plan, _ in timed}),
            "recorded": setup.recording.date,
        }
        grids.append((Grid.of(label, timed, H200), source))
    return grids


def probe_grids(
    paths: Sequence[Path], cubins: str | None = None, resources: str = ""
) -> list[tuple[Grid, dict[str, Any]]]:
    """A grid per shape of ``bench/mma_probe.py`` JSON with enough timed variants (those
    today's compiler rejects dropped, with ``cubins``), as ``search_efficiency`` builds them."""
    grids = []
    for path in paths:
        for index in search_efficiency.probe_shapes(path):
            setup = search_efficiency.setup_probe(path, index, cubins=cubins, resources=resources)
            timed = [(plan, setup.times[plan.key()]) for plan in setup.feasible]
            source = {
                "files": [_relative(path)],
                "problem": setup.label,
                "plans": len(timed),
                "families": ["mma_f16"],
                "note": "bench/mma_probe.py variants of an earlier mma_f16 kernel",
            }
            grids.append((Grid.of(setup.label, timed, H200), source))
    return grids


def evidence_points(
    paths: Sequence[Path], resources: str = ""
) -> list[tuple[Grid, dict[str, Any]]]:
    """A one-plan grid per shape of an ``evidence_*.py`` JSON: the plan the tuner stored and
    its measured median (an absolute time the model must meet; no ranking to score)."""
    reports = ptxas_resources.load(Path(resources)) if resources else {}
    grids = []
    for path in paths:
        for shape, entry in json.loads(path.read_text())["shapes"].items():
            stored = entry.get("stored") or {}
            command = (entry.get("tuning") or {}).get("command", "")
            if not stored.get("measured") or not stored.get("median_ms") or not command:
                continue
            problem = _problem_of(command)
            params = KernelParams(stored["family"], **stored["params"])
            plan = plan_kernel(problem, params, H200)
            accepted, _ = ptxas_resources.judged([plan], reports, H200)
            plan = accepted[0] if accepted else plan  # it ran: ptxas accepted it then
            if plan.key() != stored["key"]:
                raise ValueError(f"{path.name} {shape}: {stored['key']} plans as {plan.key()}")
            label = f"{problem.label()} ({path.stem}: {plan.key()})"
            source = {
                "files": [_relative(path)],
                "problem": label,
                "plans": 1,
                "families": [plan.family],
            }
            grids.append((Grid.of(label, [(plan, float(stored["median_ms"]))], H200), source))
    return grids


def _problem_of(command: str) -> Problem:
    """The problem of a ``python -m tuner key=value ...`` command line."""
    fields = {"seq_len", "head_dim", "batch", "heads", "causal", "dtype", "kv_heads", "kv_len"}
    values: dict[str, Any] = {}
    for word in shlex.split(command):
        key, _, value = word.partition("=")
        if key in fields:
            values[key] = value == "true" if key == "causal" else value
            if key not in ("dtype", "causal"):
                values[key] = int(value)
        elif key == "precision" and value not in ("", "null"):
            values["precision"] = value
    return Problem(**values)


def _relative(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def markdown_table(rows: Sequence[Score], baseline: dict[tuple[str, str], Score]) -> str:
    lines = [
        "| held-out grid | family | plans | Spearman (held out) | zero-trial pick / best "
        "| predicted / measured at the best | uncalibrated Spearman | uncalibrated pick / best |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        before = baseline.get((row.grid, row.family))
        lines.append(
            f"| {row.grid} | {row.family} | {row.plans} | {_fmt(row.spearman)} "
            f"| {row.pick_over_best:.3f} | {row.predicted_over_measured:.2f} "
            f"| {_fmt(before.spearman) if before else '-'} "
            f"| {f'{before.pick_over_best:.3f}' if before else '-'} |"
        )
    return "\n".join(lines)


def _fmt(value: float) -> str:
    return "n/a" if value != value else f"{value:.3f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, nargs="+", help="default: bench/data/*.json")
    parser.add_argument("--probe", type=Path, nargs="*", default=[], help="mma_probe.py JSON")
    parser.add_argument(
        "--evidence",
        type=Path,
        nargs="*",
        default=[],
        help="evidence_*.py JSON: each tuned plan and its measured time as a one-plan grid",
    )
    parser.add_argument("--iterations", type=int, default=600)
    parser.add_argument(
        "--cubins",
        metavar="DIR",
        help="cubin cache: occupancy from the compiler's register report (nvcc compiles "
        "what it lacks); default: the families' register estimates, as a replay run",
    )
    parser.add_argument(
        "--resources",
        default=str(ptxas_resources.DEFAULT_FILE),
        help="ptxas reports (bench/ptxas_resources.py) the plans are judged with; '' for none",
    )
    parser.add_argument("--write", type=Path, help="write the constants fitted on every grid")
    parser.add_argument("--table", type=Path, help="write the held-out table (markdown)")
    args = parser.parse_args(argv)
    began = time.monotonic()
    paths = args.data or sorted((ROOT / "bench" / "data").glob("*.json"))
    resources = args.resources if args.resources and Path(args.resources).exists() else ""
    loaded = (
        recorded_grids(paths, args.cubins, resources)
        + probe_grids(args.probe, args.cubins, resources)
        + evidence_points(args.evidence, resources)
    )
    grids = [grid for grid, _ in loaded]
    device = H200

    held_out = leave_one_out(grids, device, iterations=args.iterations)
    rows = [row for _, _, scores in held_out for row in scores]
    baseline = {
        (row.grid, row.family): row
        for grid in grids
        for row in score(grid, costmodel.UNCALIBRATED, device)
    }
    table = markdown_table(rows, baseline)
    print(table)
    final = fit(grids, device, iterations=args.iterations)
    print(f"fitted on all {len(grids)} grids: {json.dumps(final.as_dict())}")
    print(
        f"loss {loss(final, grids, device):.4f} (uncalibrated "
        f"{loss(costmodel.UNCALIBRATED, grids, device):.4f}); {time.monotonic() - began:.0f} s"
    )
    command = shlex.join(["python", "bench/calibrate_costmodel.py", *(argv or sys.argv[1:])])
    if args.table:
        args.table.write_text(f"`{command}`\n\n{table}\n")
    if args.write:
        document = {
            "params": {name: round(value, 6) for name, value in final.as_dict().items()},
            "command": command,
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "device": device.name,
            "ptxas_resources": _relative(Path(resources)) if resources else None,
            "fitted_on": [source for _, source in loaded],
            "loss": round(loss(final, grids, device), 6),
            # per grid: the constants fitted on every other grid (what a held-out
            # search replays with, bench/search_efficiency.py) and its scores under them
            "held_out": {
                grid.label: {
                    "params": {name: round(v, 6) for name, v in params.as_dict().items()},
                    "scores": [row.as_dict() for row in scores],
                }
                for grid, params, scores in held_out
            },
        }
        args.write.write_text(json.dumps(document, indent=1) + "\n")
        print(f"written: {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
