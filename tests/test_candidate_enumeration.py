"""The candidate space enumerates less than every combination and loses nothing by it.

A family skips combinations that name no kernel whatever the problem (``coherent``: the
Hopper ping-pong without the overlap it orders) and split targets that repeat an earlier
target's number of splits (the same plan key, of which the space keeps the first). Both
must leave the space's feasible plans, their order and the first parameters of every key
exactly as planning the whole product would.
"""

from __future__ import annotations

import itertools
import time

import pytest

from tuner.device import H200
from tuner.planner import KernelParams, SpaceAxes, candidate_space, plan_kernel
from tuner.planner.families import family_named
from tuner.problem import Problem

PROBLEMS = [
    Problem(4096, 128, batch=4, heads=16, dtype="bfloat16"),
    Problem(1000, 64, heads=3, causal=True, dtype="float16"),
    # a decode-like query over a long cache: several split counts
    Problem(16, 128, heads=32, kv_heads=8, kv_len=30000, dtype="bfloat16"),
    Problem(777, 256, batch=2, heads=4, kv_len=5000, causal=True, dtype="bfloat16"),
]


def every_combination(problem: Problem, family: str) -> list:
    """What the space held before: the whole product planned, the first plan of each key."""
    kernel = family_named(family)
    tunables = kernel.ordered_tunables()
    plans, seen = [], set()
    for values in itertools.product(*(t.values for t in tunables)):
        params = KernelParams(family, **{t.name: v for t, v in zip(tunables, values, strict=True)})
        plan = plan_kernel(problem, params, H200)
        if plan.key() not in seen:
            seen.add(plan.key())
            plans.append(plan)
    return plans


@pytest.mark.parametrize("family", ["wgmma_f16", "mma_f16"])
@pytest.mark.parametrize("problem", PROBLEMS, ids=[p.label() for p in PROBLEMS])
def test_the_enumeration_keeps_every_plan_of_the_whole_product(
    problem: Problem, family: str
) -> None:
    full = every_combination(problem, family)
    space = candidate_space(problem, H200, SpaceAxes(families=[family]))
    assert [p.params for p in space.feasible] == [p.params for p in full if p.feasible]
    assert space.feasible  # every problem here has plans of both families
    # what it no longer lists are combinations no problem could take
    kernel = family_named(family)
    kept = {p.key() for p in space.rejected}
    assert kept <= {p.key() for p in full if not p.feasible}
    for plan in full:
        if not plan.feasible and plan.key() not in kept:
            assert not kernel.coherent(plan.params.tunables), plan.reason


def test_incoherent_combinations_are_still_refused_with_their_reason() -> None:
    problem = PROBLEMS[0]
    kernel = family_named("wgmma_f16")
    for values, words in [
        ({"pingpong": 1, "overlap": 0}, "with overlap=1"),
        ({"pingpong": 1, "overlap": 1, "consumers": 1}, "two or three consumers"),
        ({"late_pack": 1, "overlap": 0}, "it needs overlap=1"),
        ({"rescale_slack": 8, "overlap": 0}, "rescales: it needs overlap=1"),
        ({"blocks_per_sm": 2, "consumers": 2}, "2 only with 1"),
    ]:
        params = KernelParams("wgmma_f16", **values)
        assert not kernel.coherent(params.tunables)
        plan = plan_kernel(problem, params, H200)
        assert not plan.feasible and words in plan.reason, plan.reason


def test_planning_the_hopper_space_takes_under_three_seconds() -> None:
    # 4x16x4096x128 bf16 took 4.0 s on this project's 2-core CI machine with nine key tiles
    # and late packing, 88128 plans, before the enumeration skipped what it now skips (0.8 s);
    # the rescale slack doubles the overlapped plans: 31248 planned, 1.5-1.8 s there
    start = time.perf_counter()
    space = candidate_space(PROBLEMS[0], H200)
    assert time.perf_counter() - start < 3.0
    assert len(space.feasible) + len(space.rejected) < 40000


def test_a_tunable_named_like_a_params_attribute_is_refused_at_registration() -> None:
    """KernelParams holds each tunable as an instance attribute: one named ``values`` (a
    field) or ``tunables`` (a property) would shadow it, so a family declaring one is
    refused when it registers, not each time params are made."""
    from tuner.planner.errors import PlanError
    from tuner.planner.families import register, registered
    from tuner.planner.families.base import Tunable

    hopper = family_named("wgmma_f16")
    for name in ("values", "tunables"):
        shadowing = type(
            "Shadowing", (type(hopper),),
            {"name": f"shadowing_{name}", "tunables": (*hopper.tunables, Tunable(name, 0, (0,)))},
        )()
        with pytest.raises(PlanError, match=f"may not be named '{name}'"):
            register(shadowing)
        assert shadowing not in registered()
    params = KernelParams("wgmma_f16", block_n=80)
    assert params.block_n == 80 and params.tunables["block_n"] == 80
