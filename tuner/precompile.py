"""Compile before measuring, and re-judge each plan by ptxas's report.

Two ways, both in the parent process (nvcc needs no GPU, and no CUDA context is
made), both letting the compiler rule plans out before any GPU time is spent: a
variant nvcc rejects, or whose registers spill or exceed the register file
(``KernelPlan.with_resources``), is never measured.

* ``precompile``: every variant of the space up front (``kernels.build.compile_many``,
  one nvcc per CPU); the plans the compiler rules out join the rejected ones.
  What several workers sharing a study, and the samplers whose proposals cannot
  be foreseen (tpe, random, grid), start from.
* ``CompileAhead``: only what the search is about to measure, a window ahead of
  it, in the background while the GPU measures (a default search measures
  10-20 of hundreds of plans). The search asks ``judged(plan)`` before it
  measures a plan, and a plan the compiler rules out is a free ``infeasible``
  trial. The predictions then use the planner's register estimate for the
  plans not compiled yet; replayed on the recorded grids, the search stores
  the same plans with either (``bench/README.md``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from tqdm import tqdm

from tuner.device import DeviceProfile
from tuner.planner.tunable import KernelPlan

if TYPE_CHECKING:
    from kernels.build import CompileResult


def precompile(
    plans: Sequence[KernelPlan],
    device: DeviceProfile,
    cache_dir: str,
    jobs: int = 0,
) -> tuple[list[KernelPlan], list[KernelPlan]]:
    """(plans the compiler accepts, re-judged with their resources; plans it rules out).

    Raises ``BackendError`` only when a variant is not cached and there is no nvcc.
    """
    from kernels import build

    with tqdm(
        total=len({build.KernelSpec.from_plan(p).key for p in plans}),
        desc="compiling",
        unit="kernel",
        file=sys.stderr,
        disable=None,  # no bar where stderr is not a terminal
    ) as bar:
        results = build.compile_many(
            plans,
            cache_dir,
            jobs=jobs or None,
            arch=device.arch,
            progress=lambda done, total, result: bar.update(1),
        )
    accepted: list[KernelPlan] = []
    rejected: list[KernelPlan] = []
    for plan in plans:
        result = results[build.KernelSpec.from_plan(plan).key]
        if isinstance(result, build.CompileFailure):
            reason = f"nvcc rejects it: {result.reason}"
            rejected.append(dataclasses.replace(plan, feasible=False, reason=reason))
            continue
        judged = plan.with_resources(result.primary_resources, device)
        (accepted if judged.feasible else rejected).append(judged)
    return accepted, rejected


class CompileAhead:
    """Compiles the variants of the plans the search is about to measure, in the background.

    ``request(plans)`` queues their variants (in order, each once) on ``jobs``
    nvcc threads; ``judged(plan)`` waits for the plan's variant (queuing it first
    if nobody asked) and returns the plan re-judged by ptxas's report, or ruled
    out with nvcc's reason. ``window``: how many upcoming plans the search keeps
    queued (the number of threads by default: they compile in one round).
    Raises ``BackendError`` from ``judged`` only when a variant is not cached and
    there is no nvcc.
    """

    def __init__(
        self, device: DeviceProfile, cache_dir: str, jobs: int = 0, window: int = 0
    ) -> None:
        from kernels import build

        self._build = build
        self.device = device
        self.cache_dir = cache_dir
        self.jobs = jobs or os.cpu_count() or 1
        self.window = window or self.jobs
        self._pool = ThreadPoolExecutor(max_workers=self.jobs, thread_name_prefix="nvcc")
        self._futures: dict[str, Future[CompileResult]] = {}

    def request(self, plans: Iterable[KernelPlan]) -> None:
        for plan in plans:
            spec = self._build.KernelSpec.from_plan(plan)
            if spec.key not in self._futures:
                self._futures[spec.key] = self._pool.submit(
                    self._build.compile_kernel, spec, self.cache_dir, self.device.arch
                )

    def judged(self, plan: KernelPlan) -> KernelPlan:
        self.request([plan])
        result = self._futures[self._build.KernelSpec.from_plan(plan).key].result()
        if isinstance(result, self._build.CompileFailure):
            return dataclasses.replace(
                plan, feasible=False, reason=f"nvcc rejects it: {result.reason}"
            )
        return plan.with_resources(result.primary_resources, self.device)

    @property
    def variants(self) -> tuple[int, int]:
        """(variants asked for, of which served from the cache), among those finished."""
        done = [
            f.result()
            for f in self._futures.values()
            if f.done() and not f.cancelled() and f.exception() is None
        ]
        cached = sum(1 for r in done if getattr(r, "cache_hit", False))
        return len(self._futures), cached

    def close(self) -> None:
        """Drop what has not started; the compiles running finish into the cache."""
        self._pool.shutdown(wait=False, cancel_futures=True)
