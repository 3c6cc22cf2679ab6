"""ptxas's register reports, kept with the recordings so a replay judges plans as a GPU run does.

    python bench/ptxas_resources.py --cache ~/.cache/flash-attention-tuner/cubins \\
        --out bench/data/ptxas/sm_90.json

A tuning run compiles its candidates before the search (``tuner.precompile``)
and re-judges each plan with the compiler's report: spills rule a plan out, and
the registers it takes bound its occupancy, which the cost model then sees. A
replay of a recording on a machine without nvcc has neither. This script
collects, from a cubin cache (``kernels.build``), the report of every kernel
variant compiled from today's sources into one small JSON file;
``search_efficiency.py`` and ``calibrate_costmodel.py`` read it
(``--resources``, default the file above) and re-judge the plans they replay
with it, exactly as ``tuner.precompile`` would. Variants missing from the file
keep the planner's judgement (and the families' register estimates).

File: ``{"arch", "nvcc_version", "date", "command", "variants": {spec key:
{"source_hash", "registers", "spill_store_bytes", "spill_load_bytes",
"static_shared_bytes", "stack_bytes"}}}``; the spec key is
``kernels.build.KernelSpec.key`` (family and every compile-time constant), the
resources those of the family's first entry function.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kernels import build
from tuner.device import DeviceProfile
from tuner.planner.plan import KernelPlan, ResourceUsage

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FILE = ROOT / "bench" / "data" / "ptxas" / "sm_90.json"


def collect(cache_dir: Path) -> tuple[dict[str, dict[str, Any]], set[str]]:
    """(spec key -> report, nvcc versions seen) of the cache's variants of today's sources."""
    current = {family: build.source_hash(family) for family in build.sources()}
    variants: dict[str, dict[str, Any]] = {}
    versions: set[str] = set()
    for path in sorted(cache_dir.glob("*.json")):
        record = json.loads(path.read_text())
        family = record.get("family")
        if family not in current or record.get("source_hash") != current[family]:
            continue
        spec = build.KernelSpec.of(family, record["defines"])
        usage = record["resources"][spec.primary_function]
        variants[spec.key] = {"source_hash": record["source_hash"], **usage}
        versions.add(str(record.get("nvcc_version", "")))
    return variants, versions


def load(path: Path = DEFAULT_FILE) -> dict[str, dict[str, Any]]:
    """The variants of a resources file whose source is today's; {} when there is no file."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    current = {family: build.source_hash(family) for family in build.sources()}
    return {
        key: entry
        for key, entry in data["variants"].items()
        if entry["source_hash"] in current.values()
    }


def judged(
    plans: Sequence[KernelPlan], reports: Mapping[str, Mapping[str, Any]], device: DeviceProfile
) -> tuple[list[KernelPlan], list[KernelPlan]]:
    """(plans the reports accept, re-judged with their registers; plans they rule out), as
    ``tuner.precompile`` judges them. A plan whose variant has no report stays as it is."""
    accepted: list[KernelPlan] = []
    rejected: list[KernelPlan] = []
    for plan in plans:
        report = reports.get(build.KernelSpec.from_plan(plan).key)
        if report is None:
            accepted.append(plan)
            continue
        usage = ResourceUsage(
            registers=int(report["registers"]),
            spill_store_bytes=int(report["spill_store_bytes"]),
            spill_load_bytes=int(report["spill_load_bytes"]),
            static_shared_bytes=int(report.get("static_shared_bytes", 0)),
            stack_bytes=int(report.get("stack_bytes", 0)),
        )
        plan = plan.with_resources(usage, device)
        (accepted if plan.feasible else rejected).append(plan)
    return accepted, rejected


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, required=True, help="a kernels.build cubin cache")
    parser.add_argument("--out", type=Path, default=DEFAULT_FILE)
    args = parser.parse_args(argv)
    variants, versions = collect(args.cache.expanduser())
    if not variants:
        print(f"no variant of today's kernel sources in {args.cache}")
        return 1
    document = {
        "arch": "sm_90",
        "nvcc_version": ", ".join(sorted(versions)),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "bench/ptxas_resources.py", *(argv or sys.argv[1:])]),
        "variants": dict(sorted(variants.items())),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = ",\n  ".join(
        f"{json.dumps(k)}: {json.dumps(v)}" for k, v in document["variants"].items()
    )
    head = json.dumps({k: v for k, v in document.items() if k != "variants"}, indent=1)
    args.out.write_text(head.removesuffix("\n}") + f',\n "variants": {{\n  {rows}\n }}\n}}\n')
    print(f"written: {args.out} ({len(variants)} variants, nvcc {document['nvcc_version']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
