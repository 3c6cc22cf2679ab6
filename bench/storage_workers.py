"""N worker processes on one study, per storage kind: does the count stay exact, and how fast?

    python bench/storage_workers.py --workers 8 --n-trials 120 --measure-ms 20 \\
        --kinds sqlite journal [--postgres-url postgresql+psycopg://...] [--out result.json]

Each worker is a spawned process that runs ``tuner.search.run_search`` on the
shared study with a stand-in backend (the cost model, after sleeping
``--measure-ms``, as a GPU measurement would take), exactly as ``workers=N``
does. Kinds:

* ``sqlite``: ``tuner.study_storage.open_storage`` (WAL, busy timeout,
  BEGIN IMMEDIATE): what the tuner uses;
* ``sqlite-deferred``: the same without BEGIN IMMEDIATE (plain WAL + busy timeout);
* ``journal``: ``optuna.storages.JournalStorage(JournalFileBackend(path))``
  (no heartbeats: Optuna implements them for RDB storage only);
* ``postgres``: ``open_storage`` on ``--postgres-url`` (a fresh, empty database).

Per kind it prints and writes (``--out``): wall seconds, trials, trials that
count (must equal ``--n-trials``), plans measured twice (must be 0), duplicate
trial numbers (must be 0), and workers that failed with their error.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import optuna  # noqa: E402

from kernels.backends.base import Backend, Measurement  # noqa: E402
from kernels.backends.model import ModelBackend  # noqa: E402
from tuner.config import SearchConfig  # noqa: E402
from tuner.costmodel import predict  # noqa: E402
from tuner.device import H200  # noqa: E402
from tuner.planner import SpaceAxes, candidate_space  # noqa: E402
from tuner.problem import Problem  # noqa: E402
from tuner.search import prepare_study, run_search  # noqa: E402
from tuner.study_space import StudySpace  # noqa: E402
from tuner.study_storage import open_storage  # noqa: E402

PROBLEM = Problem(1024, 64)
STUDY = "bench"


class SleepyModel(Backend):
    """The cost model's answer after ``seconds``; notes which process measured what."""

    name = "sleepy"

    def __init__(self, seconds: float, log: str) -> None:
        self.seconds, self.log, self.model = seconds, log, ModelBackend(H200)

    def measure(self, plan: Any, problem: Problem) -> Measurement:
        time.sleep(self.seconds)
        with open(self.log, "a") as log:
            log.write(f"{os.getpid()} {plan.key()}\n")
        return self.model.measure(plan, problem)


def space() -> tuple[StudySpace, dict]:
    planned = candidate_space(PROBLEM, H200, SpaceAxes())
    predictions = {p.key(): predict(p, H200) for p in planned.feasible}
    return StudySpace(PROBLEM, H200, planned.feasible, planned.rejected), predictions


def open_kind(kind: str, where: str) -> Any:
    if kind == "journal":
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        return JournalStorage(JournalFileBackend(where))
    begin = "BEGIN" if kind == "sqlite-deferred" else "BEGIN IMMEDIATE"
    return open_storage(where, sqlite_begin=begin)


def worker(kind: str, where: str, index: int, settings: SearchConfig, args: Any) -> None:
    try:
        study_space, predictions = space()
        storage = open_kind(kind, where)
        backend = SleepyModel(args.measure_ms / 1000, args.log)
        run_search(
            study_space,
            backend,
            settings,
            storage=storage,
            study_name=STUDY,
            predictions=predictions,
            worker=index,
            parallel=True,
            enqueue=False,
        )
    except BaseException:
        with open(f"{args.log}.errors", "a") as errors:
            errors.write(f"worker {index}: {traceback.format_exc().splitlines()[-1]}\n")
        raise


def run_kind(kind: str, args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    if kind == "postgres":
        where = args.postgres_url
    elif kind == "journal":
        where = str(directory / "journal.log")
    else:
        where = f"sqlite:///{directory / (kind + '.sqlite')}"
    args.log = str(directory / f"{kind}.measured")
    settings = SearchConfig(
        sampler="tpe", n_trials=args.n_trials, traffic_cutoff=1e9, enqueue_top=8
    )
    study_space, predictions = space()
    prepare_study(
        study_space,
        settings,
        storage=open_kind(kind, where),
        study_name=STUDY,
        predictions=predictions,
    )
    context = multiprocessing.get_context("spawn")
    started = time.monotonic()
    processes = [
        context.Process(target=worker, args=(kind, where, i, settings, args))
        for i in range(args.workers)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    wall = time.monotonic() - started
    storage = open_kind(kind, where)
    trials = optuna.load_study(study_name=STUDY, storage=storage).get_trials()
    counted = [t for t in trials if t.user_attrs.get("outcome") in ("measured", "failed")]
    measured = Path(args.log).read_text().split("\n") if Path(args.log).exists() else []
    keys = collections.Counter(line.split()[1] for line in measured if line)
    numbers = collections.Counter(t.number for t in trials)
    errors_file = Path(f"{args.log}.errors")
    return {
        "kind": kind,
        "workers": args.workers,
        "n_trials": args.n_trials,
        "measure_ms": args.measure_ms,
        "wall_s": round(wall, 2),
        "trials": len(trials),
        "counted": len(counted),
        "measurements": sum(keys.values()),
        "plans_measured_twice": sum(1 for c in keys.values() if c > 1),
        "duplicate_trial_numbers": sum(1 for c in numbers.values() if c > 1),
        "outcomes": dict(collections.Counter(str(t.user_attrs.get("outcome")) for t in trials)),
        "in_flight_duplicates": sum(
            1 for t in trials if t.user_attrs.get("failure") == "IN_FLIGHT"
        ),
        "worker_exit_codes": [p.exitcode for p in processes],
        "worker_errors": errors_file.read_text().splitlines() if errors_file.exists() else [],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--n-trials", type=int, default=120)
    parser.add_argument("--measure-ms", type=float, default=20.0)
    parser.add_argument("--kinds", nargs="+", default=["sqlite", "journal"])
    parser.add_argument("--postgres-url")
    parser.add_argument("--out")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="storage-workers-") as tmp:
        for kind in args.kinds:
            result = run_kind(kind, args, Path(tmp))
            print(json.dumps(result), flush=True)
            results.append(result)
    if args.out:
        environment = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
        environment["optuna"] = optuna.__version__
        Path(args.out).write_text(
            json.dumps({"environment": environment, "results": results}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
