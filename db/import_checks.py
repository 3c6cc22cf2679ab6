"""Which exported rows a tuner could have produced: what ``python -m db import`` accepts.

An export is a file anyone can edit. A row no tuner run could write (a negative
length, an int8 problem, a family nobody registered, a time of -1 ms) would
otherwise become the best plan of its shape for good. Each part of a row is
held to the rules the tuner itself applies, not to a copy of them:

* the problem: ``tuner.config.checked_problem``, the checks of a run's shape keys
  (ranges, dtype, precision, GQA and causal consistency, u32 element counts);
* the plan: its family is registered and takes the problem's dtype
  (``tuner.planner.families``), its parameters are that family's tunables
  (``KernelParams.from_stored``), each one of the family's values or one the search
  settings accept for a tunable axis (``tuner.config.RULES["search.axes"]``), and the
  family can plan
  them for the problem (no ``PlanError``);
* the times: positive and finite where a time is given (``tuner.config.number_above``),
  spreads, errors and rates non-negative; a measured plan names a GPU (the cost
  model, ``gpu_name`` "model", measures nothing).

``problem_error`` and ``row_error`` return the first reason, "" for a row that passes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from db.records import PlanRecord
from kernels.backends.model import MODEL_GPU_NAME
from tuner.config import RULES, number_above, number_at_least
from tuner.device import H200
from tuner.environment import Environment
from tuner.errors import ConfigError
from tuner.planner.errors import PlanError
from tuner.planner.families import family_named
from tuner.planner.params import KernelParams
from tuner.problem import Problem

_POSITIVE = ("median_ms", "predicted_ms")
_NON_NEGATIVE = ("spread_ms", "tflops", "gbps", "max_abs_error")


def problem_error(values: Mapping[str, Any]) -> str:
    """Why exported problem ``values`` are not a problem a run accepts ("" when they are)."""
    from tuner.config import checked_problem

    if set(values) != {f.name for f in fields(Problem)}:
        return ""  # not the export's shape of a problem: malformed, which the reader says
    shape = dict(values)
    # The registry spells "no precision" (half dtypes) as "", the config as null.
    if shape.get("precision") == "":
        shape["precision"] = None
    try:
        checked = checked_problem(**shape)
    except ConfigError as error:
        return str(error)
    stored = Problem(**values)
    if checked != stored:
        return f"{stored.label()} reads back as {checked.label()}"
    return ""


def environment_error(environment: Environment) -> str:
    if not isinstance(environment.gpu_name, str) or not environment.gpu_name.strip():
        return "environment gpu_name must be a non-empty string"
    if not RULES["device.sm_count"].accepts(environment.sm_count):
        return f"environment sm_count={environment.sm_count!r} must be an integer >= 1"
    for f in fields(Environment):
        if f.name != "sm_count" and not isinstance(getattr(environment, f.name), str):
            return f"environment {f.name}={getattr(environment, f.name)!r} must be a string"
    return ""


def plan_error(problem: Problem, environment: Environment, record: PlanRecord) -> str:
    """Why ``record`` is not a plan a tuner run could store for ``problem`` ("" when it is)."""
    try:
        family = family_named(record.family)
    except PlanError as error:
        return str(error)
    if problem.dtype not in family.dtypes:
        return (
            f"family {record.family} takes {'/'.join(family.dtypes)}, "
            f"not the problem's {problem.dtype}"
        )
    try:
        params = KernelParams.from_stored(record.family, record.params)
    except PlanError as error:
        return str(error)
    axes = RULES["search.axes"]
    for tunable in family.tunables:
        value = params.tunables[tunable.name]
        # A run searches the family's own values, or those search.axes gives it.
        if value not in tunable.values and not axes.accepts({family.axis_name(tunable): [value]}):
            return (
                f"{record.family} tunable {tunable.name}={value} is none of the family's values "
                f"({', '.join(map(str, tunable.values))}) nor an integer >= 1"
            )
    try:
        family.plan(problem, params, H200)
    except PlanError as error:
        return f"{record.family} cannot plan {record.params} for {problem.label()}: {error}"
    for name in _POSITIVE:
        value = getattr(record, name)
        if value is not None and not number_above(0).accepts(value):
            return f"{name}={value!r} must be {number_above(0).allowed}"
    for name in _NON_NEGATIVE:
        value = getattr(record, name)
        if value is not None and not number_at_least(0).accepts(value):
            return f"{name}={value!r} must be {number_at_least(0).allowed}"
    if record.measured and environment.gpu_name == MODEL_GPU_NAME:
        return f"a plan of gpu_name {MODEL_GPU_NAME!r} (the cost model, no GPU) cannot be measured"
    return ""


def row_error(problem: Problem, environment: Environment, record: PlanRecord) -> str:
    """The first reason a row of an accepted problem is not one a tuner could have
    produced (its environment, then its plan); "" for a good row."""
    return environment_error(environment) or plan_error(problem, environment, record)
