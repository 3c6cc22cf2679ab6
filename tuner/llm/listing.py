"""``mode=plan model=...``: a model's problems and the skipped ones, without tuning.

For each problem the planner can serve: its shape, the bucket(s) and layers it serves,
its variant, how many candidates are feasible, and the cost model's best plan with its
predicted time (the zero-trial pick). Then the problems the planner cannot serve, each
with its reason. No GPU, database or study.
"""

from __future__ import annotations

import sys
from typing import TextIO

from tuner.dry_run import describe_device, rank_by_prediction
from tuner.llm.summary import scale_text, serves_text, skipped_lines, variant_text
from tuner.llm.validation import ValidatedModel
from tuner.report import format_table

HEADERS = ("#", "problem", "bucket", "layers", "variant", "feasible", "pick", "pred ms")


def print_model_plan(validated: ValidatedModel, out: TextIO | None = None) -> None:
    """Print the problems of ``validated``'s model to ``out`` (stdout)."""
    out = out or sys.stdout
    attention, config, device = validated.attention, validated.config, validated.device
    rows = []
    for index, model_problem in enumerate(validated.problems, 1):
        problem = model_problem.problem
        space = validated.spaces[problem]
        plan, prediction = rank_by_prediction(space.feasible, device)[0]
        buckets, layers = serves_text(model_problem, attention.layers)
        rows.append(
            [
                str(index),
                problem.shape_text(),
                buckets,
                layers,
                variant_text(problem),
                str(len(space.feasible)),
                plan.key(),
                f"{prediction.time_ms:.4f}",
            ]
        )
    lines = [
        f"model:   {attention.name}: {attention.describe()}",
        f"scale:   {scale_text(attention)} (run-time data, not tuned)",
        f"device:  {describe_device(device, config.device.profile)}",
        f"problems: {validated.total} distinct from {len(validated.buckets)} buckets x "
        f"{attention.layers} layers ({config.dtype}): {len(validated.problems)} to tune, "
        f"{len(validated.skipped)} skipped",
        "",
        format_table(HEADERS, rows) if rows else "no problem can be tuned",
        "(pick: the cost model's best plan, what the search measures first)",
        *skipped_lines(validated.skipped, attention),
    ]
    for line in lines:
        print(line, file=out)
