"""The JSON export format: plans with their problem, environment and time, versioned.

    {"format": "flash-attention-tuner/plan-registry", "version": 1,
     "exported_at": "...", "plans": [
        {"problem": {...}, "environment": {...}, "plan": {...PlanRecord...},
         "created_at": "2026-12-03T10:00:00.123456+00:00", "best": true}, ...]}

Every history row is exported, oldest first, so an import replays them in the
order they were recorded. ``best`` says what the exporting registry served; an
import re-derives the best pointers by the registry's rule instead of trusting
it (it may merge into a registry that already has plans). Floats are written by
``json`` as their shortest round-tripping repr, so every field comes back exact.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from db import export_target
from db.records import PlanRecord, StoredPlan
from tuner.environment import Environment
from tuner.errors import RegistryError
from tuner.problem import Problem

FORMAT_NAME = "flash-attention-tuner/plan-registry"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class ExportedPlan:
    problem: Problem
    environment: Environment
    record: PlanRecord
    created_at: datetime
    best: bool = False


def plan_to_dict(
    problem: Problem,
    environment: Environment,
    record: PlanRecord,
    created_at: datetime,
) -> dict[str, Any]:
    return {
        "problem": asdict(problem),
        "environment": environment.as_dict(),
        "plan": record.as_dict(),
        "created_at": created_at.isoformat(),
    }


def stored_to_dict(stored: StoredPlan) -> dict[str, Any]:
    """A read result as JSON-ready data (the CLI's ``--json``)."""
    return plan_to_dict(stored.problem, stored.environment, stored.record, stored.created_at) | {
        "plan_id": stored.plan_id,
        "fallback": stored.fallback,
        "stale": stored.stale,
        "served_as_measured": stored.served_as_measured,
    }


def write_export(path: str | Path, plans: list[ExportedPlan]) -> None:
    document = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "exported_at": datetime.now(UTC).isoformat(),
        "plans": [
            plan_to_dict(p.problem, p.environment, p.record, p.created_at) | {"best": p.best}
            for p in plans
        ],
    }
    # A file is written then renamed (a reader never sees half of it), through links;
    # ``-`` is standard output (``db.export_target``).
    export_target.write_text(path, json.dumps(document, indent=1, sort_keys=True) + "\n")


def read_export(path: Path) -> list[ExportedPlan]:
    try:
        document = json.loads(path.read_text())
    except OSError as e:
        raise RegistryError(f"cannot read export {path}: {e.strerror or e}") from e
    except ValueError as e:
        raise RegistryError(f"{path} is not JSON: {e}") from e
    if not isinstance(document, dict) or document.get("format") != FORMAT_NAME:
        raise RegistryError(f"{path} is not a plan registry export (format {FORMAT_NAME!r})")
    version = document.get("version")
    if version != FORMAT_VERSION:
        raise RegistryError(
            f"{path} is export format version {version!r}; this code reads version "
            f"{FORMAT_VERSION} (a newer export needs a newer flash-attention-tuner)"
        )
    plans = document.get("plans")
    if not isinstance(plans, list):
        raise RegistryError(f"{path}: 'plans' must be a list")
    # Imported here: the checks load the config rules (Hydra's), which reads need not.
    from db.import_checks import problem_error, row_error

    entries = []
    for index, entry in enumerate(plans):
        if isinstance(entry, dict) and isinstance(entry.get("problem"), dict):
            # Before the problem is built: a row of dtype int8 says so, not that its
            # precision does not fit it.
            _refuse(path, index, problem_error(entry["problem"]))
        exported = _entry(path, index, entry)
        _refuse(path, index, row_error(exported.problem, exported.environment, exported.record))
        entries.append(exported)
    return entries


def _refuse(path: Path, index: int, reason: str) -> None:
    if reason:
        raise RegistryError(
            f"{path}: plan #{index} is not one a tuner could produce ({reason}); nothing imported"
        )


def _entry(path: Path, index: int, entry: Any) -> ExportedPlan:
    try:
        if not isinstance(entry, dict) or not isinstance(entry.get("problem"), dict):
            raise TypeError("a plan is an object with a 'problem' object")
        created_at = datetime.fromisoformat(entry["created_at"])
        if created_at.tzinfo is None:
            raise ValueError("created_at has no time zone")
        return ExportedPlan(
            problem=Problem(**entry["problem"]),
            environment=Environment(**entry["environment"]),
            record=PlanRecord.from_dict(entry["plan"]),
            created_at=created_at.astimezone(UTC),
            best=bool(entry.get("best", False)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise RegistryError(f"{path}: plan #{index} is malformed ({e}); nothing imported") from e
