"""Check a ``workers=N`` tune run after the fact: exact count, each plan once, who measured what.

    python -m tuner seq_len=4096 head_dim=128 workers=2 search.n_trials=20 backend=pycuda \\
        registry.url=sqlite:///OUT/plans.sqlite search.storage=sqlite:///OUT/studies.sqlite
    python bench/two_workers.py --storage sqlite:///OUT/studies.sqlite \\
        --registry sqlite:///OUT/plans.sqlite --n-trials 20 \\
        --recording bench/data/h200_1x1x4096x128.json --out OUT/two_workers.json

Reads the study (the only one in ``--storage``, or ``--study``) and the
registry, and writes JSON: trials that count (must equal ``--n-trials``),
plans measured twice among them (must be 0), trial numbers seen twice (must
be 0), the workers (claim owners: host|boot|pid namespace|pid|start) and how
many trials each measured, the best plan of the study and the registry's
rows. With ``--recording`` (timings of every plan recorded by one process on
the same GPU model), each measured plan's time is set against its recorded
time: two workers on one GPU measure at the same time and slow each other
down, and the ratio shows by how much. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import optuna  # noqa: E402
from optuna.trial import TrialState  # noqa: E402

from db import PlanRegistry  # noqa: E402
from kernels.backends.replay import load_recordings  # noqa: E402

COUNTED = ("measured", "failed")


def summarize(args: argparse.Namespace) -> dict[str, Any]:
    names = optuna.get_all_study_names(args.storage)
    name = args.study or (names[0] if len(names) == 1 else None)
    if name is None:
        raise SystemExit(f"{args.storage} holds {len(names)} studies; name one with --study")
    trials = optuna.load_study(study_name=name, storage=args.storage).get_trials(deepcopy=False)
    counted = [
        t
        for t in trials
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
        and t.user_attrs.get("outcome") in COUNTED
    ]
    keys = Counter(str(t.user_attrs.get("plan_key")) for t in counted)
    numbers = Counter(t.number for t in trials)
    owners = Counter(
        str(t.user_attrs["claim"][2])
        for t in counted
        if isinstance(t.user_attrs.get("claim"), list) and len(t.user_attrs["claim"]) > 2
    )
    timed = [t for t in counted if t.user_attrs.get("outcome") == "measured"]
    best = min(timed, key=lambda t: t.user_attrs["median_ms"], default=None)
    summary: dict[str, Any] = {
        "study": name,
        "trials": len(trials),
        "counted": len(counted),
        "n_trials": args.n_trials,
        "plans_measured_twice": sorted(k for k, c in keys.items() if c > 1),
        "duplicate_trial_numbers": sorted(n for n, c in numbers.items() if c > 1),
        "outcomes": dict(Counter(str(t.user_attrs.get("outcome")) for t in trials)),
        "states": dict(Counter(t.state.name for t in trials)),
        "workers": {owner.split("|")[3]: count for owner, count in owners.items()},
        "retries": [t.number for t in trials if "retry_of" in t.user_attrs],
        "best": None
        if best is None
        else {
            "plan": best.user_attrs["plan_key"],
            "median_ms": best.user_attrs["median_ms"],
            "measured": best.user_attrs.get("measured"),
            "trial": best.number,
        },
    }
    with PlanRegistry.open(args.registry, readonly=True) as registry:
        summary["registry_rows"] = [
            {
                "problem": p.problem.label(),
                "plan": p.record.family + json.dumps(p.record.params, sort_keys=True),
                "median_ms": p.record.median_ms,
                "measured": p.record.measured,
                "study": p.record.study_name,
                "trial": p.record.trial_number,
            }
            for p in registry.list_best()
        ]
    if args.recording:
        summary["against_recording"] = against_recording(timed, Path(args.recording))
    checks = {
        "exact_count": summary["counted"] == args.n_trials,
        "each_plan_once": not summary["plans_measured_twice"],
        "unique_numbers": not summary["duplicate_trial_numbers"],
        "one_registry_row": len(summary["registry_rows"]) == 1,
        "every_worker_measured": len(summary["workers"]) == args.workers,
    }
    summary["checks"] = checks
    return summary


def against_recording(timed: list[Any], path: Path) -> dict[str, Any]:
    (recording,) = load_recordings(path)
    ratios = {}
    for trial in timed:
        entry = recording.entries.get(str(trial.user_attrs["plan_key"]))
        if entry is not None and entry.median_ms:
            ratios[trial.user_attrs["plan_key"]] = trial.user_attrs["median_ms"] / entry.median_ms
    recorded = [e.median_ms for e in recording.entries.values() if e.median_ms]
    found = min((t.user_attrs["median_ms"] for t in timed), default=None)
    return {
        "recording": path.name,
        "plans_compared": len(ratios),
        "median_ratio_measured_over_recorded": statistics.median(ratios.values())
        if ratios
        else None,
        "max_ratio": max(ratios.values(), default=None),
        "best_recorded_ms": min(recorded),
        "best_found_over_best_recorded": None if found is None else found / min(recorded),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage", required=True)
    parser.add_argument("--registry", required=True)
    parser.add_argument("--study")
    parser.add_argument("--n-trials", type=int, required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--recording")
    parser.add_argument("--out")
    args = parser.parse_args()
    summary = summarize(args)
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if all(summary["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
