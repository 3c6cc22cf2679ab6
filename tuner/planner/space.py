"""The candidate space of a problem: every parameter combination, planned and judged.

Split targets that give the same number of splits give the same kernel and
launch, so only the first of each is kept: the space holds distinct plans.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tuner.device import DeviceProfile
from tuner.planner.tunable import KernelParams, KernelPlan, plan_kernel
from tuner.problem import Problem

DEFAULT_TILE_SIZES: tuple[int, ...] = (16, 32, 64, 128)
DEFAULT_ROWS_PER_BLOCK: tuple[int, ...] = (16, 32, 64, 128)
DEFAULT_TILED_THREADS: tuple[int, ...] = (64, 128, 256, 512)
DEFAULT_SCALAR_THREADS: tuple[int, ...] = (64, 128, 256)
#: tiles per split; the largest values mean "no split" for any sequence up to 2**20 keys.
DEFAULT_SPLIT_TARGETS: tuple[int, ...] = tuple(2**k for k in range(0, 17))


@dataclass(frozen=True, slots=True)
class SpaceAxes:
    """The values each tunable may take."""

    tile_sizes: Sequence[int] = DEFAULT_TILE_SIZES
    rows_per_block: Sequence[int] = DEFAULT_ROWS_PER_BLOCK
    tiled_threads: Sequence[int] = DEFAULT_TILED_THREADS
    scalar_threads: Sequence[int] = DEFAULT_SCALAR_THREADS
    split_targets: Sequence[int] = DEFAULT_SPLIT_TARGETS
    families: Sequence[str] = ("scalar_online", "tiled")


@dataclass(frozen=True, slots=True)
class CandidateSpace:
    feasible: tuple[KernelPlan, ...]
    rejected: tuple[KernelPlan, ...]

    def rejection_counts(self) -> Counter[str]:
        """How many candidates fell for each kind of reason (each number shown as N)."""
        return Counter(_reason_kind(plan.reason) for plan in self.rejected)


def _reason_kind(reason: str) -> str:
    """The reason with its numbers as N: ``shared memory N B exceeds ... limit N B``.

    Whole numbers only (``u32`` and ``float4s`` stay words), so the kind still reads.
    """
    return _NUMBER.sub("N", reason)


_NUMBER = re.compile(r"\b\d+(?:\.\d+)?\b")


def enumerate_params(problem: Problem, axes: SpaceAxes = SpaceAxes()) -> Iterable[KernelParams]:
    if "scalar_online" in axes.families:
        for threads in axes.scalar_threads:
            yield KernelParams("scalar_online", threads=threads)
    if "tiled" in axes.families:
        for tile in axes.tile_sizes:
            for rows in axes.rows_per_block:
                for threads in axes.tiled_threads:
                    for target in axes.split_targets:
                        yield KernelParams(
                            "tiled",
                            threads=threads,
                            tile_size=tile,
                            rows_per_block=rows,
                            split_target=target,
                        )


def candidate_space(
    problem: Problem, device: DeviceProfile, axes: SpaceAxes = SpaceAxes()
) -> CandidateSpace:
    feasible: list[KernelPlan] = []
    rejected: list[KernelPlan] = []
    seen: set[str] = set()
    for params in enumerate_params(problem, axes):
        plan = plan_kernel(problem, params, device)
        if plan.key() in seen:
            continue
        seen.add(plan.key())
        (feasible if plan.feasible else rejected).append(plan)
    return CandidateSpace(tuple(feasible), tuple(rejected))
