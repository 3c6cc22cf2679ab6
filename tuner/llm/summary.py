"""What a model run prints: one table of the best plan per problem, and the skipped ones.

Each row is one distinct problem: its shape (``BxH/KVHxN[:KV]xD``, as the registry and
``python -m db best`` name it), the bucket(s) and layers it serves, its variant, the
best plan and its time, the rate (TFLOP/s for a prefill; TB/s of K and V read for a
decode), and the cost model's zero-trial pick (the plan a deployment without a
registry launches) with its time in the same study, so the gain of tuning shows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tuner.llm.attention import ModelAttention
from tuner.llm.problems import DECODE, ModelProblem
from tuner.llm.servable import SkippedProblem
from tuner.problem import Problem
from tuner.report import format_table
from tuner.trials import SearchResult

HEADERS = (
    "#",
    "problem",
    "bucket",
    "layers",
    "variant",
    "best plan",
    "ms",
    "TFLOP/s",
    "TB/s",
    "pick ms",
    "pick/best",
)
#: marks a zero-trial pick's time that is the cost model's, not the study's
PREDICTED_MARK = "*"


@dataclass(frozen=True, slots=True)
class ProblemOutcome:
    """A tuned problem as the table shows it: its study's result and the zero-trial pick."""

    model_problem: ModelProblem
    result: SearchResult
    pick_key: str
    pick_predicted_ms: float


def layers_text(layers: Sequence[int], total: int) -> str:
    """``all 32``, ``even (21)``, ``odd (21)``, or ranges such as ``0-3,8,10-12``."""
    if list(layers) == list(range(total)):
        return f"all {total}"
    if total > 2 and list(layers) == list(range(0, total, 2)):
        return f"even ({len(layers)})"
    if total > 2 and list(layers) == list(range(1, total, 2)):
        return f"odd ({len(layers)})"
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def serves_text(model_problem: ModelProblem, total_layers: int) -> tuple[str, str]:
    """The problem's buckets and layers, as two cells."""
    buckets = ", ".join(use.bucket.label() for use in model_problem.uses)
    layers = dict.fromkeys(layers_text(use.layers, total_layers) for use in model_problem.uses)
    return buckets, " / ".join(layers)


def kv_bytes_read(problem: Problem) -> int:
    """Bytes of K and V a decode step must read: each sequence's visible keys, once per
    KV head (one query row sees ``attended_pairs`` keys: all of them, or its window)."""
    keys = problem.attended_pairs if problem.seq_len == 1 else problem.kv_len
    return 2 * problem.batch_kv_heads * keys * problem.head_dim * problem.element_bytes


def summary_table(outcomes: Sequence[ProblemOutcome], attention: ModelAttention) -> str:
    """One row per tuned problem, in the order they were tuned."""
    rows = [_row(index, outcome, attention) for index, outcome in enumerate(outcomes, 1)]
    if not rows:
        return "no problem was tuned"
    table = format_table(HEADERS, rows)
    return (
        f"{table}\n(pick: the cost model's zero-trial choice, timed in the same study, "
        f"{PREDICTED_MARK} its predicted time where the study has none; pick/best: how much "
        "slower it is than the best plan)"
    )


def _row(index: int, outcome: ProblemOutcome, attention: ModelAttention) -> list[str]:
    model_problem, result = outcome.model_problem, outcome.result
    problem = model_problem.problem
    buckets, layers = serves_text(model_problem, attention.layers)
    variant = variant_text(problem)
    best = result.best
    shape = problem.shape_text()
    if best is None or best.median_ms is None:
        return [str(index), shape, buckets, layers, variant, "no time"] + ["-"] * 5
    seconds = best.median_ms * 1e-3
    decode = model_problem.kind == DECODE
    tflops = "-" if decode else f"{problem.useful_flops / seconds / 1e12:.1f}"
    tbps = f"{kv_bytes_read(problem) / seconds / 1e12:.2f}" if decode else "-"
    pick_ms, vs_pick = _pick_cells(outcome, best.median_ms)
    return [
        str(index),
        shape,
        buckets,
        layers,
        variant,
        best.key,
        f"{best.median_ms:.4f}",
        tflops,
        tbps,
        pick_ms,
        vs_pick,
    ]


def variant_text(problem: Problem) -> str:
    """``window 4096, softcap 50``: the variants as the model states them (a window is
    the keys a token sees, not FlashAttention's bound); ``none``."""
    parts = []
    if problem.window_left >= 0:
        parts.append(f"window {problem.window_left + 1}")
    if problem.softcap:
        parts.append(f"softcap {problem.softcap:g}")
    if problem.alibi:
        parts.append("alibi")
    if problem.sinks:
        parts.append("sinks")
    return ", ".join(parts) or "none"


def _pick_cells(outcome: ProblemOutcome, best_ms: float) -> tuple[str, str]:
    timed = {trial.key: trial for trial in outcome.result.ranked()}
    pick = timed.get(outcome.pick_key)
    if pick is not None and pick.median_ms is not None:
        return f"{pick.median_ms:.4f}", f"{pick.median_ms / best_ms:.2f}"
    failed = [t for t in outcome.result.trials if t.key == outcome.pick_key and t.counted]
    if failed:
        return "failed", "-"
    predicted = outcome.pick_predicted_ms
    return f"{predicted:.4f}{PREDICTED_MARK}", f"{predicted / best_ms:.2f}"


def skipped_lines(skipped: Sequence[SkippedProblem], attention: ModelAttention) -> list[str]:
    """One line per problem the run cannot tune, with the reason."""
    lines = []
    for entry in skipped:
        buckets, layers = serves_text(entry.model_problem, attention.layers)
        lines.append(
            f"skipped: {entry.model_problem.problem.label()} ({buckets}; layers {layers}): "
            f"{entry.reason}"
        )
    return lines


def scale_text(attention: ModelAttention) -> str:
    """``0.0625 = 1/sqrt(256)``: the softmax scale and the number under the root."""
    return f"{attention.scale:.6g} = 1/sqrt({1.0 / attention.scale**2:.6g})"
