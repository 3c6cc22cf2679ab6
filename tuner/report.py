"""What a tune run prints: the best plans as a table, and a summary of the study."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from tuner.costmodel import rank_correlation
from tuner.trials import SearchResult, TrialOutcome

HEADERS = (
    "rank",
    "plan",
    "median ms",
    "spread ms",
    "TFLOP/s",
    "GB/s",
    "max |err|",
    "predicted ms",
    "source",
)


def best_table(result: SearchResult, top: int = 5) -> str:
    """The ``top`` fastest distinct plans of the study, one row each; backward studies add
    the forward each trial ran on and forward + backward (a training step's attention)."""
    ranked = result.ranked()[:top]
    if not ranked:
        return "no candidate produced a time"
    rows = [_row(rank, trial) for rank, trial in enumerate(ranked, 1)]
    if not any(trial.forward_ms is not None for trial in ranked):
        return format_table(HEADERS, rows)
    for row, trial in zip(rows, ranked, strict=True):
        total = None
        if trial.forward_ms is not None and trial.median_ms is not None:
            total = trial.forward_ms + trial.median_ms
        row[3:3] = [_number(trial.forward_ms, 4), _number(total, 4)]
    headers = (*HEADERS[:3], "forward ms", "fwd+bwd ms", *HEADERS[3:])
    return format_table(headers, rows)


def _row(rank: int, trial: TrialOutcome) -> list[str]:
    # Without a GPU a trial's "median" is the cost model's prediction: it is shown once,
    # under predicted ms, not again as if it had been timed.
    timed = trial.measured
    return [
        str(rank),
        trial.key,
        _number(trial.median_ms if timed else None, 4),
        _number(trial.spread_ms if timed else None, 4),
        _number(trial.tflops, 2),
        _number(trial.gbps, 0),
        _scientific(trial.max_abs_error),
        _number(trial.predicted_ms, 4),
        "measured" if trial.measured else "predicted",
    ]


def summary_lines(result: SearchResult) -> list[str]:
    """Counts by outcome, failure reasons, why it stopped, and the model's rank correlation."""
    outcomes = Counter(t.outcome for t in result.trials)
    new = set(result.new_trials)
    new_counted = sum(1 for t in result.trials if t.number in new and t.counted)
    lines = [
        f"trials: {result.counted} evaluated by the backend ({outcomes['measured']} timed, "
        f"{outcomes['failed']} failed; {new_counted} in this run); proposals not sent to it: "
        f"{outcomes['duplicate']} duplicate, {outcomes['infeasible']} infeasible, "
        f"{outcomes['skipped']} over the traffic cutoff"
        + (f"; {outcomes['interrupted']} interrupted" if outcomes["interrupted"] else "")
    ]
    failures = Counter(t.failure for t in result.trials if t.outcome == "failed")
    if failures:
        listed = ", ".join(f"{name} {count}" for name, count in failures.most_common())
        lines.append(f"failures: {listed}")
    rule = result.stopped_by_rule
    if rule is not None and result.stop_reason == rule.get("reason"):
        # "stopped after 6 of 40 trials: no unmeasured plan has more than ..."
        lines.append(f"stopped {result.stop_reason}")
    elif result.stop_reason:
        lines.append(f"stopped: {result.stop_reason}")
    rho = model_rank_correlation(result.ranked())
    if rho is not None:
        lines.append(f"cost model vs measured: Spearman rank correlation {rho:.3f}")
    return lines


def model_rank_correlation(trials: Sequence[TrialOutcome]) -> float | None:
    """Spearman's rho of predicted vs measured times; None without measured times."""
    measured = [t for t in trials if t.measured and t.median_ms is not None]
    if len(measured) < 3:
        return None
    rho = rank_correlation([t.predicted_ms for t in measured], [t.median_ms for t in measured])
    return None if math.isnan(rho) else rho


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned text columns, numbers right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    numeric = [all(_is_numeric(r[i]) for r in rows) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        parts = [
            cell.rjust(width) if right else cell.ljust(width)
            for cell, width, right in zip(cells, widths, numeric, strict=True)
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def _is_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return text == "-"
    return True


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _scientific(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"
