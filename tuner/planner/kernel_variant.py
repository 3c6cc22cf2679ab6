"""One compiled kernel, many problems: a plan's kernel variant at other KV lengths.

A plan's kernel variant is what its cubin is built from (the family and its compile defines)
with the block and dynamic shared memory it is launched with. Every family takes ``seq_len``,
``kv_len`` and the split partition (``keys_per_split``, the split count as ``gridDim.y``) as
launch arguments (the split-KV contract, ``families.base.split_kv_launches``), so one variant
serves every KV length; ``tests/test_kernel_variant.py`` checks that the compile defines of
every family's feasible plans stay the same across lengths.

* ``plan_at(plan, problem, device)``: the plan of ``problem`` (``plan.problem`` with a shorter
  or equal ``kv_len``) that launches ``plan``'s kernel with the partition the family's own
  rule gives at that length: the same tunables re-planned, about 15 us on the host, no cost
  model. The verdicts a search applies to the candidates of a length ("a tile larger than
  needed", "splits without keys") are for choosing among kernels, not for running one already
  chosen: the plan is judged by the plan it derives from (same kernel, block, shared memory
  and registers), its split scratch no larger. ``kv_len`` and the partition are data the
  kernel reads per launch, exactly as in tuning, where every length runs the same cubin.
* ``launch_choices(problem, plan, device)``: the feasible plans of ``problem`` that launch
  ``plan``'s kernel, over the values of the tunables that leave its compile defines alone
  (``decode_f16``'s split count, the split targets): a handful of plans, so a new KV bucket
  picks its partition with the cost model without a compile or a full candidate space.

Pure: the planner's own types.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from tuner.device import DeviceProfile
from tuner.planner.families.base import KernelFamily, Tunable
from tuner.planner.params import KernelParams
from tuner.planner.plan import KernelPlan, occupancy_and_waves
from tuner.planner.tunable import plan_kernel
from tuner.problem import Problem


def same_kernel(one: KernelPlan, other: KernelPlan) -> bool:
    """Whether two plans launch one compiled kernel the same way: family, compile defines,
    block and dynamic shared memory."""
    return (
        one.params.family == other.params.family
        and one.compile_defines() == other.compile_defines()
        and one.launch.block == other.launch.block
        and one.launch.shared_bytes == other.launch.shared_bytes
    )


def _scratch_fits(plan: KernelPlan, within: KernelPlan) -> bool:
    needed = plan.kernel_family.buffer_elements(plan)
    held = within.kernel_family.buffer_elements(within)
    return needed.partial_o <= held.partial_o and needed.partial_ml <= held.partial_ml


def length_family(problem: Problem) -> tuple[object, ...]:
    """What problems differing only in ``kv_len`` share: every field of the problem but it."""
    p = problem
    return (
        p.seq_len,
        p.head_dim,
        p.batch,
        p.heads,
        p.kv_heads,
        p.causal,
        p.dtype,
        p.precision,
        p.window_left,
        p.window_right,
        p.softcap,
        p.alibi,
        p.sinks,
    )


def plan_at(plan: KernelPlan, problem: Problem, device: DeviceProfile) -> KernelPlan | str:
    """``plan``'s kernel at ``problem``'s KV length (see the module doc), or why it cannot
    serve it (another problem, a longer cache, or a family whose kernel would change)."""
    if length_family(problem) != length_family(plan.problem):
        return f"{problem.label()} is not {plan.problem.label()} at another kv_len"
    if problem.kv_len > plan.problem.kv_len:
        return f"kv_len={problem.kv_len} is longer than the plan's {plan.problem.kv_len}"
    if problem.kv_len == plan.problem.kv_len:
        return plan
    at = plan_kernel(problem, plan.params, device)
    if not same_kernel(at, plan):
        return (
            f"{plan.key()} changes its kernel at kv_len={problem.kv_len} (compile defines, "
            "block or shared memory)"
        )
    if not _scratch_fits(at, plan):
        return f"{at.key()} needs more split scratch at kv_len={problem.kv_len} than {plan.key()}"
    # Judged as the plan it derives from (one replace: plans have many fields to copy).
    occupancy, waves = occupancy_and_waves(at.launch, at.threads, plan.blocks_per_sm, device)
    return replace(
        at,
        feasible=True,
        reason="",
        resources=plan.resources,
        blocks_per_sm=plan.blocks_per_sm,
        occupancy=occupancy,
        waves=waves,
    )


def launch_tunables(plan: KernelPlan, device: DeviceProfile) -> tuple[Tunable, ...]:
    """The family's tunables whose every value keeps ``plan``'s compile defines."""
    family: KernelFamily = plan.kernel_family
    base, defines = plan.params.tunables, plan.compile_defines()
    free = []
    for tunable in family.tunables:
        kept = all(
            plan_kernel(
                plan.problem, KernelParams(family.name, **(base | {tunable.name: value})), device
            ).compile_defines()
            == defines
            for value in tunable.values
        )
        if kept:
            free.append(tunable)
    return tuple(free)


def launch_choices(
    problem: Problem, plan: KernelPlan, device: DeviceProfile
) -> tuple[KernelPlan, ...]:
    """The feasible plans of ``problem`` that launch ``plan``'s kernel, one per plan key."""
    base = plan.params.tunables
    free = launch_tunables(plan, device)
    found: dict[str, KernelPlan] = {}
    for values in itertools.product(*(tunable.values for tunable in free)):
        chosen = base | {tunable.name: value for tunable, value in zip(free, values, strict=True)}
        candidate = plan_kernel(problem, KernelParams(plan.params.family, **chosen), device)
        if candidate.feasible and same_kernel(candidate, plan):
            found.setdefault(candidate.key(), candidate)
    return tuple(found.values())
