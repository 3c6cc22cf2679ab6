"""Plot ``bench/evidence.py``'s JSON: time per shape, tuned plan against torch SDPA.

    python bench/plot_evidence.py bench/results/evidence.json [--out bench/results/evidence.png]

One group of bars per shape (tuned plan, torch math, torch efficient), time in
ms on a log scale (the shapes span two orders of magnitude), with torch's
fastest over the tuned time written above each group (> 1: the tuned plan is
faster). Shapes without a timing (skipped, or a step failed) keep their place
with a note, so a gap is never mistaken for a missing shape. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SERIES = (
    ("tuned", "tuned plan", "tab:blue"),
    ("math", "torch math", "tab:grey"),
    ("efficient", "torch efficient", "tab:orange"),
)


def bar_values(shape: Mapping[str, Any]) -> dict[str, float | None]:
    """tuned / math / efficient milliseconds of one shape entry (None where missing)."""
    numbers = shape.get("figures") or {}
    torch_ms = numbers.get("torch_ms") or {}
    return {
        "tuned": numbers.get("tuned_ms"),
        "math": torch_ms.get("math"),
        "efficient": torch_ms.get("efficient"),
    }


def _title(report: Mapping[str, Any]) -> str:
    smi = report.get("nvidia_smi") or {}
    environment = report.get("environment") or {}
    gpu = environment.get("gpu_name") or smi.get("gpu") or "GPU"
    driver = environment.get("driver_version") or smi.get("driver") or "?"
    date = str(report.get("date", ""))[:10]
    return f"float32 attention on {gpu} (driver {driver}, {date}): median of CUDA-event timings"


def write_plot(report: Mapping[str, Any], out: Path) -> Path:
    from matplotlib.figure import Figure

    shapes: Sequence[Mapping[str, Any]] = report.get("shapes", [])
    if not shapes:
        raise ValueError("the evidence JSON holds no shapes")
    figure = Figure(figsize=(max(6.5, 1.9 * len(shapes) + 3), 4.8), layout="constrained")
    ax = figure.subplots()
    width = 0.26
    drawn: list[float] = []
    labelled: set[str] = set()
    for index, shape in enumerate(shapes):
        values = bar_values(shape)
        present = [v for v in values.values() if v is not None and math.isfinite(v) and v > 0]
        for offset, (key, label, colour) in enumerate(SERIES):
            value = values[key]
            if value is None or not math.isfinite(value) or value <= 0:
                continue
            drawn.append(value)
            # One legend entry per series, from its first bar (a shape may lack some).
            first = label not in labelled
            labelled.add(label)
            x = index + (offset - 1) * width
            ax.bar(x, value, width, color=colour, label=label if first else None)
            ax.annotate(
                f"{value:.3g}",
                (x, value),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
                fontsize=7,
            )
        note = _note(shape, values)
        if note:
            # Above the group's tallest bar; at the axis middle for an empty group.
            where = (index, max(present) * 1.9) if present else (index, 0.5)
            coords = "data" if present else ("data", "axes fraction")
            ax.annotate(note, where, xycoords=coords, ha="center", fontsize=8, weight="bold")
    ax.set_yscale("log")
    if drawn:
        ax.set_ylim(min(drawn) / 3, max(drawn) * 5)
    ax.set_xticks(range(len(shapes)), [str(s.get("shape", "?")) for s in shapes], fontsize=8)
    ax.set_xlim(-0.6, len(shapes) - 0.4)
    ax.set_ylabel("time per call (ms, log scale)")
    ax.set_title(_title(report), fontsize=9)
    if labelled:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    return out


def _note(shape: Mapping[str, Any], values: Mapping[str, float | None]) -> str:
    if shape.get("skipped"):
        return "skipped"
    ratio = ((shape.get("figures") or {}).get("ratios") or {}).get("torch_best_over_tuned")
    if ratio is not None:
        return f"torch/tuned {ratio:.2f}"
    if values["tuned"] is None:
        return "no timing"
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("evidence", type=Path, help="JSON written by bench/evidence.py")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "evidence.png")
    args = parser.parse_args(argv)
    report = json.loads(args.evidence.read_text())
    print(f"written: {write_plot(report, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
